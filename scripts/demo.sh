#!/usr/bin/env bash
# The embedded default, end to end: a local Ray head, a reference deployment at DP=2,
# requests, live scale 2 -> 4 -> 2 under load, status and history; then one rank SIGKILLed under
# load and the deployment healing itself (no request lost); then everything stopped.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
EEP=.venv/bin/eepctl
NAME=${EEPCTL_NAME:-demo}
# The local cluster's record and the loads' output go to EEPCTL_STATE_DIR (default .eepctl-state/).
export EEPCTL_STATE_DIR=${EEPCTL_STATE_DIR:-$PWD/.eepctl-state}
mkdir -p "$EEPCTL_STATE_DIR"
LOAD_OUT=$EEPCTL_STATE_DIR/demo-load.txt
HEAL_OUT=$EEPCTL_STATE_DIR/demo-heal-load.txt
rm -f "$LOAD_OUT" "$HEAL_OUT"
LOAD=
cleanup() {
  local rc=$?
  if [ "$rc" -ne 0 ]; then  # a step failed: what the load in the background saw says why, often
    if [ -n "$LOAD" ]; then  # its report, once its sending ends (at most 30 s more)
      for _ in $(seq 30); do kill -0 "$LOAD" 2>/dev/null || break; sleep 1; done
      kill "$LOAD" 2>/dev/null || true
      wait "$LOAD" 2>/dev/null || true
    fi
    for out in "$LOAD_OUT" "$HEAL_OUT"; do
      if [ -s "$out" ]; then echo "== the load's output so far ($out)"; cat "$out"; fi
    done
    echo "== demo failed (exit $rc)"
  fi
  $EEP down --name "$NAME" --stop-cluster >/dev/null 2>&1 || true
}
trap cleanup EXIT

echo "== eepctl up --dp 2";            $EEP up --dp 2 --max-dp 4 --name "$NAME"
echo "== eepctl generate";             $EEP generate --name "$NAME"
echo "== eepctl status";               $EEP status --name "$NAME"
echo "== load in the background while scaling"
$EEP generate --name "$NAME" --rate 4 --duration 25 > "$LOAD_OUT" 2>&1 &
LOAD=$!
echo "== eepctl scale --dp 4";         $EEP scale --dp 4 --name "$NAME"
echo "== eepctl status";               $EEP status --name "$NAME"
echo "== eepctl scale --dp 2";         $EEP scale --dp 2 --name "$NAME"
echo "== eepctl status";               $EEP status --name "$NAME"
wait "$LOAD"; LOAD=
echo "== load during the transitions"; cat "$LOAD_OUT"
echo "== eepctl events";               $EEP events --name "$NAME"

echo "== self-healing: DP 3, then one rank SIGKILLed by its pid under load"
$EEP scale --dp 3 --name "$NAME"
$EEP generate --name "$NAME" --rate 4 --duration 15 > "$HEAL_OUT" 2>&1 &
LOAD=$!
sleep 3
VICTIM=$($EEP status --name "$NAME" -o json | .venv/bin/python -c \
  'import json,sys; r=[x for x in json.loads(sys.stdin.read().splitlines()[-1])["ranks"] if x["state"]=="serving"]; print(r[1]["pid"])')
echo "== kill -9 $VICTIM (a serving rank)"; kill -9 "$VICTIM"
sleep 1
echo "== eepctl status (recovering)";  $EEP status --name "$NAME"
sleep 8
echo "== eepctl status (recovered)";   $EEP status --name "$NAME"
wait "$LOAD"; LOAD=
echo "== load across the death: 0 failed"; cat "$HEAL_OUT"
echo "== eepctl events (the recover operation)"; $EEP events --name "$NAME"
echo "== eepctl down --stop-cluster";  $EEP down --name "$NAME" --stop-cluster
trap - EXIT
