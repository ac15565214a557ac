#!/bin/bash
set -u
exec > "$OUT/run.log" 2>&1
ts(){ echo "=== $(date +%T) $*"; }
python3 -m pip install -q --target /tmp/site .whl/*.whl 2>&1 | tail -2; export PYTHONPATH=/tmp/site:.
W=/tmp/w; mkdir -p $W
ts env; nvidia-smi -L; nproc; uptime
ts fit: cpu bytes 15 scales
timeout 150 python3 -m benchmarks.curves --device cpu --parts bytes --bytes-policy reuse --bytes-standby 2 --kv-experts 4 --expert-hidden 128,1024,8192,24576,49152,128,1024,8192,24576,49152,128,1024,8192,24576,49152 --fit --out $W/fit > $W/fit.log 2>&1
grep -v "socket.cpp" $W/fit.log | grep "^|\|move:\|pause (\|copy"
ts check: 12 held-out scales
EEPCTL_COST_MODEL=$W/fit/cost_model.json timeout 170 python3 -m benchmarks.curves --device cpu --parts bytes --bytes-policy reuse --bytes-standby 2 --kv-experts 4 --expert-hidden 2048,16384,32768,65536,2048,16384,32768,65536,2048,16384,32768,65536 --out $W/check > $W/check.log 2>&1
grep -v "socket.cpp" $W/check.log | grep "^|\|slope"
ts report
python3 -m benchmarks.fit_cost --report $W/check/curves.json
ts cuda 2 GiB x2, new code
timeout 150 python3 -m benchmarks.curves --device cuda --parts bytes --expert-hidden 262144,262144 --bytes-policy reuse --bytes-standby 2 --out $W/cuda > $W/cuda.log 2>&1
grep -v "socket.cpp" $W/cuda.log | grep "^|\|slope\|x the device"
rm -f $W/*/*.svg $W/*/*.csv
tar -czf $OUT/run12.tgz -C $W .
ts done; uptime
