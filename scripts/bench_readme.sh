#!/usr/bin/env bash
# The benchmark runs behind the tables of docs/RESULTS.md and the README (about 20 minutes on 2 cores).
# llamacpp needs llama-cpp-python built for the CPU (see docs/RESULTS.md; skipped with a note otherwise).
set -euo pipefail
cd "$(dirname "$0")/.."
N=${N:-8}
.venv/bin/sot bench --prompts sharegpt-heldout --limit "$N" --methods hf,plain,pld,state,auto,llamacpp --max-new-tokens 256 --dtype float32 --out docs/bench/sharegpt-heldout
.venv/bin/sot bench --prompts humaneval --limit "$N" --methods hf,plain,pld,state,auto,llamacpp --max-new-tokens 256 --dtype float32 --out docs/bench/humaneval
.venv/bin/sot bench --prompts sharegpt-heldout --limit 8 --methods plain,state --temperature 1.0 --max-new-tokens 256 --out docs/bench/sharegpt-t1
.venv/bin/sot bench --prompts adversarial --limit 8 --methods plain,pld,state --max-new-tokens 128 --out docs/bench/adversarial
# the state predictor's head: its reduced draft vocabulary (default) against the full vocabulary
.venv/bin/sot bench --prompts sharegpt-heldout --limit 8 --methods plain,state --max-new-tokens 256 --out docs/bench/vocab-reduced
.venv/bin/sot bench --prompts sharegpt-heldout --limit 8 --methods plain,state --full-vocab --max-new-tokens 256 --out docs/bench/vocab-full
