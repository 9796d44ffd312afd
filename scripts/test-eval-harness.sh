#!/usr/bin/env bash
# Run tests/stack/test_eval_harness.py: lm-eval's local-completions model (an evaluation harness a
# user points at the OpenAI-compatible endpoint) against `openrl serve`.
#
#   bash scripts/test-eval-harness.sh [-- PYTEST ARGS]
#
# lm-eval lives in its own venv .venv-eval (with the main venv's CPU torch build, no openrl):
# its dependencies (pytablewriter -> typepy) pin python-dateutil<3, which the main venv's
# kubernetes client refuses. The stack is started from the main .venv with `openrl serve` on a
# free port and a throw-away state dir; the test runs with `pytest --noconftest` against it
# (OPENRL_EVAL_BASE_URL / OPENRL_EVAL_API_KEY / OPENRL_EVAL_TOKENIZER).
# Set OPENRL_TEST_MODELS to an already-built models dir to skip the model build.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
[ "${1:-}" = "--" ] && shift
[ -x .venv/bin/python ] || bash scripts/install.sh
PY=${PYTHON:-python3}
STATE=$(mktemp -d "${TMPDIR:-/tmp}/openrl-eval.XXXXXX")
if [ -n "${OPENRL_TEST_MODELS:-}" ]; then ln -s "$OPENRL_TEST_MODELS" "$STATE/models"; fi
# --port 0: any free port, bound by the serve itself; its URL is in $STATE/ports.json (a new state dir)
TINKER_TELEMETRY=0 .venv/bin/openrl serve --port 0 --state-dir "$STATE" >"$STATE/serve.log" 2>&1 &
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
export OPENRL_EVAL_BASE_URL="$URL" OPENRL_EVAL_API_KEY="$(cat "$STATE/api_key")"
export OPENRL_EVAL_TOKENIZER="$STATE/models/tiny-qwen3" HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1

VENV=.venv-eval
TORCH=$(.venv/bin/python -c 'import torch; print(torch.__version__.split("+")[0])')
# the tokenizer lm-eval loads (tokenizer_backend=huggingface): the main venv's transformers
TRANSFORMERS=$(.venv/bin/python -c 'import transformers; print(transformers.__version__)')
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
# the main venv's CPU torch first, so that pip never resolves a CUDA build (as scripts/install.sh)
"$VENV/bin/python" -m pip install -q "torch==$TORCH" >/dev/null
"$VENV/bin/python" -m pip install -q "lm-eval[api]==0.4.13" "transformers==$TRANSFORMERS" "pytest>=8" "pytest-timeout>=2.3" httpx >/dev/null
echo "== tests/stack/test_eval_harness.py with lm-eval $("$VENV/bin/python" -c 'import importlib.metadata as m; print(m.version("lm_eval"))')"
"$VENV/bin/python" -m pytest --noconftest -p no:cacheprovider -q -ra "$ROOT/tests/stack/test_eval_harness.py" "$@"
