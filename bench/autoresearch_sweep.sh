#!/usr/bin/env bash
# Issue 15 item 6: the autoresearch recipe's wall time with N experiments at once against one
# `openrl serve` (started as the README says, plus --idle-timeout), against the same N run one
# after another (--parallel 1), same configs (a one-point search space), then the idle time
# until the stack has no worker process left (supervisor.json: both "scaled to zero").
#   bash bench/autoresearch_sweep.sh            # N=8 STEPS=3 IDLE=30 on the built tiny model (CPU)
# Env: N, STEPS, IDLE (seconds), OUT (results dir, default /tmp/ar-bench), PY (.venv/bin/python),
#   STATE (state dir, default $OUT/state; an existing one is reused, e.g. for its compile caches),
#   SERVE_ARGS (more `openrl serve` arguments, e.g. --model NAME=DIR), MODEL (the driver's --model),
#   ROWS (';'-separated driver arguments, one timed row each, e.g. "; --prompts 8 --max-tokens 64":
#   the recipe's defaults, then bigger steps), DEADLINE (seconds from start after which no new row
#   starts). One untimed sweep (--parallel 1) first: it starts both workers and their first passes.
# A row's "worker_started_in" names the timed runs in which a worker process started (its pid changed: scaled to
# zero and back, or a crash): such a run's time holds a model load and is not comparable.
# Results: $OUT/sweep.json (one JSON object a line), $OUT/<tag>.log and <tag>/ (leaderboards), serve.log.
set -euo pipefail
cd "$(dirname "$0")/.."
N=${N:-8}; STEPS=${STEPS:-3}; IDLE=${IDLE:-30}; OUT=${OUT:-/tmp/ar-bench}; PY=${PY:-.venv/bin/python}
STATE=${STATE:-$OUT/state}; MODEL=${MODEL:-}; ROWS=${ROWS:-}; DEADLINE=${DEADLINE:-100000}
rm -rf "$OUT/seq"* "$OUT/par"* "$OUT/warmup"* "$OUT/sweep.json"; mkdir -p "$OUT"
T0=$(date +%s)
now() { "$PY" -c "import time; print(f'{time.time():.3f}')"; }
sub() { "$PY" -c "import sys; print(round(float(sys.argv[1]) - float(sys.argv[2]), 2))" "$1" "$2"; }
# --port 0: any free port, bound by the serve; its URL is read from this serve's <state>/ports.json
mkdir -p "$STATE"; rm -f "$STATE/ports.json"
# shellcheck disable=SC2086
"$PY" -c "import sys; from openrl.cli import main; sys.exit(main())" serve --state-dir "$STATE" --port 0 \
    --idle-timeout "$IDLE" ${SERVE_ARGS:-} > "$OUT/serve.log" 2>&1 &
SERVE=$!; trap 'kill $SERVE 2>/dev/null; wait $SERVE 2>/dev/null' EXIT
URL=$("$PY" - "$STATE/ports.json" <<'PYEOF'
import json, sys, time, urllib.request
while True:
    try:
        url = json.load(open(sys.argv[1]))["gateway"]
        urllib.request.urlopen(f"{url}/api/v1/healthz", timeout=2); break
    except (OSError, ValueError, KeyError):
        time.sleep(0.5)
print(url)
PYEOF
)
echo "[$(( $(date +%s) - T0 ))s] healthy on $URL"
export TINKER_BASE_URL=$URL TINKER_API_KEY=$(cat "$STATE/api_key") TINKER_TELEMETRY=0
echo '{"learning_rate": [0.01], "rank": [8], "group_size": [4], "loss": ["importance_sampling"], "reward": ["arithmetic/shaped"]}' > "$OUT/space.json"
pids() {  # the trainer's and sampler's pids now (supervisor.json): a row whose pids changed had a worker start in it
  "$PY" - "$STATE/supervisor.json" <<'PYEOF'
import json, sys
p = json.load(open(sys.argv[1]))["processes"]
print(",".join(f"{r['name']}={r['pid']}" for r in p if r["name"].startswith(("trainer", "sampler"))))
PYEOF
}
run() {  # parallel tag [driver args...]: prints the wall seconds
  local par=$1 tag=$2; shift 2
  local t0; t0=$(now)
  "$PY" examples/autoresearch --experiments "$N" --parallel "$par" --steps "$STEPS" --space "$OUT/space.json" \
      ${MODEL:+--model "$MODEL"} --out "$OUT/$tag" "$@" > "$OUT/$tag.log" 2>&1 || { echo "FAILED $tag" >&2; tail -20 "$OUT/$tag.log" >&2; return 1; }
  sub "$(now)" "$t0"
}
W=$(run 1 warmup)   # loads the model in both workers, first passes (not timed)
echo "[$(( $(date +%s) - T0 ))s] warm-up sweep $W s"
i=0
IFS=';' read -r -a rows <<<"${ROWS:- }"
for args in "${rows[@]}"; do
  [ $(( $(date +%s) - T0 )) -lt "$DEADLINE" ] || { echo "deadline: row '$args' not run"; break; }
  # shellcheck disable=SC2086
  p0=$(pids); W1=$(run 1 seq$i $args); p1=$(pids); WN=$(run "$N" par$i $args); p2=$(pids)
  # a worker (re)started inside a timed row (scaled to zero meanwhile, or crashed): its start is in that row's time
  starts=$("$PY" -c "import json, sys; a, b, c = sys.argv[1:]; print(json.dumps([n for n, x, y in (('sequential', a, b), ('parallel', b, c)) if x != y]))" "$p0" "$p1" "$p2")
  echo "{\"experiments\": $N, \"steps\": $STEPS, \"driver_args\": \"$(echo $args)\", \"sequential_s\": $W1, \"parallel_s\": $WN, \"speedup\": $("$PY" -c "print(round($W1 / $WN, 2))"), \"worker_started_in\": $starts, \"pids\": [\"$p0\", \"$p1\", \"$p2\"]}" | tee -a "$OUT/sweep.json"
  i=$((i + 1))
done
t0=$(now)
until "$PY" - "$STATE/supervisor.json" <<'PYEOF'
import json, sys
p = json.load(open(sys.argv[1]))["processes"]
sys.exit(0 if all(r["state"] == "scaled to zero" for r in p if r["name"].startswith(("trainer", "sampler"))) else 1)
PYEOF
do sleep 0.5; done
echo "{\"idle_timeout_s\": $IDLE, \"sweep_end_to_zero_workers_s\": $(sub "$(now)" "$t0")}" | tee -a "$OUT/sweep.json"
