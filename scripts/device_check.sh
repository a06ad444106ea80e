#!/usr/bin/env bash
# The checks that need a CUDA GPU, in one run of a few minutes: the device tests, the CLI on a
# tiny model (generate, bench with engine methods against transformers), the speed probe of
# scripts/device_speed.py with and without CUDA graphs, a profile of plain decoding, and the trainer's
# tests (they train on the GPU where one is visible). Logs go to $OUT (default ./device-check).
# Run from the repository root, on a machine whose python3 has torch with CUDA, transformers
# and Triton:
#   bash scripts/device_check.sh
set -uo pipefail
OUT=${OUT:-device-check}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
"$PY" -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"

echo "== device tests"
timeout 240 "$PY" -m pytest -q -p no:cacheprovider tests/test_devices.py -rs --tb=short 2>&1 | tee "$OUT/devices.log" | tail -5

echo "== CLI on a tiny model"
TMP=$(mktemp -d)
"$PY" - "$TMP" <<'EOF'
import json, sys
from pathlib import Path
sys.path.insert(0, "tests")
from helpers import tiny_model_dir
root = Path(sys.argv[1])
tiny_model_dir(root / "model", max_positions=1024)
lines = [{"prompt": " ".join(["red green blue"] * (i + 2)) + f" {i}"} for i in range(6)]
(root / "prompts.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
EOF
timeout 120 "$PY" -m sot.cli generate --device cuda --model "$TMP/model" --no-chat --drafter pld \
    --max-new-tokens 32 "red green blue red green" 2>&1 | tee "$OUT/generate.log" | tail -3
timeout 240 "$PY" -m sot.cli bench --device cuda --model "$TMP/model" --prompts "$TMP/prompts.jsonl" --no-chat \
    --methods hf,plain,pld,suffix --hf-dtype bfloat16 --dtype bfloat16 --max-new-tokens 48 --batch-size 1 \
    --out "$TMP/bench" 2>&1 | tee "$OUT/bench.log" | tail -12

echo "== speed probe (verify passes as CUDA graphs and eager, side by side), then a profile"
timeout 200 "$PY" scripts/device_speed.py --device cuda --dtype bfloat16 --prompts 4 2>&1 | tee "$OUT/speed.log"
timeout 150 "$PY" scripts/device_speed.py --device cuda --dtype bfloat16 --prompts 2 --graphs on --profile 2>&1 \
    | tee "$OUT/profile.log" | tail -40

echo "== trainer tests"
timeout 300 "$PY" -m pytest -q -p no:cacheprovider tests/test_training.py -x --tb=short 2>&1 | tee "$OUT/training.log" | tail -4
