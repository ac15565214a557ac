#!/bin/bash
set -u
exec > "$OUT/run.log" 2>&1
ts(){ echo "=== $(date +%T) $*"; }
python3 -m pip install -q --target /tmp/site .whl/*.whl 2>&1 | tail -2; export PYTHONPATH=/tmp/site:.
W=/tmp/w13; mkdir -p $W
ts env; nvidia-smi -L; nproc; uptime
ts fit: cuda bytes 10 scales
timeout 480 python3 -m benchmarks.curves --device cuda --parts bytes --bytes-policy reuse --bytes-standby 2 --kv-experts 4 --expert-hidden 8192,32768,131072,524288,1048576,8192,32768,131072,524288,1048576 --fit --out $W/fit > $W/fit.log 2>&1
echo rc=$?
grep -v "socket.cpp" $W/fit.log | grep "^|\|move:\|pause (\|copy\|x the device"
rm -f $W/*/*.svg $W/*/*.csv
cp $W/fit/cost_model.json $OUT/cuda_cost_model.json
tar -czf $OUT/run13.tgz -C $W .
ts done; uptime
