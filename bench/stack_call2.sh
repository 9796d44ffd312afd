#!/usr/bin/env bash
# Device call 2 of 3 (carry [".whl/s2"], timeout_s 600), right after call 1 on the same machine ($WORK/stk,
# $WORK/site, $WORK/q4b must still be there):
#   - keeps the first part of vLLM's _C archive (.whl/s2) in $WORK/parts for call 3
#   - the training side, all in this one job so that every ratio is same-machine, same-job:
#     bench/stack_h200.py --sections sft (1/2/4/8 SDK runs through openrl serve, 1 x 1024 tokens a step),
#     bench/cobatch_h200.py --sections cobatch (our TrainerEngine called directly, same shapes),
#     bench/peft_baseline_h200.py B=1 K=8 SKIP_SAMPLE=1 (transformers + peft, one run after another)
# Results: stack.jsonl, stack.md, cobatch.jsonl, peft_b1.jsonl, logs2.tgz.
cd "$(dirname "$0")/.." && source bench/stack_env.sh
if [ "$DRY" != 1 ] && [ ! -x "$STK/bin/nats-server" ]; then
  echo "NOT WARM: $STK is missing (a fresh machine, not the one call 1 prepared): run bench/stack_call1.sh first"; exit 3
fi
L=$WORK/logs2; rm -rf "$L"; mkdir -p "$L"
el start; nvidia-smi --query-gpu=name,memory.used --format=csv 2>/dev/null; ls "$PARTS" "$MODEL" 2>&1 | head -12
cp .whl/s2/* "$PARTS"/ && el "part 2 kept: $(ls -la "$PARTS" | tail -n +2 | awk '{print $NF, $5}' | tr '\n' ' ')"
stack_path
stack_bench 270 --sections sft > "$L/stack_sft.log" 2>&1; el "stack sft rc=$?"
grep '^{' "$L/stack_sft.log" | grep -v '"what": "env"' | cut -c1-400
grep -i -E -A3 "Traceback|Error" "$L/stack_sft.log" | head -20
timeout $(( $(left) - 100 > 200 ? 200 : $(left) - 100 )) "$PY" bench/cobatch_h200.py --sections cobatch --reps 3 --out "$O" "${COBATCH[@]}" > "$L/cobatch.log" 2>&1
el "cobatch rc=$?"; grep '^{' "$L/cobatch.log" | grep -v section_done | cut -c1-300; grep -i -E "error|Traceback" "$L/cobatch.log" | head -5
if [ "$DRY" != 1 ] && [ "$(left)" -gt 60 ]; then
  B=1 K=8 SKIP_SAMPLE=1 timeout $(( $(left) - 15 )) "$PY" bench/peft_baseline_h200.py > "$O/peft_b1.jsonl" 2> "$L/peft_b1.err"
  el "peft b1 rc=$?"; cut -c1-250 "$O/peft_b1.jsonl"; tail -2 "$L/peft_b1.err"
fi
pack_logs logs2 "$L"; el "call2 done"
