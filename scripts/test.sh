#!/usr/bin/env bash
# Fresh machine -> the full test suite (2 workers, one thread each: tiny models run fastest that way).
source "$(dirname "$0")/venv.sh" dev
step "running the test suite (12-18 minutes on 2 CPU cores)"
OMP_NUM_THREADS=1 python -m pytest -n 2 --timeout 1800 -q "$@"
