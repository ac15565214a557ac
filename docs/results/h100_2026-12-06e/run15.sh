#!/bin/bash
set -u
exec > "$OUT/run.log" 2>&1
ts(){ echo "=== $(date +%T) $*"; }
python3 -m pip install -q --target /tmp/site .whl/*.whl 2>&1 | tail -2; export PYTHONPATH=/tmp/site:.
W=/tmp/w15; mkdir -p $W
ts env; nvidia-smi -L; nproc; uptime
for arm in 1 0; do
  ts "A/B commit_load_threads=$arm (0: sized to the host)"
  timeout 80 python3 -m benchmarks.curves --device cpu --parts bytes --bytes-policy reuse --bytes-standby 2 --kv-experts 4 --commit-load-threads $arm --expert-hidden 8192,24576,32768,8192,24576,32768 --out $W/ab$arm > $W/ab$arm.log 2>&1
  echo rc=$?
  python3 .whl/o.py  # (docs/results/h100_2026-12-06e/commit_loads.py) $W/ab$arm/curves.json
done
ts fit: cpu bytes 15 scales
timeout 150 python3 -m benchmarks.curves --device cpu --parts bytes --bytes-policy reuse --bytes-standby 2 --kv-experts 4 --expert-hidden 128,1024,8192,24576,49152,128,1024,8192,24576,49152,128,1024,8192,24576,49152 --fit --out $W/fit > $W/fit.log 2>&1
echo rc=$?
grep -v "socket.cpp" $W/fit.log | grep "^|\|move:\|pause (\|copy"
ts check: 12 held-out scales
EEPCTL_COST_MODEL=$W/fit/cost_model.json timeout 170 python3 -m benchmarks.curves --device cpu --parts bytes --bytes-policy reuse --bytes-standby 2 --kv-experts 4 --expert-hidden 2048,16384,32768,65536,2048,16384,32768,65536,2048,16384,32768,65536 --out $W/check > $W/check.log 2>&1
echo rc=$?
ts report
python3 -m benchmarks.fit_cost --report $W/check/curves.json
python3 .whl/o.py  # (docs/results/h100_2026-12-06e/commit_loads.py) $W/fit/curves.json $W/check/curves.json
rm -f $W/*/*.svg $W/*/*.csv
tar -czf $OUT/run15.tgz -C $W .
ts done; uptime
