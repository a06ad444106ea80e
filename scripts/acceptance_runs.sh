#!/usr/bin/env bash
# The measurements behind the speed criteria of the hardware and batch work, in one go, on the
# machine at hand (about 45 minutes on 2 cores, llama.cpp's build included):
#   1. `plain`, `state` and llama.cpp on ShareGPT and HumanEval (8 prompts, 256 tokens);
#   2. both exact dtypes forced, side by side, for `plain` and `state` (what `auto` must match;
#      without native bf16, AVX2 only, bfloat16 decodes about 10x slower and this takes hours);
#   3. state against plain at batch 1, 2, 4, 8 and 16 (scripts/bench_batches.sh).
# Every run writes its report under OUT (default docs/bench/acceptance-<cpu>-<date>), with the
# machine's description in OUT/machine.txt. llama-cpp-python is built for this CPU first if it
# is missing (AVX-512 with VNNI and BF16 where the CPU has them, else AVX2).
# Usage: scripts/acceptance_runs.sh [OUT]   (PARTS="llamacpp dtypes batches" by default: name fewer
# to run only those)
set -euo pipefail
cd "$(dirname "$0")/.."
flags=$(grep -m1 '^flags' /proc/cpuinfo || true)
has() { [[ " $flags " == *" $1 "* ]]; }
if has amx_tile; then cpu=amx; elif has avx512f; then cpu=avx512; else cpu=avx2; fi
OUT=${1:-docs/bench/acceptance-$cpu-$(date +%Y%m%d)}
PARTS=" ${PARTS:-llamacpp dtypes batches} "
mkdir -p "$OUT"
{ lscpu | grep -E 'Model name|^CPU\(s\)'; echo "class: $cpu"; git log -1 --format='commit %h %cd'; } > "$OUT/machine.txt"
cat "$OUT/machine.txt"

if [[ $PARTS == *" llamacpp "* ]] && ! .venv/bin/python -c "import llama_cpp" 2>/dev/null; then
  if [ "$cpu" = avx2 ]; then
    cmake="-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_OPENMP=OFF"
  else  # (llama.cpp's own AMX kernels stopped at a tile load on these machines: not enabled)
    cmake="-DGGML_NATIVE=OFF -DGGML_AVX512=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_OPENMP=OFF"
    has avx512_vnni && cmake="$cmake -DGGML_AVX512_VNNI=ON"
    has avx512_bf16 && cmake="$cmake -DGGML_AVX512_BF16=ON"
  fi
  echo "building llama-cpp-python ($cmake)" >&2
  .venv/bin/pip install --quiet --no-deps diskcache
  CMAKE_ARGS="$cmake" CMAKE_BUILD_PARALLEL_LEVEL=2 .venv/bin/pip install --quiet --force-reinstall --no-deps \
    --no-cache-dir llama-cpp-python==0.3.36
fi

for set in sharegpt-heldout humaneval; do
  if [[ $PARTS == *" llamacpp "* ]]; then
    .venv/bin/sot bench --prompts "$set" --limit 8 --methods plain,state,llamacpp --max-new-tokens 256 \
      --out "$OUT/$set-llamacpp" > "$OUT/$set-llamacpp.log" 2>&1
  fi
  if [[ $PARTS == *" dtypes "* ]]; then
    .venv/bin/sot bench --prompts "$set" --limit 8 --methods plain,state --sweep dtype=float32,bfloat16 \
      --max-new-tokens 256 --out "$OUT/$set-dtypes" > "$OUT/$set-dtypes.log" 2>&1
  fi
  echo "$set: done" >&2
done
if [[ $PARTS == *" batches "* ]]; then
  scripts/bench_batches.sh "$OUT/batches"
fi
echo "reports in $OUT" >&2
