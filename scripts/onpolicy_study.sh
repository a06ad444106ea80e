#!/usr/bin/env bash
# On-policy training against more supervised fit steps at equal compute, then test-time
# adaptation over a session (docs/onpolicy.md). Stages (select with ONLY="..."):
#   onpolicy  sot train onpolicy from the shipped predictor (ITERATIONS rounds)
#   fit       supervised fit from the shipped predictor on the ShareGPT state cache, for the same
#             seconds as the onpolicy run, in CHUNKS parts (a predictor file after each)
#   walk      walk tokens per step of every file against compute (+ the adapted walk), over the
#             target's greedy answers in ANSWERS (default docs/bench/stage8: 8 per set)
#   session   64 prompts per domain in order: plain, frozen, --adapt side by side
# RUNS is where runs go (default: runs); the state cache comes from 'sot train prepare'
# (runs/data/sharegpt, as scripts/train_default.sh makes it).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
RUNS=${RUNS:-runs}
ONLY=${ONLY:-"onpolicy fit walk session"}
ANSWERS=${ANSWERS:-docs/bench/stage8}
ITERATIONS=${ITERATIONS:-2}  # the recorded run was started with 4 and stopped after 2
CHUNKS=${CHUNKS:-3}
OUT=${OUT:-docs/bench/onpolicy}
has() { [[ " $ONLY " == *" $1 "* ]]; }
if has onpolicy; then
  $PY -m sot.cli train onpolicy --out "$RUNS/onpolicy/main" --iterations "$ITERATIONS" --prompts-per-iteration 32 \
    --batch-size 8 --max-new-tokens 192 --steps-per-iteration 30 --tokens-per-step 2048 --lr 3e-4
fi
if has fit; then
  TOTAL=$($PY -c "import json; r = json.load(open('$RUNS/onpolicy/main/report.json')); print(r['decode_seconds'] + r['train_seconds'])")
  for ((j = 1; j <= CHUNKS; j++)); do
    S=$($PY -c "print($TOTAL * $j / $CHUNKS)")
    $PY -m sot.cli train fit --data "$RUNS/data/sharegpt" --out "$RUNS/onpolicy/fit" --init-from sot/assets/smollm2-135m-instruct.state.safetensors \
      --steps 400 --tokens-per-step 2048 --lr 3e-4 --warmup 10 --unroll 3 --eval-every 100000 --save-every 100000 --max-seconds "$S"
    mkdir -p "$RUNS/onpolicy/fit/chunk-$j"
    cp "$RUNS/onpolicy/fit/predictor.safetensors" "$RUNS/onpolicy/fit/train.json" "$RUNS/onpolicy/fit/chunk-$j/"
  done
fi
if has walk; then
  $PY scripts/onpolicy_study.py "$ANSWERS" sharegpt-heldout humaneval --fit "$RUNS/onpolicy/fit" \
    --onpolicy "$RUNS/onpolicy/main" --adapt --out "$OUT"
fi
if has session; then
  for SET in humaneval code-edit; do
    $PY scripts/adapt_session.py --prompts $SET --limit 64 --out "$OUT/session-$SET"
  done
fi
