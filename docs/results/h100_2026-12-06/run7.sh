#!/bin/bash
set -u
exec > "$OUT/run.log" 2>&1
ts(){ echo "=== $(date +%T) $*"; }
python3 -m pip install -q --target /tmp/site .whl/*.whl 2>&1 | tail -2; export PYTHONPATH=/tmp/site:.
ts env; nproc; uptime
ts autoscale step,ramp,daily
timeout 190 python3 -m benchmarks.autoscale --seconds 30 --traces ramp --max-dp 4 --base-rate 40 --compress 30 --slo-ttft-ms 300
ts done; uptime
