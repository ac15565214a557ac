#!/bin/bash
set -u
exec > "$OUT/run.log" 2>&1
ts(){ echo "=== $(date +%T) $*"; }
python3 -m pip install -q --target /tmp/site .whl/*.whl 2>&1 | tail -2; export PYTHONPATH=/tmp/site:.
ts env; nvidia-smi -L; nproc; uptime
ts pytest
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_serving_pause.py tests/test_cuda_graphs.py "tests/test_transport.py::test_cuda_ipc_collectives_and_moves_equal_gloo_on_one_gpu" 2>&1 | tail -3
for i in 1 2; do
  ts "A/B pause, cpu 16 MiB x8: old (HEAD) run $i"
  (cd .whl/old && PYTHONPATH=/tmp/site:. timeout 100 python3 -m benchmarks.curves --device cpu --parts bytes --bytes-policy reuse --bytes-standby 2 --kv-experts 4 --expert-hidden 2048,2048,2048,2048,2048,2048,2048,2048 --out $OUT/ab_old$i > $OUT/ab_old$i.log 2>&1)
  python3 -c "import json; r=json.load(open('$OUT/ab_old$i/curves.json')); print('old', ' '.join(f\"{b['pause_s']*1e3:.2f}\" for b in r['bytes']))"
  ts "new run $i"
  timeout 100 python3 -m benchmarks.curves --device cpu --parts bytes --bytes-policy reuse --bytes-standby 2 --kv-experts 4 --expert-hidden 2048,2048,2048,2048,2048,2048,2048,2048 --out $OUT/ab_new$i > $OUT/ab_new$i.log 2>&1
  python3 -c "import json; r=json.load(open('$OUT/ab_new$i/curves.json')); print('new', ' '.join(f\"{b['pause_s']*1e3:.2f}\" for b in r['bytes']))"
done
ts fit: cpu bytes 15 scales
timeout 150 python3 -m benchmarks.curves --device cpu --parts bytes --bytes-policy reuse --bytes-standby 2 --kv-experts 4 --expert-hidden 128,1024,8192,24576,49152,128,1024,8192,24576,49152,128,1024,8192,24576,49152 --fit --out $OUT/fit > $OUT/fit.log 2>&1
grep -v "socket.cpp" $OUT/fit.log | grep "^|\|move:\|pause (" 
ts check: 12 held-out scales
EEPCTL_COST_MODEL=$OUT/fit/cost_model.json timeout 170 python3 -m benchmarks.curves --device cpu --parts bytes --bytes-policy reuse --bytes-standby 2 --kv-experts 4 --expert-hidden 2048,16384,32768,65536,2048,16384,32768,65536,2048,16384,32768,65536 --out $OUT/check > $OUT/check.log 2>&1
grep -v "socket.cpp" $OUT/check.log | grep "^|\|slope"
ts report
python3 -m benchmarks.fit_cost --report $OUT/check/curves.json
rm -f $OUT/*/*.svg $OUT/*/*.csv
ts done; uptime
