#!/usr/bin/env bash
# The main job: install, then start the embedded stack (nats-server, gateway, trainer,
# sampler; the offline model is built on first use) and run examples/rl_loop.py
# through the real tinker SDK against it. PORT (default 8000) picks the gateway port,
# STEPS the number of RL steps.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
. .venv/bin/activate
export OPENRL_HOME=${OPENRL_HOME:-$PWD/.state}
exec openrl run --port "${PORT:-8000}" examples/rl_loop.py -- --steps "${STEPS:-10}" "$@"
