#!/usr/bin/env bash
# The benchmark runs behind the README tables (about 30 minutes on 2 cores).
set -euo pipefail
cd "$(dirname "$0")/.."
.venv/bin/sot bench --prompts sharegpt-heldout --limit 20 --methods hf,hf-pld,plain,pld --max-new-tokens 256 --out docs/bench/sharegpt-heldout
.venv/bin/sot bench --prompts humaneval --limit 20 --methods hf,hf-pld,plain,pld --max-new-tokens 256 --out docs/bench/humaneval
.venv/bin/sot bench --prompts bench_prompts/code-edit.jsonl --methods hf,plain,pld --max-new-tokens 256 --out docs/bench/code-edit
