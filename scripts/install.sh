#!/usr/bin/env bash
# Create .venv (Python 3.11+) and install openrl with its test extras.
# pyproject.toml accepts torch>=2.11,<2.14 (vLLM's CUDA build on a GPU machine: pip install
# -e ".[vllm]"); this script installs the CPU wheel torch==2.13.0 first, so that pip finds the
# requirement met and never pulls a CUDA build onto a CPU machine.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
. .venv/bin/activate
python -m pip install -q --upgrade pip >/dev/null 2>&1 || true
python -m pip install -q torch==2.13.0
python -m pip install -q -e ".[test]"
# tinker-cookbook for tests/stack/test_cookbook.py; --no-deps: see the note in pyproject.toml's test extra
python -m pip install -q --no-deps "tinker-cookbook==0.6.1"
