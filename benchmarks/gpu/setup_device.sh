#!/usr/bin/env bash
# Sourced at the start of every device command: wheels the GPU image lacks, paths, environment report.
# Carried paths (git-ignored): .whl (datasets, dill, multiprocess, gguf wheels), .device/data (shared data copy).
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
if [ ! -d /tmp/site/datasets ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
fi
export PYTHONPATH=$PWD/src:/tmp/site
export HF_DSPARK_CACHE=/root/hf_dspark_cache
python3 - <<'PY'
import torch, transformers, accelerate, pyarrow, datasets
print(f"device: {torch.cuda.get_device_name()} | torch {torch.__version__} | transformers {transformers.__version__} "
      f"| accelerate {accelerate.__version__} | pyarrow {pyarrow.__version__} | datasets {datasets.__version__}")
PY
