#!/usr/bin/env bash
# Reproduces the shipped state predictor for SmolLM2-135M-Instruct
# (sot/assets/smollm2-135m-instruct.state.safetensors) on a 2-core CPU.
# Each command resumes where it stopped: prepare skips nothing (re-run from scratch if it was
# interrupted), fit continues from runs/state-default/checkpoint.pt.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -f runs/data/sharegpt/prepare.json ] || \
  .venv/bin/sot train prepare --out runs/data/sharegpt --tokens 1500000 --eval-conversations 64
.venv/bin/sot train fit --data runs/data/sharegpt --out runs/state-default \
  --steps 1100 --tokens-per-step 2048 --lr 2e-3 --warmup 20 --unroll 3 --draft-vocab 16384 --init target \
  --eval-every 100 --save-every 25 --max-seconds 3900
mkdir -p sot/assets
cp runs/state-default/predictor.safetensors sot/assets/smollm2-135m-instruct.state.safetensors
