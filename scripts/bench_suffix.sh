#!/usr/bin/env bash
# Suffix drafts against the state drafter alone, on the multi-turn sets and the single-turn
# ones (docs/RESULTS.md, "Suffix drafts"). Each method builds its own store of earlier answers
# over the run. About 25 minutes on 2 cores.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-docs/bench/suffix}
run() { .venv/bin/sot bench --max-new-tokens 256 "$@"; }
run --prompts code-edit-multiturn --methods plain,state,suffix,auto --out "$OUT/code-edit-multiturn"
run --prompts agent-loop --methods plain,state,suffix,auto --out "$OUT/agent-loop"
run --prompts sharegpt-multiturn --limit 6 --methods plain,state,suffix,auto --out "$OUT/sharegpt-multiturn"
run --prompts sharegpt-heldout --limit 8 --methods plain,state,auto --out "$OUT/sharegpt-heldout"
run --prompts humaneval --limit 8 --methods plain,state,auto --out "$OUT/humaneval"
