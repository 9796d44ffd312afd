#!/usr/bin/env bash
# Device call C: the GPU conformance run (bench/gpu_conformance.py, docs/gpu-conformance.md) in one call, on
# the machine stack_callA.sh and stack_callB.sh prepared (stack wheels in $WORK/stk, vLLM part A and the first
# part of its _C library, the Qwen3-4B-shaped model in $WORK/q4b):
#   - carry [".whl/s3"]: completes vLLM first (as stack_call3.sh) unless $WORK/site/vllm/_C_stable_libtorch.abi3.so
#     is already there (then carry nothing)
#   - gpu_conformance.py --serve "--model Qwen/Qwen3-4B-Instruct-2507=$WORK/q4b --idle-timeout 0": openrl serve
#     with the vLLM sampler, tests/stack against it with the bf16 bounds of tests/tolerances.py, the serve
#     stopped at the end
# Results: conformance/gpu-conformance.md (paste into docs/gpu-conformance.md), conformance/{results,measures}.jsonl,
# junit.xml, pytest.log, serve.log; logsC.tgz (the stack's own logs).
# COMMIT: the commit under test (no git there; e.g. COMMIT=$(git rev-parse --short HEAD) in the run command).
# FILES: test files (names in tests/stack) to run instead of all; ARGS: more gpu_conformance.py arguments.
# DRY=1 bash bench/stack_callC.sh: the same on a CPU machine (the project's .venv, the tiny model, fp32 bounds).
cd "$(dirname "$0")/.." && source bench/stack_env.sh
L=$WORK/logsC; rm -rf "$L"; mkdir -p "$L"
el start; nvidia-smi --query-gpu=name,memory.used --format=csv 2>/dev/null
if [ "$DRY" != 1 ]; then
  [ -x "$STK/bin/nats-server" ] || { echo "NOT WARM: $STK is missing: run bench/stack_callA.sh, stack_callB.sh first"; exit 3; }
  if [ ! -s "$SITE/vllm/_C_stable_libtorch.abi3.so" ]; then
    ( cp .whl/s3/* "$PARTS"/ && cd "$PARTS" && cat C.so.xz.000 C.so.xz.001 > C.so.xz && sha256sum -c SUMS \
      && "$PY" -c "import lzma,shutil; shutil.copyfileobj(lzma.open('$PARTS/C.so.xz'), open('$SITE/vllm/_C_stable_libtorch.abi3.so','wb'))" \
      && rm -f C.so.xz && echo UNPACK_C_OK ) > "$L/unpack_c.log" 2>&1
    el "unpack C rc=$?"; tail -2 "$L/unpack_c.log"
  fi
  stack_path vllm
  SERVE="--model Qwen/Qwen3-4B-Instruct-2507=$MODEL --idle-timeout 0"
else
  stack_path
  SERVE="--device cpu --idle-timeout 0"
fi
"$PY" -c "import pytest, tinker; print('pytest', pytest.__version__, 'tinker', tinker.__version__)"
CS=$WORK/conf-state; rm -rf "$CS"
# shellcheck disable=SC2086
"$PY" bench/gpu_conformance.py --state-dir "$CS" --out "$O/conformance" --commit "${COMMIT:-unknown}" \
  --budget-s $(( $(left) - 25 )) --serve "$SERVE" ${FILES:+--files $FILES} ${ARGS:-} > "$L/conformance.log" 2>&1
el "conformance rc=$?"; head -40 "$L/conformance.log"
cp -r "$CS/logs" "$L/stack-logs" 2>/dev/null
pack_logs logsC "$L"; el "callC done"
