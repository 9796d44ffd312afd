#!/usr/bin/env bash
# Device call A (carry [".gpu", ".whl/s1"], timeout_s 600) on a fresh H200 machine: the training side in one job.
#   installs the stack's wheels, unpacks vLLM part A in the background, writes the Qwen3-4B-shaped model, then
#   bench/stack_h200.py --sections sft (1/2/4/8 SDK runs through openrl serve), bench/cobatch_h200.py
#   --sections cobatch (the engine alone, same shapes), bench/peft_baseline_h200.py B=1 K=8 (peft, one run
#   after another): every ratio is same machine, same job. Follow at once with stack_callB.sh, stack_call3.sh.
cd "$(dirname "$0")/.." && source bench/stack_env.sh
L=$WORK/logsA; rm -rf "$L"; mkdir -p "$L"
el start; gpu_info
( cp .whl/s1/* "$PARTS"/ && cd "$PARTS" && sha256sum -c SUMS1 \
  && "$PY" -c "import tarfile; tarfile.open('$PARTS/A.tar.xz','r:xz').extractall('$SITE', filter='fully_trusted')" \
  && rm -f "$PARTS/A.tar.xz" && echo UNPACK_A_OK ) > "$L/unpack_a.log" 2>&1 &
UP=$!
"$PY" -m pip install -q --no-index --no-deps --no-compile --target "$STK" .gpu/wheels/*.whl > "$L/pip_stk.log" 2>&1
el "stack wheels rc=$?"
stack_path
timeout 150 "$PY" bench/stack_h200.py --make-model "$MODEL" --tokenizer-from .gpu/tok > "$L/make_model.log" 2>&1
el "make_model rc=$?"; tail -1 "$L/make_model.log"
stack_bench 260 --sections sft > "$L/stack_sft.log" 2>&1; el "stack sft rc=$?"
grep '^{' "$L/stack_sft.log" | grep -v '"what": "env"' | cut -c1-400
grep -i -E -A3 "Traceback|Error" "$L/stack_sft.log" | head -20
timeout 150 "$PY" bench/cobatch_h200.py --sections cobatch --reps 3 --out "$O" > "$L/cobatch.log" 2>&1
el "cobatch rc=$?"; grep '^{' "$L/cobatch.log" | grep -v section_done | cut -c1-300; grep -i -E "error|Traceback" "$L/cobatch.log" | head -5
if [ "$(left)" -gt 50 ]; then
  B=1 K=8 SKIP_SAMPLE=1 timeout $(( $(left) - 15 )) "$PY" bench/peft_baseline_h200.py > "$O/peft_b1.jsonl" 2> "$L/peft_b1.err"
  el "peft b1 rc=$?"; cut -c1-250 "$O/peft_b1.jsonl"
fi
wait $UP; el "unpack A rc=$?"; tail -1 "$L/unpack_a.log"
pack_logs logsA "$L"; el "callA done"
