#!/usr/bin/env bash
# The EAGLE-3 layout against SoT's native predictor at equal data and compute: both trained
# from the same start rules on the same ShareGPT cache with the same schedule, then compared
# without timing noise (a greedy chain walked over the target's own answers) and timed side
# by side. The EAGLE-3 one is compared as exported, through the folder vLLM and SGLang load.
#   STEPS (default 300) optimizer steps of 2,048 tokens each; about 25 minutes per
#   architecture on a 2-core AVX2 machine, plus about 17 minutes to cache 600k tokens.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
STEPS=${STEPS:-300}
OUT=${OUT:-docs/bench/eagle3}
[ -f runs/data/sharegpt/prepare.json ] || \
  $PY -m sot.cli train prepare --out runs/data/sharegpt --tokens 600000 --eval-conversations 64
for arch in native eagle3; do
  $PY -m sot.cli train fit --data runs/data/sharegpt --out "runs/cmp-$arch" --arch "$arch" \
    --steps "$STEPS" --tokens-per-step 2048 --lr 2e-3 --warmup 20 --unroll 3 --draft-vocab 16384 --init target \
    --eval-every 100 --save-every 25
done
$PY -m sot.cli export --format eagle3 runs/cmp-eagle3/predictor.safetensors runs/cmp-eagle3/head
# acceptance on the target's own answers to the benchmark prompts (docs/bench/stage8 holds them)
$PY -m sot.analysis.walk_acceptance docs/bench/stage8 sharegpt-heldout humaneval \
  --predictors runs/cmp-native/predictor.safetensors,runs/cmp-eagle3/head | tee runs/cmp-walk.txt
# timed side by side, methods alternating per prompt
for set in sharegpt-heldout humaneval; do
  $PY -m sot.cli bench --prompts "$set" --limit 8 --max-new-tokens 256 --out "$OUT/$set" \
    --methods plain,state=runs/cmp-native/predictor.safetensors,state=runs/cmp-eagle3/head
done
