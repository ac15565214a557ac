#!/usr/bin/env bash
# The embedded default, end to end: a local Ray head, a reference deployment at DP=2,
# requests, live scale 2 -> 4 -> 2 under load, status and history; then one rank SIGKILLed under
# load and the deployment healing itself (no request lost); then everything stopped.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
EEP=.venv/bin/eepctl
NAME=${EEPCTL_NAME:-demo}
export EEPCTL_STATE_DIR=${EEPCTL_STATE_DIR:-$PWD/.eepctl-state}
cleanup() { $EEP down --name "$NAME" --stop-cluster >/dev/null 2>&1 || true; }
trap cleanup EXIT

echo "== eepctl up --dp 2";            $EEP up --dp 2 --max-dp 4 --name "$NAME"
echo "== eepctl generate";             $EEP generate --name "$NAME"
echo "== eepctl status";               $EEP status --name "$NAME"
echo "== load in the background while scaling"
$EEP generate --name "$NAME" --rate 4 --duration 25 > .eepctl-state/demo-load.txt 2>&1 &
LOAD=$!
echo "== eepctl scale --dp 4";         $EEP scale --dp 4 --name "$NAME"
echo "== eepctl status";               $EEP status --name "$NAME"
echo "== eepctl scale --dp 2";         $EEP scale --dp 2 --name "$NAME"
echo "== eepctl status";               $EEP status --name "$NAME"
wait "$LOAD"
echo "== load during the transitions"; cat .eepctl-state/demo-load.txt
echo "== eepctl events";               $EEP events --name "$NAME"

echo "== self-healing: DP 3, then one rank SIGKILLed by its pid under load"
$EEP scale --dp 3 --name "$NAME"
$EEP generate --name "$NAME" --rate 4 --duration 15 > .eepctl-state/demo-heal-load.txt 2>&1 &
LOAD=$!
sleep 3
VICTIM=$($EEP status --name "$NAME" -o json | .venv/bin/python -c \
  'import json,sys; r=[x for x in json.loads(sys.stdin.read().splitlines()[-1])["ranks"] if x["state"]=="serving"]; print(r[1]["pid"])')
echo "== kill -9 $VICTIM (a serving rank)"; kill -9 "$VICTIM"
sleep 1
echo "== eepctl status (recovering)";  $EEP status --name "$NAME"
sleep 8
echo "== eepctl status (recovered)";   $EEP status --name "$NAME"
wait "$LOAD"
echo "== load across the death: 0 failed"; cat .eepctl-state/demo-heal-load.txt
echo "== eepctl events (the recover operation)"; $EEP events --name "$NAME"
echo "== eepctl down --stop-cluster";  $EEP down --name "$NAME" --stop-cluster
trap - EXIT
