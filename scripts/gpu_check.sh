#!/usr/bin/env bash
# The GPU default path, checked on a GPU host: the CUDA tests; a Ray deployment of CUDA ranks scaled
# 2 -> 4 -> 2 under load, then a rank SIGKILLed under load; the 2 GiB pause curve; capacity with and
# without MPS. One summary line per part (`SUMMARY <part> PASS|FAIL ...`), all in $OUT/summary.txt;
# exit 1 when a part failed.
#
# On the lent GPU host (docs/testing.md, "The GPU path"): from the project root here,
#   bash ../shared/device/make-kit.sh          # .kit/: Ray slimmed, the pure dependencies
# then a device call that carries .kit and runs
#   source .kit/setup.sh && bash scripts/gpu_check.sh
# GPU_CHECK_DEVICE=cpu runs the Ray part on CPU ranks (a dry run of the script on a box without a GPU);
# GPU_CHECK_PARTS picks parts (default: tests,ray,curve,capacity).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu-check}
mkdir -p "$OUT"
: > "$OUT/summary.txt"
DEVICE=${GPU_CHECK_DEVICE:-cuda}
PARTS=${GPU_CHECK_PARTS:-tests,ray,curve,capacity}
PY=${PYTHON:-python3}
EEP=${EEPCTL:-eepctl}
NAME=gpucheck
failed=0
export EEPCTL_STATE_DIR=${EEPCTL_STATE_DIR:-$OUT/state}
export PYTHONUNBUFFERED=1
say() { echo "=== $(date +%T) $*"; }
summary() {  # summary PART PASS|FAIL text...
  local part=$1 verdict=$2; shift 2
  [ "$verdict" = PASS ] || failed=1
  echo "SUMMARY $part $verdict $*" | tee -a "$OUT/summary.txt"
}
wants() { [[ ",$PARTS," == *",$1,"* ]]; }
json_get() { "$PY" -c "import json,sys; d=json.loads(sys.stdin.read().splitlines()[-1]); print($1)"; }

part_tests() {
  say "CUDA tests"
  local log=$OUT/cuda_tests.log
  timeout 400 "$PY" -m pytest -q -p no:cacheprovider tests/test_cuda_graphs.py \
    tests/test_transport.py -k "cuda" -rs > "$log" 2>&1
  local rc=$? line
  line=$(grep -E "passed|failed|skipped|error" "$log" | tail -1)
  if [ $rc -eq 0 ] && ! grep -q "skipped" <<<"$line"; then summary cuda-tests PASS "$line"
  else summary cuda-tests FAIL "rc $rc: $line (log: cuda_tests.log)"; fi
}

part_ray() {
  say "Ray deployment, $DEVICE ranks: 2 -> 4 -> 2 under load, then a rank SIGKILLed under load"
  local gpus=0.25 log=$OUT/ray.log
  [ "$DEVICE" = cuda ] || gpus=0
  {
    $EEP up --dp 2 --max-dp 4 --gpus-per-rank "$gpus" --name "$NAME" --timeout 300 || return 1
    $EEP generate -n "$NAME" -o json > "$OUT/before.json" || return 1
    $EEP generate -n "$NAME" --rate 20 --duration 30 -o json > "$OUT/load_scale.json" 2>"$OUT/load_scale.err" &
    local load=$!
    sleep 4
    $EEP scale --dp 4 -n "$NAME" -o json > "$OUT/scale_up.json" || return 1
    sleep 3
    $EEP scale --dp 2 -n "$NAME" -o json > "$OUT/scale_down.json" || return 1
    wait $load || return 1
    $EEP scale --dp 3 -n "$NAME" -o json > /dev/null || return 1
    $EEP generate -n "$NAME" --rate 20 --duration 20 -o json > "$OUT/load_kill.json" 2>"$OUT/load_kill.err" &
    load=$!
    sleep 5
    local victim
    victim=$($EEP status -n "$NAME" -o json | json_get \
      '[r["pid"] for r in d["ranks"] if r["state"] == "serving"][1]')
    echo "kill -9 $victim"
    kill -9 "$victim"
    wait $load || return 1
    sleep 2
    $EEP generate -n "$NAME" -o json > "$OUT/after.json" || return 1
    $EEP events -n "$NAME" -o json > "$OUT/events.json" || return 1
  } > "$log" 2>&1
}

