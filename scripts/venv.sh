# Sourced by demo.sh and test.sh: ./.venv with the CPU build of torch first (a bare `torch` requirement would
# pull a multi-GB CUDA build), then the package with the extras given as "$1".
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
python3 -m venv .venv
. .venv/bin/activate
python -m pip install -q --upgrade pip
python -m pip install -q "torch==2.13.0"
python -m pip install -q -e ".[$1]"
