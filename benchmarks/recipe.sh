#!/usr/bin/env bash
# Train a DSpark draft with the default recipe for a fixed wall-clock budget, then measure it: held-out tau on
# three prompt sets (hf-dspark eval; one chain a round, and trees of two and four first-slot candidates) and decoding
# speed against target.generate() (generation_speed.py).
# Reproduces the README's "Measured results" on any CUDA machine:
#
#   benchmarks/recipe.sh TARGET_DIR DATA_DIR OUT_DIR [MINUTES [TRAINING FLAGS...]]
#
# TARGET_DIR: the target model folder (hf_dspark.resources.default_target_path() gives the embedded SmolLM2);
# DATA_DIR: the target's own answers (*.jsonl.gz, conversations format) and gsm8k/humaneval/mt-bench .jsonl prompt
# files; OUT_DIR: the draft, logs and JSON results. MINUTES (default 10) bounds the training (compilation included);
# further arguments go to the training script (e.g. --num_hidden_layers 1).
set -euo pipefail
TARGET=$1 DATA=$2 OUT=$3 MINUTES=${4:-10}
shift $(( $# < 4 ? $# : 4 ))
HERE=$(cd "$(dirname "$0")" && pwd)
mkdir -p "$OUT"
# The learning-rate schedule is fitted to MINUTES (the trainer measures its step rate and plans the total);
# STEPS, when given, caps it (STEPS with a large MINUTES repeats a run with a fixed step count). PATHS lists the
# decoding paths timed at batch 1 beside the default (generation_speed.py --compare-paths; each compiles anew).
STEPS=${STEPS:-1000000}
python3 "$HERE/../examples/train_dspark.py" --target_model "$TARGET" --train_file "$DATA"/*.jsonl.gz \
  --output_dir "$OUT/dspark" --max_steps "$STEPS" --max_train_minutes "$MINUTES" --save_strategy no \
  --logging_steps 100 --eval_strategy steps --eval_steps 1000 --eval_rows 256 --per_device_eval_batch_size 16 \
  --report_to none --disable_tqdm True --seed 0 "$@" 2>&1 | tee "$OUT/train.log"
# The draft as is and with two and four first-slot candidates a round (trees; same prompts, seeds and baselines).
hf-dspark eval --target "$TARGET" --draft dspark="$OUT/dspark" dspark_k2="$OUT/dspark" dspark_k4="$OUT/dspark" \
  --draft_kwargs 'dspark_k2={"dspark_candidates": 2}' 'dspark_k4={"dspark_candidates": 4}' \
  --data gsm8k="$DATA/gsm8k.jsonl" humaneval="$DATA/humaneval.jsonl" mt-bench="$DATA/mt-bench.jsonl" \
  --num_prompts 16 --max_new_tokens 256 --temperature 0 1 --batch_size 16 --output_dir "$OUT/eval" --no_progress
common=(--target "$TARGET" --draft "dspark=$OUT/dspark" --prompts "$DATA/mt-bench.jsonl" --dtype bfloat16
        --temperatures 0 1)
python3 "$HERE/generation_speed.py" "${common[@]}" --num-prompts 4 --max-new-tokens 128 --batch-sizes 1 \
  --static-target --compare-paths ${PATHS:-compiled compiled-draft fused-compiled-draft} --json "$OUT/speed_b1.json"
python3 "$HERE/generation_speed.py" "${common[@]}" --num-prompts 64 --max-new-tokens 128 --batch-sizes 4 16 64 \
  --static-target --json "$OUT/speed_sweep.json"
