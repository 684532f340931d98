#!/usr/bin/env bash
# GPU session C: three SmolLM2-135M-Instruct drafts trained for the same steps, then evaluated and timed.
# One stage per device command, issued back to back so the machine stays warm (it is given back after 30 s idle):
#   copy1  carry [.whl, .device/data, .device/gguf1]: wheels, data, first half of the GGUF (<= 64 MiB per call)
#   train  carry [.device/gguf2]: assemble + convert the target, start DSpark, DFlash and Eagle3 training through
#          examples/train_dspark.py in their own process sessions (setsid: they outlive this command), all three
#          at once on the one GPU (measured: they do contend; DSpark ran ~3x slower than alone), then report
#          progress until POLL_S
#   poll   report progress until POLL_S (a call of its own when the training window outlasts the train call)
#   wait_eval  wait for the runs until TRAIN_S after their start; runs still going then are stopped and every
#          drafter is taken at the newest checkpoint step all three reached, so the comparison keeps equal steps;
#          then hf-dspark eval (acceptance, calibration, tokens/s) on the three eval sets at T=0 and T=1
#   speed  benchmarks/generation_speed.py: batch 1 and batch 16, greedy and T=1, against target.generate() alone
#          and prompt lookup, DSpark with the threshold and prefix schedulers
# Everything that comes back is under $OUT (at most 8 files): JSON results and one tarball of logs and plots.
set -u
stage=$1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
source benchmarks/gpu/setup_device.sh  # also: DATA, copy_first_half, assemble_target, target_path
RUNS=/root/drafts_long LOGS=/root/logs
ALGOS=${ALGOS:-"dspark dflash eagle3"}  # e.g. ALGOS=dspark STEPS=2500 TRAIN_S=1300: one drafter for a whole session
STEPS=${STEPS:-600}  # one epoch of the 9,619 training conversations at batch 16
running() { pgrep -f "examples/train_dspark.py" >/dev/null; }
newest_step() { ls -d $RUNS/$1/checkpoint-* 2>/dev/null | sed 's/.*-//' | sort -n | tail -1; }
progress() {
  for algo in $ALGOS; do
    last=$(grep -o "'loss': [0-9.]*\|'eval_tau_prob': [0-9.]*\|'epoch': [0-9.]*" "$LOGS/$algo.log" 2>/dev/null | tail -3 | tr '\n' ' ')
    ckpt=$(newest_step $algo)
    echo "  $algo: checkpoint ${ckpt:-none} | $last"
  done
}
case "$stage" in
copy1)
  copy_first_half
  ;;
