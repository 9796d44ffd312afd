#!/usr/bin/env bash
# Install everything the tests need, then run them. The tests start their own
# nats-server, GCS emulator, gateway and workers on 127.0.0.1.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
. .venv/bin/activate
if [ -f scripts/ci-deploy-tools.sh ]; then bash scripts/ci-deploy-tools.sh; fi
export TINKER_TELEMETRY=0 HF_HUB_OFFLINE=1
# the compatibility subset against an older, protobuf-era SDK (its own venv)
bash scripts/test-old-sdk.sh 0.25.0
# lm-eval's local-completions against the OpenAI-compatible endpoint (its own venv)
bash scripts/test-eval-harness.sh
python -m pytest -ra --durations=25 "$@"   # the 25 slowest: CI must stay well under its 90 minutes
