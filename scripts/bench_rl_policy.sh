#!/usr/bin/env bash
# The rl commit policy: training on simulated speed, then heuristic, learned and rl side by side
# (each set in one process, the policies and plain decoding alternating on every prompt).
# About 45 minutes on 2 cores; outputs land in docs/bench/rl-policy/.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=docs/bench/rl-policy
SOT=.venv/bin/sot
stage() { [ -z "${ONLY:-}" ] || [[ " $ONLY " == *" $1 "* ]]; }

# 1. traces (48 ShareGPT training prompts and 16 coding requests at temperatures 0, 1, 1.5,
#    batch sizes 1 and 4) and training on the simulator; the network ships with the package
if stage train; then
  $SOT train policy --kind rl --out runs/rl
  cp runs/rl/rl-policy.safetensors sot/assets/smollm2-135m-instruct.rl-policy.safetensors
  mkdir -p $OUT/train && cp runs/rl/rl-report.json runs/rl/rl-reward.png $OUT/train/
fi
# 2. the comparison: held-out prompts, every output checked against plain decoding
if stage compare; then
  SWEEP=policy=heuristic,learned,rl
  $SOT bench --prompts sharegpt-heldout --limit 8 --methods plain,state --sweep $SWEEP --max-new-tokens 256 --out $OUT/sharegpt-heldout
  $SOT bench --prompts humaneval --limit 8 --methods plain,state --sweep $SWEEP --max-new-tokens 256 --out $OUT/humaneval
  $SOT bench --prompts adversarial --limit 8 --methods plain,state --sweep $SWEEP --max-new-tokens 128 --out $OUT/adversarial
  $SOT bench --prompts sharegpt-heldout --limit 8 --methods plain,state --sweep $SWEEP --temperature 1.0 --sampling coupled \
    --max-new-tokens 128 --out $OUT/sharegpt-t1
  $SOT bench --prompts mix --limit 16 --batch-size 4 --methods plain,state --sweep $SWEEP --max-new-tokens 128 --out $OUT/batch4-mix
fi
.venv/bin/python scripts/rl_policy_report.py $OUT