ray_summary() {
  "$PY" - "$OUT" <<'PY'
import json, sys, pathlib
out = pathlib.Path(sys.argv[1])
last = lambda f: json.loads((out / f).read_text().splitlines()[-1])
outputs = lambda f: [r["output"] for r in last(f)["results"]]
same = outputs("before.json") == outputs("after.json")
loads = [last(f) for f in ("load_scale.json", "load_kill.json")]
ops = last("events.json").get("operations", [])
scales = [o for o in ops if o.get("kind") == "scale" and o["state"] == "succeeded"]
pauses = " ".join(f"{o['from_size']}->{o['to_size']} {o['serving_pause_s'] * 1e3:.1f} ms" for o in scales)
recovered = [o for o in ops if o.get("kind") == "recover" and o["state"] == "succeeded"]
ok = same and all(ld["failed"] == 0 for ld in loads) and len(scales) >= 3 and recovered
print("PASS" if ok else "FAIL",
      f"load {loads[0]['completed']}/{loads[0]['sent']} across 2->4->2, {loads[1]['completed']}/{loads[1]['sent']}"
      f" across the kill; pauses {pauses}; recovered {len(recovered)};"
      f" outputs before == after: {same}")
PY
}

part_curve() {
  say "2 GiB pause curve (2 -> 4, default capture policy, then reuse with a standby pool of 2)"
  local w=$OUT/curve
  timeout 300 "$PY" -m benchmarks.curves --device "$DEVICE" --parts bytes --expert-hidden 262144 \
    --out "$w/default" > "$OUT/curve_default.log" 2>&1
  local rc1=$?
  timeout 250 "$PY" -m benchmarks.curves --device "$DEVICE" --parts bytes --expert-hidden 262144 \
    --bytes-policy reuse --bytes-standby 2 --out "$w/reuse" > "$OUT/curve_reuse.log" 2>&1
  local rc2=$?
  rm -f "$w"/*/*.svg "$w"/*/*.csv
  local text
  text=$("$PY" - "$w" <<'PY'
import json, sys, pathlib
w = pathlib.Path(sys.argv[1])
for case in ("default", "reuse"):
    found = sorted((w / case).glob("curves*.json"))
    rows = json.loads(found[0].read_text())["bytes"] if found else []
    print(f"{case}: " + (", ".join(f"{r['pause_s'] * 1e3:.1f} ms pause ({r.get('capture_policy')})" for r in rows)
                         or "no result"), end="; ")
PY
)
  if [ $rc1 -eq 0 ] && [ $rc2 -eq 0 ]; then summary pause-2GiB PASS "$text"
  else summary pause-2GiB FAIL "rc $rc1/$rc2: $text"; fi
}

part_capacity() {
  say "capacity, DP 1 and 4 sharing the GPU, without and with MPS"
  timeout 200 "$PY" -m benchmarks.capacity --device "$DEVICE" --dp 1,4 --parts closed --clients 32 \
    --seconds 8 --out "$OUT/cap_nomps" > "$OUT/cap_nomps.log" 2>&1
  local rc1=$? rc2=1 mps=0
  if [ "$DEVICE" = cuda ] && command -v nvidia-cuda-mps-control > /dev/null; then
    export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps-pipe CUDA_MPS_LOG_DIRECTORY=/tmp/mps-log
    mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
    nvidia-cuda-mps-control -d && mps=1
    timeout 200 "$PY" -m benchmarks.capacity --device "$DEVICE" --dp 1,4 --parts closed --clients 32 \
      --seconds 8 --out "$OUT/cap_mps" > "$OUT/cap_mps.log" 2>&1
    rc2=$?
    [ $mps = 1 ] && echo quit | nvidia-cuda-mps-control
    unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
  fi
  local text
  text=$("$PY" - "$OUT" "$DEVICE" <<'PY'
import json, sys, pathlib
out, device = pathlib.Path(sys.argv[1]), sys.argv[2]
for case in ("cap_nomps", "cap_mps"):
    f = out / case / f"capacity_{device}.json"
    if not f.exists():
        print(f"{case}: no result", end="; ")
        continue
    rows = json.loads(f.read_text()).get("load", [])
    tok = {r["dp"]: round(r.get("closed", {}).get("tok_s") or 0) for r in rows}
    ratio = f"{tok[4] / tok[1]:.2f}x" if tok.get(1) and tok.get(4) else "?"
    print(f"{case}: DP4/DP1 {ratio} ({tok})", end="; ")
PY
)
  if [ $rc1 -eq 0 ] && { [ $rc2 -eq 0 ] || [ "$DEVICE" != cuda ]; }; then summary capacity PASS "$text"
  else summary capacity FAIL "rc $rc1/$rc2: $text"; fi
}

say "host: $(hostname) $(nproc) cores; $(nvidia-smi -L 2>/dev/null | head -1); commit $(git rev-parse --short HEAD 2>/dev/null)"
wants tests && part_tests
if wants ray; then
  if part_ray; then summary ray-"$DEVICE" "$(ray_summary)"
  else summary ray-"$DEVICE" FAIL "a step failed (log: ray.log)"; fi
  $EEP down -n "$NAME" --stop-cluster >> "$OUT/ray.log" 2>&1
fi
wants curve && part_curve
wants capacity && part_capacity
say "done"
cat "$OUT/summary.txt"
exit $failed
