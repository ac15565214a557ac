#!/usr/bin/env bash
# Create .venv and install eepctl + engine_ext with the in-cluster and test extras (about 1.4 GB,
# torch 0.75 GB and ray 0.24 GB of it).
# torch is pinned to the CPU build (torch==2.13.0). PyPI's torch for Linux x86-64 is the CUDA build
# (several GB of NVIDIA libraries): where pip's own sources (its configuration, PIP_* variables)
# offer no 2.13.0+cpu, torch is installed first from PyTorch's CPU index (EEPCTL_TORCH_INDEX
# overrides https://download.pytorch.org/whl/cpu), and the project's install finds it in place.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
TORCH="torch==2.13.0"
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip >/dev/null

# The torch build pip would choose from its own sources ("" when it cannot tell).
torch_offered() {
  .venv/bin/python -m pip install -q --dry-run --no-deps --ignore-installed --report - "$TORCH" 2>/dev/null |
    .venv/bin/python -c 'import json, sys; print(json.load(sys.stdin)["install"][0]["metadata"]["version"])' \
      2>/dev/null || true
}

if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  offered=$(torch_offered)
  case "$(uname -s)/$(uname -m)/$offered" in
    Linux/x86_64/*+cpu) ;;  # pip's sources have the CPU build
    Linux/x86_64/*)
      index=${EEPCTL_TORCH_INDEX:-https://download.pytorch.org/whl/cpu}
      echo "setup: pip's sources offer torch '${offered:-nothing}', not the CPU build: installing $TORCH from $index" >&2
      .venv/bin/python -m pip install -q "$TORCH" --index-url "$index"
      ;;
    *) ;;  # elsewhere (macOS, ARM) the torch pip's sources offer is taken as it is
  esac
fi
.venv/bin/python -m pip install -q -e ".[test]"
