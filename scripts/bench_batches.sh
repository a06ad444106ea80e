#!/usr/bin/env bash
# state against plain by batch size: one `sot bench` run per prompt set and batch size
# (16 prompts, 128 new tokens, greedy), then a summary table in OUT/table.md.
# Usage: scripts/bench_batches.sh OUT_DIR [SETS] [BATCH_SIZES]
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-docs/bench/batches}
SETS=${2:-"sharegpt-heldout humaneval"}
SIZES=${3:-"1 2 4 8 16"}
mkdir -p "$OUT"
for set in $SETS; do
  for b in $SIZES; do
    .venv/bin/sot bench --prompts "$set" --limit 16 --batch-size "$b" --methods plain,state \
      --max-new-tokens 128 --out "$OUT/$set-b$b" > "$OUT/$set-b$b.log" 2>&1
  done
done
.venv/bin/python scripts/batch_table.py "$OUT" $SETS
