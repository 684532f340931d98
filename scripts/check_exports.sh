#!/usr/bin/env bash
# Check the export formats against the consumers' released code (tests/test_export_consumers.py and the
# format tests), in a throwaway virtual environment that is removed afterwards:
#   - speculators is installed there and imported for real (its config classes and draft models);
#   - the vLLM and SGLang wheels are downloaded and unpacked, not installed (they need CUDA builds): the tests
#     execute vLLM's self-contained speculators-config module and check the loader statements they rely on;
#   - DeepSpec is cloned and its own from_pretrained loads the deepspec exports.
# Tests that would skip for a missing consumer fail instead (HF_DSPARK_REQUIRE_CONSUMERS=1).
# Usage: scripts/check_exports.sh [pytest args]   (PYTHON= the interpreter of the project's environment)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="${PYTHON:-$ROOT/.venv/bin/python}"
VLLM_VERSION="${VLLM_VERSION:-0.33.0}"
SGLANG_VERSION="${SGLANG_VERSION:-0.5.23}"
SPECULATORS_VERSION="${SPECULATORS_VERSION:-0.9.0}"
DEEPSPEC_REPO="${DEEPSPEC_REPO:-https://github.com/deepseek-ai/DeepSpec}"

WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT

# The throwaway venv sees the project's environment (torch, transformers, hf_dspark's dependencies) through a
# .pth file, so only the consumers' own extra packages are installed into it.
"$PYTHON" -m venv "$WORK/venv"
project_site="$("$PYTHON" -c 'import site; print(site.getsitepackages()[0])')"
venv_site="$("$WORK/venv/bin/python" -c 'import site; print(site.getsitepackages()[0])')"
echo "$project_site" > "$venv_site/project_env.pth"
"$WORK/venv/bin/python" -m pip install -q --no-deps "speculators==$SPECULATORS_VERSION"
# What `import speculators` needs beyond torch/transformers/pydantic (its training-data modules import them).
"$WORK/venv/bin/python" -m pip install -q openai hs_connectors

mkdir -p "$WORK/wheels" "$WORK/src"
"$WORK/venv/bin/python" -m pip download -q --no-deps -d "$WORK/wheels" \
    "vllm==$VLLM_VERSION" "sglang==$SGLANG_VERSION"
# Their Python sources only (the wheels' compiled kernels are of no use on CPU).
"$WORK/venv/bin/python" - "$WORK/src" "$WORK"/wheels/*.whl <<'PY'
import sys, zipfile
for wheel in sys.argv[2:]:
    with zipfile.ZipFile(wheel) as z:
        z.extractall(sys.argv[1], [n for n in z.namelist() if n.endswith(".py") and n.split("/")[0] in ("vllm", "sglang")])
PY
# DeepSpec: an existing checkout (DEEPSPEC_SRC=folder holding deepspec/), else a fresh clone.
if [[ -n "${DEEPSPEC_SRC:-}" ]]; then
    cp -r "$DEEPSPEC_SRC/deepspec" "$WORK/src/"
    deepspec_rev="$(git -C "$DEEPSPEC_SRC" rev-parse --short HEAD 2>/dev/null || echo "local copy")"
else
    git clone -q --depth 1 "$DEEPSPEC_REPO" "$WORK/DeepSpec"
    mv "$WORK/DeepSpec/deepspec" "$WORK/src/"
    deepspec_rev="$(git -C "$WORK/DeepSpec" rev-parse --short HEAD)"
fi

cd "$ROOT"
echo "consumers: vllm $VLLM_VERSION, sglang $SGLANG_VERSION, speculators $SPECULATORS_VERSION, DeepSpec $deepspec_rev"
OMP_NUM_THREADS=1 HF_DSPARK_CONSUMER_SRC="$WORK/src" HF_DSPARK_REQUIRE_CONSUMERS=1 PYTHONPATH="$ROOT/src" \
    "$WORK/venv/bin/python" -m pytest -q -p no:cacheprovider \
    tests/test_export_consumers.py tests/test_export_formats.py tests/test_qk_norm_drafts.py "$@"
