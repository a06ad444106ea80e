#!/usr/bin/env bash
# The commit-policy study behind the "Commit policy" section of docs/DESIGN.md (about an hour on 2 cores).
# Every run alternates the methods on each prompt; outputs land in docs/bench/policy/.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=docs/bench/policy
SOT=.venv/bin/sot
stage() { [ -z "${ONLY:-}" ] || [[ " $ONLY " == *" $1 "* ]]; }

# 1. the learned policy: traces of 48 ShareGPT training prompts at temperatures 0, 1 and 1.5, then the fit
if stage train; then
  $SOT train policy --out runs/policy --prompts 48 --max-new-tokens 128 --temperatures 0,1,1.5
  cp runs/policy/policy.safetensors sot/assets/smollm2-135m-instruct.policy.safetensors
  mkdir -p $OUT/learned-fit && cp runs/policy/report.json runs/policy/calibration.png $OUT/learned-fit/
fi
# 2. never slower: unpredictable workloads. Sampling runs use coupled sampling, whose seeded
#    outputs equal plain decoding's, so both methods decode the same tokens (rejection
#    sampling gives other, equally distributed texts of other lengths, which adds noise).
if stage adversarial; then
  for P in ${POLICIES:-heuristic learned}; do
    $SOT bench --prompts adversarial --limit 8 --methods plain,state --policy $P --temperature 1.5 --sampling coupled --max-new-tokens 128 --out $OUT/adversarial-t1.5-$P
    $SOT bench --prompts sharegpt-heldout --limit 8 --methods plain,state --policy $P --temperature 1.5 --sampling coupled --max-new-tokens 128 --out $OUT/sharegpt-t1.5-$P
    $SOT bench --prompts adversarial --limit 8 --methods plain,state --policy $P --max-new-tokens 128 --out $OUT/adversarial-$P
  done
fi
# 3. the best static tree: width (top-k) x depth, fixed shape, no pruning or fallback
if stage static; then
  for W in 1 2 4; do
    $SOT bench --prompts sharegpt-heldout --limit 3 --methods state --policy static --draft-top-k $W \
      --sweep max-depth=2,3,4,6 --max-new-tokens 256 --out $OUT/static-w$W
  done
fi
# 4. dynamic (heuristic, learned) against the best static tree, same prompts
if stage compare; then
  for P in ${POLICIES:-heuristic learned}; do
    for S in sharegpt-heldout humaneval; do
      $SOT bench --prompts $S --limit 8 --methods plain,state --policy $P --max-new-tokens 256 --out $OUT/$S-$P
    done
  done
  read -r W D < <(.venv/bin/python scripts/policy_report.py --best-static $OUT)
  $SOT bench --prompts sharegpt-heldout --limit 8 --methods plain,state --policy static --draft-top-k "$W" --max-depth "$D" \
    --max-new-tokens 256 --out $OUT/sharegpt-heldout-static
fi
# 5. the depth sweep (dynamic policy; the tree budget grows to depth + 1 where needed)
if stage depth; then
  for S in sharegpt-heldout humaneval; do
    $SOT bench --prompts $S --limit 3 --methods state --max-new-tokens 256 \
      --sweep predictor-depth=1,2,4,8,12,16,20,24,32,40,48 --out $OUT/depth-$S
  done
fi
# 6. warm-up: tokens decoded plainly before the first draft
if stage warmup; then
  $SOT bench --prompts sharegpt-heldout --limit 4 --methods state --max-new-tokens 256 \
    --sweep warmup=0,2,8,32 --out $OUT/warmup
fi
# 7. batches: predictable and adversarial prompts together, a continuous batch of 4 (16 prompts,
#    two rounds of 8 with the methods alternating)
if stage batch; then
  $SOT bench --prompts mix --limit 16 --batch-size 4 --methods plain,state --max-new-tokens 128 --out $OUT/batch4-mix
fi
.venv/bin/python scripts/policy_report.py $OUT
