#!/usr/bin/env bash
# Run the SDK compatibility subset (tests/stack/test_compat_sdk.py and test_compat_sdk_matrix.py:
# every method docs/compatibility.md marks for 0.25.0) with an older tinker SDK.
#
#   bash scripts/test-old-sdk.sh [VERSION ...]      (default: 0.25.0, the oldest 0.25.x)
#
# For each VERSION: a venv .venv-sdk-VERSION holds only tinker==VERSION + pytest (no openrl,
# so nothing of the server can depend on the SDK it talks to); the stack is started from the
# main .venv with `openrl serve` on a free port and a throw-away state dir, with
# OPENRL_PROTO_COMPRESS=1 (so the old SDK sends zstd forward_backward bodies); the subset runs
# with `pytest --noconftest` against it (OPENRL_COMPAT_BASE_URL / OPENRL_COMPAT_API_KEY).
# Extra pytest arguments go after `--`:  bash scripts/test-old-sdk.sh 0.25.0 -- -x -k rest
# Set OPENRL_TEST_MODELS to an already-built models dir to skip the model build.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
VERSIONS=()
while [ $# -gt 0 ] && [ "$1" != "--" ]; do VERSIONS+=("$1"); shift; done
[ "${1:-}" = "--" ] && shift
[ ${#VERSIONS[@]} -gt 0 ] || VERSIONS=(0.25.0)

[ -x .venv/bin/python ] || bash scripts/install.sh
PY=${PYTHON:-python3}
STATE=$(mktemp -d "${TMPDIR:-/tmp}/openrl-oldsdk.XXXXXX")
mkdir -p "$STATE"
if [ -n "${OPENRL_TEST_MODELS:-}" ]; then ln -s "$OPENRL_TEST_MODELS" "$STATE/models"; fi
# --port 0: any free port, bound by the serve itself; its URL is in $STATE/ports.json (a new state dir)
TINKER_TELEMETRY=0 OPENRL_PROTO_COMPRESS=1 .venv/bin/openrl serve --port 0 --state-dir "$STATE" >"$STATE/serve.log" 2>&1 &
SERVE=$!
cleanup() { kill -INT "$SERVE" 2>/dev/null || true; wait "$SERVE" 2>/dev/null || true; rm -rf "$STATE"; }
trap cleanup EXIT
URL=
for _ in $(seq 1 300); do
  URL=$(.venv/bin/python -c "import httpx,json,sys; u=json.load(open(sys.argv[1]))['gateway']; assert httpx.get(u+'/api/v1/healthz').status_code == 200; print(u)" "$STATE/ports.json" 2>/dev/null) && break
  kill -0 "$SERVE" 2>/dev/null || { cat "$STATE/serve.log"; echo "openrl serve exited" >&2; exit 1; }
  sleep 1
done
[ -n "$URL" ] || { cat "$STATE/serve.log"; echo "openrl serve did not answer within 300 s" >&2; exit 1; }
export OPENRL_COMPAT_BASE_URL="$URL" OPENRL_COMPAT_API_KEY="$(cat "$STATE/api_key")"
export TINKER_TELEMETRY=0 HF_HUB_OFFLINE=1

TORCH=$(.venv/bin/python -c 'import torch; print(torch.__version__.split("+")[0])')
rc=0
for V in "${VERSIONS[@]}"; do
  VENV=".venv-sdk-$V"
  [ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
  # torch for forward_backward_custom (client-side), the same CPU build as the main venv
  # (installing it first keeps pip from resolving a CUDA build, as in scripts/install.sh)
  "$VENV/bin/python" -m pip install -q "torch==$TORCH" >/dev/null
  "$VENV/bin/python" -m pip install -q "tinker==$V" "pytest>=8" "pytest-timeout>=2.3" >/dev/null
  echo "== tests/stack/test_compat_sdk*.py with tinker $("$VENV/bin/python" -c 'import tinker; print(tinker.__version__)')"
  # pytest.main, then os._exit with its status: the old SDK's client process can abort (SIGABRT,
  # exit 134) in interpreter teardown after every result is in (CI, 2026-12-06: "19 passed", then
  # "Aborted"): 0.25's SamplingClient keeps a spawned sidecar subprocess, daemon threads and
  # multiprocessing queues whose __del__ / atexit clean-up runs while modules are torn down. That
  # teardown is the SDK's, not the server's; skipping it keeps the exit status pytest reports (a
  # failed test still fails the script). The sidecar exits on its own when its parent is gone (its
  # parent-death pipe). -X faulthandler prints every thread's stack should anything abort earlier.
  "$VENV/bin/python" -X faulthandler -c 'import os, sys, pytest
rc = int(pytest.main(sys.argv[1:]))
sys.stdout.flush(); sys.stderr.flush()
os._exit(rc)' --noconftest -p no:cacheprovider -q -ra --durations=5 \
    "$ROOT/tests/stack/test_compat_sdk.py" "$ROOT/tests/stack/test_compat_sdk_matrix.py" "$@" || rc=$?
done
exit $rc