train)
  assemble_target || exit 1
  echo "target at $(target_path)"
  mkdir -p "$LOGS" "$RUNS"; date +%s > /root/train_start
  for algo in $ALGOS; do
    layers=$([ $algo = eagle3 ] && echo 1 || echo 2)
    # Same data order (seed), steps, schedule and target layers for all three; Eagle3 one layer as in the paper.
    setsid nohup python3 examples/train_dspark.py --train_file "$DATA/smollm2-135m-instruct.jsonl.gz" \
      --algorithm $algo --num_hidden_layers $layers --block_size 7 --max_length 1024 --pad_to_multiple_of 1024 \
      --per_device_train_batch_size 16 --learning_rate 6e-4 --lr_scheduler_type cosine --warmup_steps 0.04 \
      --max_steps $STEPS --bf16 --compile_loss True --save_strategy steps --save_steps 100 --logging_steps 50 \
      --eval_strategy steps --eval_steps 200 --per_device_eval_batch_size 16 --eval_rows 256 \
      --report_to none --disable_tqdm True --output_dir $RUNS/$algo > "$LOGS/$algo.log" 2>&1 < /dev/null &
  done
  sleep 5; nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv
  start=$(cat /root/train_start)
  # Poll against this command's own clock ($SECONDS): the call is cut at 600 s, and a cut call returns no output.
  while running && [ $SECONDS -lt ${POLL_S:-540} ]; do
    sleep 30; echo "t=$(( $(date +%s) - start ))s"; progress
    nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv,noheader
  done
  tail -3 "$LOGS"/*.log
  ;;
poll)  # between train and wait_eval when training outlasts one call (TRAIN_S > ~1100 s)
  start=$(cat /root/train_start)
  while running && [ $SECONDS -lt ${POLL_S:-540} ]; do sleep 30; echo "t=$(( $(date +%s) - start ))s"; progress; done
  ;;
wait_eval)
  start=$(cat /root/train_start); deadline=$(( start + ${TRAIN_S:-720} ))
  while running && [ $(date +%s) -lt $deadline ]; do sleep 10; done
  : > /root/drafts_used.txt
  if running; then
    pkill -f "examples/train_dspark.py"; sleep 5
    # Equal steps: the newest checkpoint step that every drafter reached.
    common=$(for algo in $ALGOS; do newest_step $algo; done | sort -n | head -1)
    echo "stopped at the deadline; using checkpoint-$common of each drafter (schedule planned for $STEPS steps)"
    for algo in $ALGOS; do echo "$algo=$RUNS/$algo/checkpoint-$common" >> /root/drafts_used.txt; done
  else
    for algo in $ALGOS; do echo "$algo=$RUNS/$algo" >> /root/drafts_used.txt; done
  fi
  progress; cat /root/drafts_used.txt
  for algo in $ALGOS; do  # learning curves (log_history) of the newest checkpoint
    cp "$RUNS/$algo/checkpoint-$(newest_step $algo)/trainer_state.json" "$LOGS/trainer_state_$algo.json"
  done
  drafts=$(sed 's/^/--draft /' /root/drafts_used.txt | tr '\n' ' ')
  remain=$(( 585 - SECONDS ))
  [ $remain -gt 60 ] || { echo "only ${remain}s left in this call: run wait_eval again to evaluate"; exit 0; }
  timeout $remain python3 -m hf_dspark.cli eval --target "$(target_path)" $drafts \
    --data gsm8k=$DATA/gsm8k.jsonl --data humaneval=$DATA/humaneval.jsonl --data mt-bench=$DATA/mt-bench.jsonl \
    --num_prompts ${EVAL_PROMPTS:-16} --max_new_tokens 128 --temperature 0 1 --batch_size 16 --dtype bfloat16 \
    --output_dir /root/eval --no_progress > "$LOGS/eval.log" 2>&1
  echo "eval rc=$? after ${SECONDS}s"; tail -3 "$LOGS/eval.log"
  cp /root/eval/results.json "$OUT/eval_results.json" 2>/dev/null
  cp /root/drafts_used.txt "$OUT/"
  tar czf "$OUT/logs_eval.tar.gz" -C /root logs eval 2>/dev/null
  head -40 /root/eval/results.md 2>/dev/null
  ;;
speed)
  T=$(target_path)
  drafts=$(sed 's/^/--draft /' /root/drafts_used.txt | tr '\n' ' ')
  common="--target $T $drafts --prompts $DATA/mt-bench.jsonl --max-new-tokens 96 --temperatures 0 1 --dtype bfloat16"
  timeout 330 python3 benchmarks/generation_speed.py $common --num-prompts 4 --batch-sizes 1 \
    --json "$OUT/generation_speed_b1.json" > "$LOGS/speed_b1.log" 2>&1
  echo "batch 1 rc=$?"; tail -18 "$LOGS/speed_b1.log"
  timeout $(( 585 - SECONDS )) python3 benchmarks/generation_speed.py $common --num-prompts 16 --batch-sizes 16 \
    --json "$OUT/generation_speed_b16.json" --profile "$LOGS/profile_b16.txt" --profile-temperature ${PROFILE_T:-0} \
    > "$LOGS/speed_b16.log" 2>&1
  echo "batch 16 rc=$?"; tail -18 "$LOGS/speed_b16.log"
  tar czf "$OUT/logs_speed.tar.gz" -C /root logs 2>/dev/null
  ;;
esac
