#!/usr/bin/env bash
# GPU session A: training-path validation and speed at DeepSpec's production shapes and on a SmolLM2-shaped
# random target. Run by the device tool from the repo root with carry [.whl, .device/data].
source benchmarks/gpu/setup_device.sh
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 benchmarks/gpu/random_smollm2.py .device/data/smol_config /tmp/smol_random 2>&1 | tail -1
timeout 230 python3 benchmarks/train_production_shapes.py --output "$OUT/train_production_shapes.json" > "$OUT/prod.log" 2>&1
echo "production shapes rc=$?"; tail -15 "$OUT/prod.log"
timeout 200 python3 benchmarks/train_throughput.py --data .device/data/smollm2-135m-instruct.jsonl.gz \
  --target_model /tmp/smol_random --mode online --time_budget 60 --eval_rows 64 --output_dir /tmp/draft_random \
  --output "$OUT/train_throughput_random_target.json" > "$OUT/throughput.log" 2>&1
echo "throughput rc=$?"; tail -22 "$OUT/throughput.log"
