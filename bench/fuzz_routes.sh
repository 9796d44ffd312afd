#!/usr/bin/env bash
# The long randomized run of the gateway route fuzzer (tests/stack/test_fuzz_routes.py).
#
# CI runs the fuzzer derandomized (the same inputs every run) and replays the example database
# tests/data/fuzz_findings.jsonl; this script draws NEW random inputs, many more of them, so
# that bugs CI cannot see turn up here. Run it before finishing any change to the gateway
# (functions/gateway/, openrl/edge/). Whatever it finds is appended (shrunk, ids as
# placeholders) to tests/data/fuzz_findings.jsonl: fix the route, keep the line, commit both;
# CI then replays it for ever.
#
#   bash bench/fuzz_routes.sh                 # 400 examples per route, a random seed
#   EXAMPLES=2000 SEED=123 bash bench/fuzz_routes.sh -k session_heartbeat
#
# EXAMPLES: hypothesis examples per fuzzed route (default 400; CI uses 40).
# SEED: the hypothesis seed (default: a random one, printed first; pass it again to repeat a run).
# Further arguments go to pytest. Needs the project venv (bash scripts/install.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
EXAMPLES=${EXAMPLES:-400}
SEED=${SEED:-$(od -An -N4 -tu4 /dev/urandom | tr -d ' ')}
FINDINGS=${OPENRL_FUZZ_FINDINGS:-$PWD/tests/data/fuzz_findings.jsonl}
before=$(wc -l < "$FINDINGS" 2>/dev/null || echo 0)
echo "fuzz_routes: $EXAMPLES examples per route, seed $SEED (repeat: SEED=$SEED EXAMPLES=$EXAMPLES bash $0)"
rc=0
OPENRL_FUZZ_RANDOM=1 OPENRL_FUZZ_EXAMPLES=$EXAMPLES OPENRL_FUZZ_FINDINGS=$FINDINGS TINKER_TELEMETRY=0 HF_HUB_OFFLINE=1 \
  .venv/bin/python -m pytest tests/stack/test_fuzz_routes.py -q -p no:cacheprovider --hypothesis-seed="$SEED" "$@" || rc=$?
after=$(wc -l < "$FINDINGS" 2>/dev/null || echo 0)
if [ "$after" -gt "$before" ]; then
  echo "fuzz_routes: $((after - before)) new finding(s) appended to $FINDINGS:"
  tail -n $((after - before)) "$FINDINGS"
fi
exit $rc
