#!/usr/bin/env bash
# GPU session B: the real SmolLM2-135M-Instruct target. Stages, each one device command, issued back to back so the
# machine stays warm (drafts and the converted target live outside the repo, in /root):
#   copy1  carry [.whl, .device/data, .device/gguf1]: first half of the GGUF (the tool carries <= 64 MiB a call)
#   train  carry [.device/gguf2]: assemble + convert the target, train DSpark, DFlash, Eagle3 (same steps)
#   eval   acceptance/calibration/speed of the three drafts (hf-dspark eval) and generation_speed.py
#   extra  production-shape training step with a profile
#   train_long  (next session) the three drafters trained concurrently on the one GPU (each alone leaves it mostly
#          idle) through examples/train_dspark.py for $STEPS steps each, checkpoints every 250 steps; re-running it
#          resumes from the last checkpoint, so a longer schedule spans several device calls
#   speed  generation_speed.py at batch 1 and 16 (short settings, fits one call)
set -u
stage=$1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
source benchmarks/gpu/setup_device.sh  # also: DATA, copy_first_half, assemble_target, target_path
case "$stage" in
copy1)
  copy_first_half
  ;;
train)
  assemble_target || exit 1
  echo "target at $(target_path)"
  timeout 500 python3 benchmarks/train_throughput.py --data "$DATA/smollm2-135m-instruct.jsonl.gz" \
    --algorithms dspark dflash eagle3 --num_hidden_layers 2 --block_size 7 --time_budget 75 --eval_rows 256 \
    --probe_cache_rows 64 --output_dir /root/drafts --output "$OUT/train_smollm2.json" > "$OUT/train.log" 2>&1
  echo "train rc=$?"; grep -v "it/s\]\|examples/s\]" "$OUT/train.log" | tail -12
  ;;
eval)
  T=$(target_path)
  timeout 330 python3 -m hf_dspark.cli eval --target "$T" \
    --draft dspark=/root/drafts/dspark --draft dflash=/root/drafts/dflash --draft eagle3=/root/drafts/eagle3 \
    --data gsm8k=$DATA/gsm8k.jsonl --data humaneval=$DATA/humaneval.jsonl --data mt-bench=$DATA/mt-bench.jsonl \
    --num_prompts 40 --max_new_tokens 256 --temperature 0 1 --batch_size 8 --dtype bfloat16 \
    --output_dir "$OUT/eval" --no_progress > "$OUT/eval.log" 2>&1
  echo "eval rc=$?"; tail -5 "$OUT/eval.log"; head -30 "$OUT/eval/results.md" 2>/dev/null
  timeout 230 python3 benchmarks/generation_speed.py --target "$T" --draft dspark=/root/drafts/dspark \
    --draft dflash=/root/drafts/dflash --draft eagle3=/root/drafts/eagle3 --prompts $DATA/mt-bench.jsonl \
    --num-prompts 16 --max-new-tokens 128 --batch-sizes 1 16 --temperatures 0 1 --dtype bfloat16 \
    --json "$OUT/generation_speed.json" > "$OUT/speed.log" 2>&1
  echo "speed rc=$?"; tail -32 "$OUT/speed.log"
  ;;
train_long)
  STEPS=${STEPS:-1500}
  for algo in dspark dflash eagle3; do
    layers=$([ $algo = eagle3 ] && echo 1 || echo 2)
    dir=/root/drafts_long/$algo; resume=""
    ls -d $dir/checkpoint-* >/dev/null 2>&1 && resume="--resume_from_checkpoint True"
    timeout 560 python3 examples/train_dspark.py --train_file "$DATA/smollm2-135m-instruct.jsonl.gz" \
      --algorithm $algo --num_hidden_layers $layers --block_size 7 --max_length 1024 --pad_to_multiple_of 1024 \
      --per_device_train_batch_size 16 --learning_rate 6e-4 --lr_scheduler_type cosine --warmup_steps 0.04 \
      --max_steps $STEPS --bf16 --compile_loss True --save_strategy steps --save_steps 250 --logging_steps 50 \
      --report_to none --disable_tqdm True --eval_rows 256 --output_dir $dir $resume > "$OUT/train_long_$algo.log" 2>&1 &
  done
  wait
  for algo in dspark dflash eagle3; do echo "== $algo"; grep -E "'loss'|eval_tau|train_runtime" "$OUT/train_long_$algo.log" | tail -3; done
  ;;
speed)
  T=$(target_path)
  D=${DRAFTS:-/root/drafts}
  timeout 560 python3 benchmarks/generation_speed.py --target "$T" --draft dspark=$D/dspark --draft dflash=$D/dflash \
    --draft eagle3=$D/eagle3 --prompts $DATA/mt-bench.jsonl --num-prompts 8 --max-new-tokens 96 --batch-sizes 1 16 \
    --temperatures 0 1 --dtype bfloat16 --json "$OUT/generation_speed.json" > "$OUT/speed.log" 2>&1
  echo "speed rc=$?"; tail -32 "$OUT/speed.log"
  ;;
extra)
  timeout 250 python3 benchmarks/train_production_shapes.py --output "$OUT/train_production_shapes.json" \
    --profile "$OUT/production_profile.txt" > "$OUT/prod.log" 2>&1
  echo "prod rc=$?"; grep -A12 "^| metric" "$OUT/prod.log"; head -30 "$OUT/production_profile.txt"
  ;;
esac
