#!/bin/bash
set -u
exec > "$OUT/run.log" 2>&1
ts(){ echo "=== $(date +%T) $*"; }
python3 -m pip install -q --target /tmp/site .whl/*.whl 2>&1 | tail -2; export PYTHONPATH=/tmp/site:.
ts env; nproc; uptime
ts fit: cpu bytes 10 scales
timeout 300 python3 -m benchmarks.curves --device cpu --parts bytes --bytes-policy reuse --bytes-standby 2 --kv-experts 4 --expert-hidden 128,2048,16384,32768,65536,128,2048,16384,32768,65536 --fit --out $OUT/fit > $OUT/fit.log 2>&1
grep -v "socket.cpp" $OUT/fit.log | tail -22; ls $OUT/fit; cat $OUT/fit/cost_model.json
ts check: 8 held-out scales
EEPCTL_COST_MODEL=$OUT/fit/cost_model.json timeout 240 python3 -m benchmarks.curves --device cpu --parts bytes --bytes-policy reuse --bytes-standby 2 --kv-experts 4 --expert-hidden 1024,8192,24576,49152,1024,8192,24576,49152 --out $OUT/check > $OUT/check.log 2>&1
grep -v "socket.cpp" $OUT/check.log | tail -14
ts report
python3 -m benchmarks.fit_cost --report $OUT/check/curves*.json
rm -f $OUT/*/*.svg $OUT/*/*.csv
ts done; uptime
