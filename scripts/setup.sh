#!/usr/bin/env bash
# Create .venv and install eepctl + engine_ext with the in-cluster and test extras.
# torch is pinned to the CPU build (torch==2.13.0); a bare "torch" would pull a CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip >/dev/null
.venv/bin/python -m pip install -q -e ".[test]"
