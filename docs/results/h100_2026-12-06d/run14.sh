#!/bin/bash
set -u
exec > "$OUT/run.log" 2>&1
ts(){ echo "=== $(date +%T) $*"; }
python3 -m pip install -q --target /tmp/site .whl/*.whl 2>&1 | tail -2; export PYTHONPATH=/tmp/site:.
W=/tmp/w14; mkdir -p $W
ts env; nvidia-smi -L; nproc; hostname; uptime
ts check: cuda 6 held-out scales, model fitted in run13
EEPCTL_COST_MODEL=.whl/cuda_cost_model.json timeout 330 python3 -m benchmarks.curves --device cuda --parts bytes --bytes-policy reuse --bytes-standby 2 --kv-experts 4 --expert-hidden 16384,65536,262144,16384,65536,262144 --out $W/check > $W/check.log 2>&1
echo rc=$?
grep -v "socket.cpp" $W/check.log | grep "^|\|slope\|x the device"
ts processes on the GPU after the run
nvidia-smi --query-compute-apps=pid,used_memory --format=csv
ts report
python3 -m benchmarks.fit_cost --report $W/check/curves_cuda.json
rm -f $W/*/*.svg $W/*/*.csv
tar -czf $OUT/run14.tgz -C $W .
ts done; uptime
