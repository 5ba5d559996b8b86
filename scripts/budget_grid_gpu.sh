#!/usr/bin/env bash
# The draft budget's grid on a GPU (docs/budgets.md, "Where it stands"): the world models of every family the budget
# steers (llamagen, llamagen-t2i, vlm, mar), each method on its default `auto` budget beside its fixed sizes in one
# bench run, batch 1 first for every family, then batch 8 and 32 (one recorded pass after a warm-up one, as the
# 2026-11-28 H200 runs). Each bench is cut at LIMIT seconds, vlm's and mar's at 1.5 LIMIT (its finished batch sizes
# are kept): at most 160 s for llamagen and llamagen-t2i, 180 s for vlm (and 60 s more for the training-free VLM
# drafters, pld and recycle, call by call at batch 1: recycle's table learns across calls), 120 s for mar. Summaries
# land in $OUT as one archive plus the log (with the budgets' choices, --gate-log). Run from the repository root; on
# the device machine, carry `.wheels` (scripts/gpu_common.sh). The embedded models exceed what one device call sends
# (scripts/device_slim.sh): after `bash scripts/device_slim.sh slim`, three calls on one warm machine, each carrying
# .wheels, assets/judge, assets/tokenizer and its families' folders:
#   FAMILIES="llamagen llamagen-t2i" bash scripts/budget_grid_gpu.sh   # carry assets/llamagen, assets/llamagen-t2i
#   FAMILIES=vlm bash scripts/budget_grid_gpu.sh                        # carry assets/vlm
#   FAMILIES=mar bash scripts/budget_grid_gpu.sh                        # carry assets/mar
#   DEVICE=cpu SAMPLES_B1=1 SAMPLES_BATCH=8 BATCHES=8 LIMIT=90 ROUNDS=2 bash scripts/budget_grid_gpu.sh  # CPU dry run
set -uo pipefail
FAMILIES=${FAMILIES:-llamagen llamagen-t2i vlm mar}
SAMPLES_B1=${SAMPLES_B1:-4}; SAMPLES_BATCH=${SAMPLES_BATCH:-32}; BATCHES=${BATCHES:-8,32}; LIMIT=${LIMIT:-40}
ROUNDS=${ROUNDS:-30}
OUT=${OUT:-runs/budget-grid-gpu}
source scripts/gpu_common.sh
machine_header
IMAGE=vanilla,sjd,sjd:budget=fixed,draft-model,draft-model:budget=fixed,eagle,eagle:budget=fixed
IMAGE=$IMAGE,eagle:budget=fixed:top_k=1:depth=2:total_tokens=3
VLM=vanilla,eagle,vispec,msd,specvlm,eagle:budget=fixed,eagle:budget=fixed:top_k=1:depth=8:total_tokens=9
VLM=$VLM,specvlm:budget=fixed:top_k=1:depth=9:total_tokens=10
MAR=vanilla,cspd:gamma=8:criterion=reference_code,cspd:gamma=8:criterion=reference_code:budget=auto
declare -A METHODS=([llamagen]=$IMAGE [llamagen-t2i]=$IMAGE [vlm]=$VLM [mar]=$MAR)
declare -A LIMITS=([llamagen]=$LIMIT [llamagen-t2i]=$LIMIT [vlm]=$((LIMIT * 3 / 2)) [mar]=$((LIMIT * 3 / 2)))
declare -A SETTINGS=([llamagen]="--temperature 1 --family-option top_k=64"
                     [llamagen-t2i]="--temperature 1 --family-option top_k=64"
                     [vlm]="--temperature 0 --max-new-tokens 96 --family-option long_fraction=1.0"
                     [mar]="--temperature 1 --family-option num_sampling_steps=50")
for family in $FAMILIES; do
  # shellcheck disable=SC2086  # (the settings are words)
  family_bench "$family" "${family}_b1" "${LIMITS[$family]}" --methods "${METHODS[$family]}" ${SETTINGS[$family]} \
    --batch-sizes 1 --num-samples "$SAMPLES_B1" --repeats 2 --warmup 1 --gate-log
done
for family in $FAMILIES; do
  # shellcheck disable=SC2086
  family_bench "$family" "${family}_batched" "${LIMITS[$family]}" --methods "${METHODS[$family]}" ${SETTINGS[$family]} \
    --batch-sizes "$BATCHES" --num-samples "$SAMPLES_BATCH" --repeats 1 --warmup 1 --gate-log
done
if [[ " $FAMILIES " == *" vlm "* ]]; then  # the training-free VLM drafters, call by call
  timed vlm_training_free "${LIMITS[vlm]}" $PY scripts/paired_calls.py --family vlm \
    --family-option long_fraction=1.0 --max-new-tokens 96 --device "$DEVICE" --batch-size 1 --rounds "$ROUNDS" \
    --methods pld,recycle,recycle@fixed,recycle@fixed:top_k=1:depth=4:total_tokens=5
fi
archive_summaries
