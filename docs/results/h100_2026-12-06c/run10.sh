#!/bin/bash
set -u
exec > "$OUT/run.log" 2>&1
ts(){ echo "=== $(date +%T) $*"; }
python3 -m pip install -q --target /tmp/site .whl/*.whl 2>&1 | tail -2; export PYTHONPATH=/tmp/site:.
ts env; nvidia-smi -L; nproc; uptime
ts pytest serving pause
timeout 60 python3 -m pytest -q -p no:cacheprovider tests/test_serving_pause.py 2>&1 | tail -2
ts fit: cpu bytes 10 scales
timeout 200 python3 -m benchmarks.curves --device cpu --parts bytes --bytes-policy reuse --bytes-standby 2 --kv-experts 4 --expert-hidden 128,2048,16384,32768,65536,128,2048,16384,32768,65536 --fit --out $OUT/fit > $OUT/fit.log 2>&1
grep -v "socket.cpp" $OUT/fit.log | grep "^|"; cat $OUT/fit/cost_model.json
ts check: 8 held-out scales
EEPCTL_COST_MODEL=$OUT/fit/cost_model.json timeout 200 python3 -m benchmarks.curves --device cpu --parts bytes --bytes-policy reuse --bytes-standby 2 --kv-experts 4 --expert-hidden 1024,8192,24576,49152,1024,8192,24576,49152 --out $OUT/check > $OUT/check.log 2>&1
grep -v "socket.cpp" $OUT/check.log | grep "^|\|slope"
ts report
python3 -m benchmarks.fit_cost --report $OUT/check/curves*.json
ts cpu 256 MiB, 2 GiB
timeout 150 python3 -m benchmarks.curves --device cpu --parts bytes --expert-hidden 32768,262144 --bytes-policy reuse --bytes-standby 2 --out $OUT/cpu2g > $OUT/cpu2g.log 2>&1
grep -v "socket.cpp" $OUT/cpu2g.log | grep "^|\|slope"
ts cuda 256 MiB, 2 GiB, 8 GiB
timeout 150 python3 -m benchmarks.curves --device cuda --parts bytes --expert-hidden 32768,262144,1048576 --bytes-policy reuse --bytes-standby 2 --out $OUT/cuda > $OUT/cuda.log 2>&1
grep -v "socket.cpp" $OUT/cuda.log | grep "^|\|slope\|x the device"
rm -f $OUT/*/*.svg $OUT/*/*.csv
ts done; uptime
