#!/usr/bin/env bash
# With vs without self-distillation, from the stage 1 predictor (START, default: the output of
# stage 1 of scripts/train_default.sh): the same fine-tuning run on (gen) the target's own
# answers to ShareGPT training prompts, and on (sharegpt) more of the original ShareGPT answers,
# then both predictors side by side with the stage 1 one. (The recorded study started from the
# file shipped at the time, which was that stage 1 output.)
# Stages (select with ONLY="..."): gen prepare fit-gen fit-sharegpt bench. About 2 hours on
# 2 cores. RUNS is where data and runs go (default: runs).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
RUNS=${RUNS:-runs}
ONLY=${ONLY:-"gen prepare fit-gen fit-sharegpt bench"}
STEPS=${STEPS:-400}
START=${START:-$RUNS/state-default/predictor.safetensors}
FIT=(--steps "$STEPS" --tokens-per-step 2048 --lr 6e-4 --warmup 10 --unroll 3 --init-from "$START"
     --eval-every 100 --save-every 25)
has() { [[ " $ONLY " == *" $1 "* ]]; }
if has gen; then  # greedy answers, 256 tokens, 16 sequences in a continuous batch
  $PY -m sot.cli train gen-data --out "$RUNS/selfdistill/answers.jsonl" --limit 2000 --max-new-tokens 256 --batch-size 16
fi
if has prepare; then
  $PY -m sot.cli train prepare --data "$RUNS/selfdistill/answers.jsonl" --out "$RUNS/data/selfdistill" \
    --tokens 2000000 --eval-conversations 64
fi
if has fit-gen; then
  $PY -m sot.cli train fit --data "$RUNS/data/selfdistill" --out "$RUNS/sd-gen" "${FIT[@]}"
fi
if has fit-sharegpt; then  # the control: the same run on the original answers
  $PY -m sot.cli train fit --data "$RUNS/data/sharegpt" --out "$RUNS/sd-sharegpt" "${FIT[@]}"
fi
if has bench; then
  M="plain,state=$START,state=$RUNS/sd-gen/predictor.safetensors,state=$RUNS/sd-sharegpt/predictor.safetensors"
  for SET in sharegpt-heldout humaneval; do
    $PY -m sot.cli bench --prompts $SET --limit 8 --methods "$M" --max-new-tokens 256 --out docs/bench/selfdistill/$SET
  done
  $PY -m sot.cli bench --prompts sharegpt-heldout --limit 8 --methods "$M" --temperature 1.0 --max-new-tokens 256 \
    --out docs/bench/selfdistill/sharegpt-t1
fi
