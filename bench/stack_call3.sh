#!/usr/bin/env bash
# Device call 3 of 3 (carry [".whl/s3"], timeout_s 600), right after stack_callB.sh on the same machine:
#   - completes vLLM: C.so.xz = $WORK/parts/C.so.xz.000 (call 2) + .whl/s3/C.so.xz.001, checked against
#     .whl/s3/SUMS, unpacked to $WORK/site/vllm/_C_stable_libtorch.abi3.so
#   - bench/stack_h200.py --sections sample,rl,cold --cold-reuse-main --breakdown with vLLM on PYTHONPATH (the stack's sampler then
#     serves through vLLM, sharing the GPU with the trainer): 128 concurrent SDK samples over 8 snapshots,
#     first sample after `openrl serve` (vLLM cold: a new state dir), RL steps of 1 and 8 runs; then, the
#     stack stopped, the same SamplerEngine called directly (vLLM) with the same adapters and jobs, for the
#     stack / direct ratio; then `openrl serve` once more on the same state dir (warm vLLM compile cache) ->
#     first forward_backward -> first sample
# CALL3_ARGS replaces the stack_h200.py arguments (e.g. --sections rl,cold --rl-runs 1,8 --warmup 1
# --cold-reuse-main --from-zero 15 --no-direct).
# Results: stack.jsonl, stack.md, logs3.tgz.
cd "$(dirname "$0")/.." && source bench/stack_env.sh
if [ "$DRY" != 1 ] && [ ! -x "$STK/bin/nats-server" ]; then
  echo "NOT WARM: $STK is missing (a fresh machine, not the one stack_callA.sh prepared): run bench/stack_callA.sh, stack_callB.sh first"; exit 3
fi
L=$WORK/logs3; rm -rf "$L"; mkdir -p "$L"
el start; nvidia-smi --query-gpu=name,memory.used --format=csv 2>/dev/null
( cp .whl/s3/* "$PARTS"/ && cd "$PARTS" && cat C.so.xz.000 C.so.xz.001 > C.so.xz && sha256sum -c SUMS \
  && "$PY" -c "import lzma,shutil; shutil.copyfileobj(lzma.open('$PARTS/C.so.xz'), open('$SITE/vllm/_C_stable_libtorch.abi3.so','wb'))" \
  && rm -f C.so.xz && echo UNPACK_C_OK ) > "$L/unpack_c.log" 2>&1
el "unpack C rc=$?"; tail -2 "$L/unpack_c.log"
stack_path vllm
"$PY" -c "import vllm, vllm._C_stable_libtorch; print('vllm', vllm.__version__, '_C loaded')" 2>&1 | tail -2
"$PY" -c "import functions.sampler.engine as e, importlib.util as u; print('find_spec vllm:', u.find_spec('vllm') is not None)"
stack_bench $(( $(left) - 10 )) ${CALL3_ARGS:---sections sample,rl,cold --cold-reuse-main --warmup 1 --breakdown --direct-rows 0} > "$L/stack_sample_rl.log" 2>&1; el "stack sample,rl rc=$?"
grep '^{' "$L/stack_sample_rl.log" | grep -v '"what": "env"' | cut -c1-500
grep -v -E "^\s+(File|\^)" "$L/stack_sample_rl.log" | grep -i -E -B2 -A8 "Traceback|Error" | head -40
pack_logs logs3 "$L"; el "call3 done"
