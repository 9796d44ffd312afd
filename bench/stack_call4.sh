#!/usr/bin/env bash
# Device call 4 (carry [".whl/s4"], timeout_s 600), right after stack_call3.sh on the same machine (vLLM is
# complete there): the autoresearch sweep through the stack on the H200 (issue 15 item 6).
#   - installs .whl/s4 (optuna, SQLAlchemy, alembic, matplotlib and their wheels: the recipe's own
#     dependencies, which the GPU image lacks) into $WORK/stk4
#   - bench/autoresearch_sweep.sh: `openrl serve --model Qwen/Qwen3-4B-Instruct-2507=$WORK/q4b
#     --idle-timeout $IDLE` on $SB/main (the state dir call 3 left, so vLLM's compile cache is warm),
#     8 experiments one after another vs all at once, per row of ROWS, then the idle time to zero workers
# Build .whl/s4 here first: bash bench/stack_payload.sh (SKIP_VLLM=1 SKIP_GPU=1 for .whl/s4 alone). DRY=1: the same on a CPU machine.
# Results: ar/sweep.json, ar/*.log, logs4.tgz.
cd "$(dirname "$0")/.." && source bench/stack_env.sh
L=$WORK/logs4; rm -rf "$L"; mkdir -p "$L"
el start; nvidia-smi --query-gpu=name,memory.used --format=csv 2>/dev/null
if [ "$DRY" != 1 ]; then
  [ -x "$STK/bin/nats-server" ] || { echo "NOT WARM: run stack_call1.sh, stack_callB.sh, stack_call3.sh first"; exit 3; }
  "$PY" -m pip install -q --no-index --no-deps --no-compile --target "$WORK/stk4" .whl/s4/*.whl > "$L/pip_s4.log" 2>&1
  el "s4 wheels rc=$?"; tail -2 "$L/pip_s4.log"
  stack_path vllm; export PYTHONPATH=$STK:$WORK/stk4:$SITE:$PWD
  SERVE_ARGS="--model Qwen/Qwen3-4B-Instruct-2507=$MODEL"; MODEL_NAME=Qwen/Qwen3-4B-Instruct-2507
else
  stack_path; SERVE_ARGS="--device cpu"; MODEL_NAME=
fi
"$PY" -c "import optuna, sqlalchemy, matplotlib; print('optuna', optuna.__version__)" 2>&1 | tail -1
mkdir -p "$SB/main"
N=${N:-8} STEPS=${STEPS:-3} IDLE=${IDLE:-30} OUT=$O/ar STATE=$SB/main PY=$PY SERVE_ARGS=$SERVE_ARGS MODEL=$MODEL_NAME \
  ROWS=${ROWS:-"; --prompts 8 --max-tokens 64"} DEADLINE=$(( ${CALL_LIMIT:-575} - 200 )) \
  timeout -k 20 $(( $(left) - 25 )) bash bench/autoresearch_sweep.sh 2>&1 | tee "$L/sweep.log"
el "sweep rc=${PIPESTATUS[0]}"
grep -h "start-up phase\|Traceback\|Error" "$SB"/main/logs/*.log 2>/dev/null | tail -30
cp "$O"/ar/*.log "$L"/ 2>/dev/null
pack_logs logs4 "$L"; el "call4 done"
