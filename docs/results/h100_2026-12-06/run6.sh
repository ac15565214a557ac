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
    print("  premap_s", json.dumps(r.get("premap_s_by_rank")))
    for k, v in r.get("reshuffle_parts_by_rank", {}).items():
        print("  rank", k, json.dumps(v))
PY
}
ts pytest transport cuda_ipc + premap
timeout 100 python3 -m pytest -q -p no:cacheprovider tests/test_transport.py -k "cuda_ipc or premapped" 2>&1 | tail -15
ts move 2 GiB x2, premap
timeout 110 python3 -m benchmarks.curves --device cuda --parts bytes --expert-hidden 262144,262144 --bytes-policy reuse --bytes-standby 2 --out $OUT/pm
split $OUT/pm/curves_cuda.json
ts move 2 GiB x2, no premap
EEPCTL_IPC_PREMAP=0 timeout 110 python3 -m benchmarks.curves --device cuda --parts bytes --expert-hidden 262144,262144 --bytes-policy reuse --bytes-standby 2 --out $OUT/nopm
split $OUT/nopm/curves_cuda.json
rm -f $OUT/*/*.svg $OUT/*/*.csv
ts done; uptime
