#!/usr/bin/env bash
# Issue 15 item 6: the autoresearch recipe's wall time with N experiments at once against one
# `openrl serve` (started as the README says, plus --idle-timeout), against the same N run one
# after another (--parallel 1), same configs (a one-point search space), then the idle time
# until the stack has no worker process left (supervisor.json: both "scaled to zero").
#   bash bench/autoresearch_sweep.sh            # N=8 STEPS=3 IDLE=30 on the built tiny model (CPU)
# Env: N, STEPS, IDLE (seconds), OUT (results dir, default /tmp/ar-bench), PY (.venv/bin/python).
set -euo pipefail
cd "$(dirname "$0")/.."
N=${N:-8}; STEPS=${STEPS:-3}; IDLE=${IDLE:-30}; OUT=${OUT:-/tmp/ar-bench}; PY=${PY:-.venv/bin/python}
rm -rf "$OUT"; mkdir -p "$OUT"; STATE=$OUT/state
PORT=$($PY -c "import socket; s=socket.socket(); s.bind(('127.0.0.1',0)); print(s.getsockname()[1])")
"$(dirname "$PY")/openrl" serve --state-dir "$STATE" --port "$PORT" --idle-timeout "$IDLE" > "$OUT/serve.log" 2>&1 &
SERVE=$!; trap 'kill $SERVE 2>/dev/null; wait $SERVE 2>/dev/null' EXIT
until curl -sf "http://127.0.0.1:$PORT/api/v1/healthz" >/dev/null; do sleep 0.5; done
export TINKER_BASE_URL=http://127.0.0.1:$PORT TINKER_API_KEY=$(cat "$STATE/api_key") TINKER_TELEMETRY=0
echo '{"learning_rate": [0.01], "rank": [8], "group_size": [4], "loss": ["importance_sampling"], "reward": ["arithmetic/shaped"]}' > "$OUT/space.json"
run() {  # parallel tag
  local t0=$(date +%s.%N)
  $PY examples/autoresearch --experiments "$N" --parallel "$1" --steps "$STEPS" --space "$OUT/space.json" \
      --out "$OUT/$2" > "$OUT/$2.log" 2>&1
  echo "$(date +%s.%N) - $t0" | bc
}
run 1 warmup_p1 > /dev/null   # loads the model in both workers, first passes (not timed)
W1=$(run 1 seq); WN=$(run "$N" par)
echo "{\"experiments\": $N, \"steps\": $STEPS, \"sequential_s\": $W1, \"parallel_s\": $WN, \"speedup\": $(echo "scale=2; $W1 / $WN" | bc)}" | tee "$OUT/sweep.json"
t0=$(date +%s.%N)
until $PY - "$STATE/supervisor.json" <<'PYEOF'
import json, sys
p = json.load(open(sys.argv[1]))["processes"]
sys.exit(0 if all(r["state"] == "scaled to zero" for r in p if r["name"].startswith(("trainer", "sampler"))) else 1)
PYEOF
do sleep 0.5; done
echo "{\"idle_timeout_s\": $IDLE, \"sweep_end_to_zero_workers_s\": $(echo "$(date +%s.%N) - $t0" | bc)}" | tee -a "$OUT/sweep.json"
