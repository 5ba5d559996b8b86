#!/usr/bin/env bash
# LlamaGen at an official size (default XL, bf16, random weights) on a GPU, acceptance forced (mmspec.forced):
#   1. the world LlamaGen's own acceptance per method (its bench summary is the profile of step 2);
#   2. the official size at that acceptance: batch 1, then 8 and 32, every method on its default budget and fixed;
#   3. the same at the papers' step compression: SJD 2.31x (Lumina-mGPT, 2392 -> 1035 steps), GSD 3.75x (g = 50);
#   4. the CUDA-graph step path (compile=reduce-overhead) at batch 1;
#   5. VAR-d30 against CoDe (d30 drafts, d16 refines) at batch 1 and 8 (CoDe accepts nothing: no forcing);
#   6. MAR-L against CSpD with MAR-B's draft at batch 1 (random pair: timing at its own acceptance, no forcing).
# Each step has its own time limit (525 s in all); summaries land in $OUT as one
# archive plus the log. Run from the repository root; on the device machine, carry `.wheels` (scripts/gpu_common.sh).
#   SIZE=B VAR_SIZE=d20 DEVICE=cpu DTYPE=float32 SAMPLES=1 LIMIT=60 bash scripts/official_sizes_gpu.sh   # a CPU dry run
#   (on a CPU the MAR step only starts: one MAR-L image takes 28 minutes there)
set -uo pipefail
SIZE=${SIZE:-XL}; VAR_SIZE=${VAR_SIZE:-d30}; MAR_SIZE=${MAR_SIZE:-L}; SAMPLES=${SAMPLES:-2}; LIMIT=${LIMIT:-80}
OUT=${OUT:-runs/official-gpu}
source scripts/gpu_common.sh
bench() {  # NAME LIMIT ARGS...: LlamaGen at temperature 1, top-k 64
  local name=$1 limit=$2; shift 2
  family_bench llamagen "$name" "$limit" --temperature 1 --family-option top_k=64 "$@"
}
machine_header
ALL=vanilla,sjd,sjd:budget=fixed,gsd,gsd:budget=fixed,eagle,eagle:budget=fixed,lantern,lantern:budget=fixed
# logit_scale 40: peaked heads, so the random EAGLE drafter's trees grow as deep as a trained one's (docs/benchmarks.md)
OFFICIAL=(--family-option size="$SIZE" --family-option dtype="$DTYPE" --family-option decode=false
          --family-option logit_scale="${LOGIT_SCALE:-40}")
bench world 40 --methods vanilla,sjd:budget=fixed,gsd:budget=fixed,eagle:budget=fixed,lantern:budget=fixed \
  --batch-sizes 1 --num-samples 16 --repeats 1 --warmup 0
bench official_b1 "$LIMIT" "${OFFICIAL[@]}" --force-acceptance "$WORK/world/summary.json" --methods "$ALL" \
  --batch-sizes 1 --num-samples "$SAMPLES" --repeats 1 --warmup 1
bench official_b8 "$LIMIT" "${OFFICIAL[@]}" --force-acceptance "$WORK/world/summary.json" \
  --methods vanilla,sjd,gsd,eagle,lantern,eagle:budget=fixed --batch-sizes 8 --num-samples 16 --repeats 1 --warmup 1
bench official_b32 "$LIMIT" "${OFFICIAL[@]}" --force-acceptance "$WORK/world/summary.json" \
  --methods vanilla,sjd,gsd,eagle,lantern,eagle:budget=fixed --batch-sizes 32 --num-samples 32 --repeats 1 --warmup 1
bench paper_sjd 30 "${OFFICIAL[@]}" --force-acceptance tau=2.31:depth=16 --methods vanilla,sjd,sjd:budget=fixed \
  --batch-sizes 1 --num-samples "$SAMPLES" --repeats 1 --warmup 1
bench paper_gsd 30 "${OFFICIAL[@]}" --force-acceptance tau=3.75:depth=16 --methods vanilla,gsd,gsd:budget=fixed \
  --batch-sizes 1 --num-samples "$SAMPLES" --repeats 1 --warmup 1
bench graphs_b1 "$LIMIT" "${OFFICIAL[@]}" --family-option compile=reduce-overhead \
  --force-acceptance "$WORK/world/summary.json" --methods vanilla,sjd:budget=fixed,eagle:budget=fixed \
  --batch-sizes 1 --num-samples 2 --repeats 2 --warmup 1
family_bench var var_code 60 --temperature 1 --family-option size="$VAR_SIZE" --family-option small_size=d16 \
  --family-option dtype="$DTYPE" --family-option decode=false --methods vanilla,code --batch-sizes 1,8 --num-samples 8 \
  --repeats 1 --warmup 1
family_bench mar mar_cspd 45 --temperature 1 --family-option size="$MAR_SIZE" --family-option draft_size=B \
  --family-option dtype="$DTYPE" --family-option decode=false --methods vanilla,cspd --batch-sizes 1 --num-samples 1 \
  --repeats 1 --warmup 0
archive_summaries
