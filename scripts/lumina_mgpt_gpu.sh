#!/usr/bin/env bash
# Lumina-mGPT-7B-768 (random weights, bf16) on a GPU at the SJD and GSD papers' step compression (mmspec.forced):
# one 768 x 768 image (2353 generated tokens, CFG 3.0 as both papers) per method at batch 1: vanilla, SJD at the SJD
# paper's 2392 -> 1035 steps (tau 2.31, window 16) and GSD at its paper's 3.75x (g = 50), each on its default budget
# and fixed; the papers' latency figures are SJD 2.15x and GSD 4.65x (docs/benchmarks.md puts them beside ours).
# About 5 minutes on an H200 (two samples a method: the first warms up). Run from the repository root; on the device
# machine, carry `.wheels` (scripts/gpu_common.sh).
#   MODEL=tiny-lumina DEVICE=cpu DTYPE=float32 LIMIT=60 bash scripts/lumina_mgpt_gpu.sh   # a CPU dry run on a folder
#   (python -m image_ar.transformers_ar.tiny tiny-lumina --model lumina-mgpt writes one)
set -uo pipefail
LIMIT=${LIMIT:-420}; OUT=${OUT:-runs/lumina-gpu}
source scripts/gpu_common.sh
if [ -n "${MODEL:-}" ]; then TARGET=(--family-option model="$MODEL"); else
  TARGET=(--family-option size=lumina-mgpt-7b-768 --family-option dtype="$DTYPE" --family-option logit_scale=40); fi
machine_header
for paper in "sjd 2.31" "gsd 3.75"; do
  set -- $paper
  family_bench lumina-mgpt "paper_$1" $((LIMIT / 2)) "${TARGET[@]}" --family-option decode=false \
    --family-option guidance_scale=3.0 --force-acceptance "tau=$2:depth=16" --methods "vanilla,$1,$1:budget=fixed" \
    --batch-sizes 1 --num-samples 1 --repeats 1 --warmup 1 --temperature 1
done
archive_summaries
