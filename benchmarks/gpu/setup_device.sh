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

# The real SmolLM2-135M-Instruct target (sessions b and c): its GGUF travels as two halves, one per call (the tool
# carries <= 64 MiB a call); the data copy travels with the first.
export HF_DSPARK_DEFAULT_GGUF=/root/gguf/smollm2.gguf
DATA=/root/data
copy_first_half() {  # carry [.whl, .device/data, .device/gguf1]
  mkdir -p /root/gguf "$DATA" && cp .device/gguf1/gguf.part00 /root/gguf/ && cp -r .device/data/. "$DATA"/
  ls -la /root/gguf "$DATA" | head -20
}
assemble_target() {  # carry [.device/gguf2]; the first conversion to safetensors happens on the first load
  cat /root/gguf/gguf.part00 .device/gguf2/gguf.part01 > "$HF_DSPARK_DEFAULT_GGUF"
  want=$(cut -d' ' -f1 .device/gguf2/gguf.sha256); got=$(sha256sum "$HF_DSPARK_DEFAULT_GGUF" | cut -d' ' -f1)
  [ "$want" = "$got" ] || { echo "GGUF checksum mismatch"; return 1; }
}
target_path() { python3 -c "from hf_dspark.resources import default_target_path as p; print(p())" 2>/dev/null | tail -1; }
