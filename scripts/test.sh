#!/usr/bin/env bash
# Fresh machine -> full test suite. Installs CPU torch first (a bare `torch` requirement would pull a CUDA
# build), then the package with its test extras, into ./.venv.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
. .venv/bin/activate
python -m pip install -q --upgrade pip
python -m pip install -q "torch==2.13.0"
python -m pip install -q -e ".[dev]"
OMP_NUM_THREADS=1 python -m pytest -n 2 --timeout 1800 -q "$@"
