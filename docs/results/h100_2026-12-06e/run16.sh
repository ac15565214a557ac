#!/bin/bash
set -u
exec > "$OUT/run.log" 2>&1
ts(){ echo "=== $(date +%T) $*"; }
python3 -m pip install -q --target /tmp/site .whl/*.whl 2>&1 | tail -2; export PYTHONPATH=/tmp/site:.
W=/tmp/w16; mkdir -p $W
ts env; nvidia-smi -L; nproc; uptime
ts fit: cuda 12 scales
timeout 290 python3 -m benchmarks.curves --device cuda --parts bytes --bytes-policy reuse --bytes-standby 2 --kv-experts 4 --expert-hidden 8192,32768,131072,262144,8192,32768,131072,262144,8192,32768,131072,262144 --fit --out $W/fit > $W/fit.log 2>&1
echo rc=$?
grep -v "socket.cpp" $W/fit.log | grep "^|\|move:\|pause (\|copy\|x the device"
ts check: cuda 6 held-out scales on the same host
EEPCTL_COST_MODEL=$W/fit/cost_model.json timeout 200 python3 -m benchmarks.curves --device cuda --parts bytes --bytes-policy reuse --bytes-standby 2 --kv-experts 4 --expert-hidden 16384,65536,196608,16384,65536,196608 --out $W/check > $W/check.log 2>&1
echo rc=$?
grep -v "socket.cpp" $W/check.log | grep "^|\|slope\|x the device"
ts report
python3 -m benchmarks.fit_cost --report $W/check/curves_cuda.json
python3 -m benchmarks.fit_cost --leave-one-size-out $W/fit/curves_cuda.json
ts processes on the GPU after the run
nvidia-smi --query-compute-apps=pid,used_memory --format=csv
rm -f $W/*/*.svg $W/*/*.csv
tar -czf $OUT/run16.tgz -C $W .
ts done; uptime
