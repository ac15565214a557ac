#!/bin/bash
set -u
exec > "$OUT/run.log" 2>&1
ts(){ echo "=== $(date +%T) $*"; }
python3 -m pip install -q --target /tmp/site .whl/*.whl 2>&1 | tail -2; export PYTHONPATH=/tmp/site:.
ts env; nvidia-smi -L; nproc; uptime; python3 -c "import torch,sys;print(sys.version.split()[0], torch.__version__)"
split() { python3 - "$1" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
c = d.get("device_copy_GBps")
print("device copy GB/s", c)
for r in d["bytes"]:
    print(r.get("expert_MiB"), "pause", r.get("pause_s"), "precopy", r.get("precopy_s"), "per joiner GB/s", r.get("move_GBps_per_joiner"),
          "all GB/s", r.get("move_GBps_all"), "x copy", (r.get("move_GBps_all") or 0) / c if c else None, "failed", r.get("failed"), "/", r.get("requests"))
    for k, v in r.get("reshuffle_parts_by_rank", {}).items():
        print("  rank", k, json.dumps(v))
PY
}
ts pytest transport cuda_ipc
timeout 100 python3 -m pytest -q -p no:cacheprovider tests/test_transport.py -k cuda_ipc 2>&1 | tail -4
for i in 1 2; do
ts new $i: move 2 GiB x2
timeout 110 python3 -m benchmarks.curves --device cuda --parts bytes --expert-hidden 262144,262144 --bytes-policy reuse --bytes-standby 2 --out $OUT/new$i > $OUT/new$i.log 2>&1
split $OUT/new$i/curves_cuda.json
ts old $i: move 2 GiB x2
(cd .whl/old && timeout 110 python3 -m benchmarks.curves --device cuda --parts bytes --expert-hidden 262144,262144 --bytes-policy reuse --bytes-standby 2 --out $OUT/old$i > $OUT/old$i.log 2>&1)
split $OUT/old$i/curves_cuda.json
done
rm -f $OUT/*/*.svg $OUT/*/*.csv
ts autoscale daily; uptime
timeout 200 python3 -m benchmarks.autoscale --seconds 30 --traces daily --max-dp 4 --base-rate 40 --compress 30 --slo-ttft-ms 300
ts done; uptime
