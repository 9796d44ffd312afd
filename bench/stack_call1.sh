#!/usr/bin/env bash
# Start-up and peft-sampling call (run alone, or instead of stack_callA.sh when cold start is what you need;
# the training side, same job with the engine and peft, is stack_callA.sh). Formerly device call 1 of 3 (device tool `run`, carry [".gpu", ".whl/s1"], timeout_s 600), on a fresh H200 machine:
#   - installs the stack's wheels (.gpu/wheels) into $WORK/stk; unpacks vLLM part A (.whl/s1) into $WORK/site
#     in the background (CPU only; the _C library comes in calls 2 and 3)
#   - writes the Qwen3-4B-shaped random bf16 model $WORK/q4b with the Qwen tokenizer (.gpu/tok)
#   - bench/stack_h200.py --sections cold --no-cold-sample: openrl serve on a new state dir -> first
#     forward_backward, twice (the second on warm caches); this also checks that the stack runs here
#   - the HF generate + peft sampling baseline (bench/peft_baseline_h200.py B=8 K=4 NEW_TOKENS=32)
# Build the payload first (here): bash bench/stack_payload.sh. Calls 2 and 3 must follow on the same warm
# machine (it is given back 30 s after a call): have them ready.
# Results (<= 8 files): stack.jsonl, stack.md, peft_b8.jsonl, logs1.tgz.
# DRY=1 bash bench/stack_call1.sh: the same steps on a CPU machine (tiny model, no peft).
# SETUP=0: skip the wheels, the model and vLLM part A (a machine a first call prepared); COLD=0: skip the
# start-up measurement (COLD_ARGS: more stack_h200.py arguments, e.g. --from-zero 15); PEFT=0: skip the
# peft baseline.
cd "$(dirname "$0")/.." && source bench/stack_env.sh
L=$WORK/logs1; rm -rf "$L"; mkdir -p "$L"
el start; gpu_info
[ "${SETUP:-1}" = 1 ] && ( cp .whl/s1/* "$PARTS"/ && cd "$PARTS" && sha256sum -c SUMS1 \
  && "$PY" -c "import tarfile; tarfile.open('$PARTS/A.tar.xz','r:xz').extractall('$SITE', filter='fully_trusted')" \
  && rm -f "$PARTS/A.tar.xz" && echo UNPACK_A_OK ) > "$L/unpack_a.log" 2>&1 &
UP=$!
if [ "$DRY" != 1 ] && [ "${SETUP:-1}" = 1 ]; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --target "$STK" .gpu/wheels/*.whl > "$L/pip_stk.log" 2>&1
  el "stack wheels rc=$? ($(ls .gpu/wheels | wc -l) wheels)"; tail -3 "$L/pip_stk.log"
fi
stack_path
"$PY" -c "import tinker, nats, fastapi, uvicorn, cloudevents, openrl.cli, functions.gateway.app; print('stack imports ok, tinker', tinker.__version__)" 2>&1 | tail -3
ls "$STK/bin/nats-server" 2>/dev/null
if [ "$DRY" != 1 ] && [ "${SETUP:-1}" = 1 ]; then
  timeout 150 "$PY" bench/stack_h200.py --make-model "$MODEL" --tokenizer-from .gpu/tok > "$L/make_model.log" 2>&1
  el "make_model rc=$?"; tail -2 "$L/make_model.log"; du -sh "$MODEL"
fi
if [ "${COLD:-1}" = 1 ]; then
  stack_bench 300 --sections cold --no-cold-sample ${COLD_ARGS:-} > "$L/stack_cold.log" 2>&1; el "stack cold rc=$?"
  grep '^{' "$L/stack_cold.log" | grep -v '"what": "env"' | cut -c1-400
  grep -i -E -A3 "Traceback|Error" "$L/stack_cold.log" | head -20
fi
if [ "$DRY" != 1 ] && [ "${PEFT:-1}" = 1 ] && [ "$(left)" -gt 120 ]; then
  B=8 K=4 NEW_TOKENS=32 timeout $(( $(left) - 20 )) "$PY" bench/peft_baseline_h200.py > "$O/peft_b8.jsonl" 2> "$L/peft_b8.err"
  el "peft b8 rc=$?"; cut -c1-250 "$O/peft_b8.jsonl"; tail -2 "$L/peft_b8.err"
fi
[ "${SETUP:-1}" = 1 ] && wait $UP; el "unpack A rc=$?"; tail -1 "$L/unpack_a.log"; du -sh "$SITE" 2>/dev/null; ls -la "$PARTS"
pack_logs logs1 "$L"; el "call1 done"
