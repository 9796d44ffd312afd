#!/usr/bin/env bash
# Create .venv (Python 3.11+) and install openrl with its test extras.
# torch is pinned to the CPU build 2.13.0 in pyproject.toml; installing it first keeps
# pip from resolving a CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
. .venv/bin/activate
python -m pip install -q --upgrade pip >/dev/null 2>&1 || true
python -m pip install -q torch==2.13.0
python -m pip install -q -e ".[test]"
# tinker-cookbook for tests/test_cookbook.py; --no-deps: see the note in pyproject.toml's test extra
python -m pip install -q --no-deps "tinker-cookbook==0.6.1"
