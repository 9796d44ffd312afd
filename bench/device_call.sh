#!/usr/bin/env bash
# The device calls of bench/, one runner with named steps: `bash bench/device_call.sh STEP` is the command of
# one call on a GPU machine (device tool `run`, timeout_s 600, carry: the paths `--list` names for STEP).
# A chain's steps run on ONE warm machine, which is given back 30 s after a call: start each step as soon as
# the previous one returns. The payloads the steps carry are built here first (bench/vllm_payload_split.sh,
# bench/stack_payload.sh, bench/conform_payload.sh); they stay separate scripts.
#   bash bench/device_call.sh --list          every step: what it carries, what it does, the script it replaced
#   bash bench/device_call.sh --carry STEP    STEP's carry as the device tool takes it, e.g. [".gpu", ".whl/k1"]
#   bash bench/device_call.sh STEP [ARGS]     run STEP
# Chains:
#   issue 8 (docs/benchmarks.md "H200 (issue 8)"): cobatch-peft, sampler-hf-vllm
#   issue 12/15 (docs/benchmarks.md "Through the stack on the H200"): stack-sft, stack-keep-vllm,
#     stack-sample-rl[, stack-sweep]; stack-cold alone (or instead of stack-sft) for the start-up times
#   issue 22 (docs/gpu-conformance.md): conform-A, conform-B, conform-C, conform-D; conform-R alone
# The stack-* and conform-* steps source bench/stack_env.sh (WORK, PY, CALL_LIMIT, and DRY=1: the same flow on
# a CPU machine with the project's .venv and the tiny model, under WORK=/tmp/dry); cobatch-peft and
# sampler-hf-vllm set their own environment (python3, /tmp) as they always did, and have no dry run.
set -u

STEP_TABLE=(  # not STEPS: stack-sweep passes STEPS (RL steps per experiment) through the environment
  "cobatch-peft|.whl/c1 .vllm-h200|bench/gpu_call1.sh|issue 8, call 1 of 2 (fresh machine): unpacks vLLM part A, writes the Qwen3-4B-shaped model + 8 adapters, the transformers + peft baseline (B=1 K=8, B=8 K=4) and bench/cobatch_h200.py in one job; out: cobatch.jsonl, profile_cobatch8.txt, peft_b1.jsonl, peft_b8.jsonl, logs1.tgz"
  "sampler-hf-vllm|.whl/c2 .vllm-h200|bench/gpu_call2.sh|issue 8, call 2 of 2 (after cobatch-peft): completes vLLM, bench/sampler_h200.py with the transformers then the vLLM backend (.vllm-h200/bench.py if vLLM fails); out: sampler_hf.jsonl, sampler_vllm.jsonl, [results_a1.json], logs2.tgz"
  "stack-cold|.gpu .whl/s1|bench/stack_call1.sh|fresh machine: installs the stack's wheels, keeps the first part of vLLM's A.tar.xz, writes the model, openrl serve -> first forward_backward twice (cold, warm), the peft sampling baseline (B=8 K=4); SETUP=0 COLD=0 PEFT=0 COLD_ARGS; out: stack.jsonl, stack.md, peft_b8.jsonl, logs1.tgz"
  "stack-sft|.gpu .whl/s1|bench/stack_callA.sh|fresh machine, the training side in one job: wheels, the first part of vLLM's A.tar.xz, the model, stack_h200.py --sections sft (1/2/4/8 SDK runs), cobatch_h200.py --sections cobatch, peft B=1 K=8; out: stack.jsonl, stack.md, cobatch.jsonl, peft_b1.jsonl, logsA.tgz"
  "stack-keep-vllm|.whl/s2|bench/stack_callB.sh|after stack-sft: completes and unpacks vLLM's A.tar.xz, keeps the first part of vLLM's compiled library for stack-sample-rl (vLLM does not fit one call's 64 MiB)"
  "stack-sample-rl|.whl/s3|bench/stack_call3.sh|after stack-keep-vllm: completes vLLM, stack_h200.py --sections sample,rl,cold (128 SDK samples over 8 snapshots, RL steps, the direct SamplerEngine ratio, the warm restart); CALL3_ARGS; out: stack.jsonl, stack.md, logs3.tgz"
  "stack-sweep|.whl/s4|bench/stack_call4.sh|after stack-sample-rl, or after conform-C (stops its serve, reuses its vLLM compile cache): installs optuna & co. (.whl/s4), bench/autoresearch_sweep.sh through openrl serve (8 experiments one after another vs at once, idle to zero); N STEPS IDLE ROWS; out: ar/sweep.json, ar/*.log, logs4.tgz"
  "conform-A|.gpu .whl/k1|bench/conform_call.sh A|conformance 1/4 (fresh machine): wheels, the model, openrl serve (transformers sampler), test_request_mix, test_reference_peft, test_sampler_trainer_parity; AFILES AK MIX_N SFT_STEPS REF_LR REF_HI_RUNS; out: A/, logsA.tgz"
  "conform-B|.whl/k2|bench/conform_call.sh B|conformance 2/4: unpacks vLLM part A while the same stack runs test_batch_invariance, test_stack_packing; out: B/, logsB.tgz"
  "conform-C|.whl/k3|bench/conform_call.sh C|conformance 3/4: completes vLLM, restarts openrl serve on a new state dir (vLLM sampler, the keyed tests' environment), the parity test and the core files of tests/stack; out: C/, logsC.tgz"
  "conform-D|-|bench/conform_call.sh D|conformance 4/4: the rest of tests/stack (the service's edges, the mix on vLLM) against the same stack, then stops it; MIX_D; out: D/, logsD.tgz"
  "stack-after-conform|-||after conform-C (vLLM complete, the stack's wheels and the model in place): stops conform-C's serve, then stack_h200.py with vLLM sharing conform-C's vLLM compile cache; ARGS (default --sections rl,sample --rl-runs 1,8 --shapes fixed,varied --warmup 1 --breakdown --no-direct); AB_ENV="VAR=value ...": the RL rows with the defaults, then with AB_ENV set, same job (HANDOFF_AB=1: AB_ENV=OPENRL_HANDOFF_DIR=off); out: stack.jsonl, stack.md [default/, ab/], logsS.tgz"
  "stack-fresh|.gpu||fresh machine, no vLLM (one call, when the conformance chain does not fit the device time left): the stack's wheels, the model, then stack_h200.py ARGS (default --sections rl --rl-runs 1,8 --shapes fixed --warmup 1 --rl-steps 3) with the transformers sampler; AB_ENV as stack-after-conform; out: stack.jsonl, stack.md [default/, ab/], logsF.tgz"
  "stack-lora-probe|-||after conform-C (vLLM complete, the model in place; after stack-after-conform, whose stack is then stopped): bench/vllm_lora_load.py, where vLLM's adapter load goes (fp32 vs bf16 file, split into read, cast + pin, merge, activate) and the trainer-side export costs; PROBE_ARGS; out: lora_load.jsonl, logsP.tgz"
  "stack-export-probe|.gpu||fresh machine, no vLLM (one short call): the stack's wheels, the model, bench/vllm_lora_load.py --no-vllm: the trainer's export of an unnamed snapshot split (torch.cat, device-to-host pageable / pinned, tmpfs page faults, MAP_POPULATE, cudaHostRegister); out: lora_load.jsonl"
  "engine-rl-probe|.gpu||fresh machine, no vLLM (one short call): the stack's wheels, then bench/cobatch_h200.py --sections rl: the trainer's share of one RL step (1 and 8 runs x 16 datums x 191 tokens: forward_backward, optim_step_many, snapshot packing, per-row cost, micro-batch caps, torch.profiler splits by the engine's ranges; with OPENRL_TRAINER_GPU_MEMORY set: capped at the stack trainer's share, the memory budget vs the old halving instead of the caps); RL_ARGS; out: cobatch.jsonl, profile_rl_*.txt, logsE.tgz; AB_ENV=\"VAR=value ...\": the probe again with it set, same job (out: ab/)"
  "engine-sleep-probe|.gpu||fresh machine, no vLLM (one short call): the stack's wheels, then bench/residency_probe.py: the trainer's idle sleep on the GPU (Qwen3-4B shapes, 8 rank-32 runs with gradients and AdamW moments: bytes freed, offload and reload seconds, memory before / asleep / awake, every tensor bit for bit after the round trip); SLEEP_ARGS; out: res/residency.jsonl, logsZ.tgz"
  "engine-probes|.gpu||fresh machine, no vLLM (one call, one start): engine-rl-probe (RL_ARGS, AB_ENV) then engine-sleep-probe (SLEEP_ARGS); out: both steps' outputs"
  "determinism|.gpu||fresh machine, or after conform-A/-B on the same one (stops their serve), no vLLM (one call): issue 33's deterministic mode on the GPU: bench/determinism_probe.py (the engine: run a alone vs packed with 1, 3 and 7 other runs, mode on and off; PROBE_S, default 150 s), with PW_S > 0 bench/pass_weights_probe.py (adapter casts once per pass, off vs on, mode on and off, PW_LAYERS layers, PW_S s each; out: pass_weights.jsonl), then conform-R's flow with OPENRL_DETERMINISTIC=1 (openrl serve in the mode, transformers sampler) and DETFILES (default test_deterministic_stack test_e2e_sdk test_batch_invariance); out: determinism.jsonl, R/, logsR.tgz"
  "conform-R|.gpu|bench/conform_call.sh R|one call on a fresh machine, no vLLM: conform-A's set-up, then RFILES (filtered by RK) against a transformers-sampler stack; out: R/, logsR.tgz"
)

step_field() {  # STEP FIELD(1 name, 2 carry, 3 formerly, 4 what): prints it, fails for an unknown step
  local s
  for s in "${STEP_TABLE[@]}"; do
    if [ "${s%%|*}" = "$1" ]; then echo "$s" | cut -d'|' -f"$2"; return 0; fi
  done
  return 1
}
list_steps() {
  local s name carry was what
  for s in "${STEP_TABLE[@]}"; do
    IFS='|' read -r name carry was what <<< "$s"
    printf '%-16s carry: %s\n' "$name" "$(carry_json "$carry")"
    printf '%-16s %s\n' "" "$what"
    [ -n "$was" ] && printf '%-16s (was %s)\n' "" "$was"
  done
  return 0
}
carry_json() {  # "a b" -> ["a", "b"]; "-" -> []
  local out="" p
  [ "$1" = - ] && { echo "[]"; return; }
  for p in $1; do out="$out${out:+, }\"$p\""; done
  echo "[$out]"
}

# ---- issue 8 ---------------------------------------------------------------------------------------------
# cobatch-peft: device call 1 of 2 on one H200, timeout 600 s.
#   - unpacks vLLM part A to /tmp/site in the background (CPU only; see ../shared/vllm-h200/README.md)
#   - writes the random Qwen3-4B-shaped model /tmp/q4b + 8 rank-32 adapters /tmp/lora0..7 (for call 2)
#   - transformers + peft baseline (bench/peft_baseline_h200.py) at 1 x 1024 and 8 x 1024 rows, and our
#     co-batching benchmark (bench/cobatch_h200.py), in the same job, so every ratio is from one run.
# .whl/c1 = A.tar.xz (vLLM site dir minus _C) + the first 24 MiB of C.so.xz (the rest rides in c2): build with
#   bash .vllm-h200/build_payload.sh && bash bench/vllm_payload_split.sh
# Results (<= 8 files): cobatch.jsonl, profile_cobatch8.txt, peft_b1.jsonl, peft_b8.jsonl, logs1.tgz.
step_cobatch_peft() {
  set -u
  export PYTHONUNBUFFERED=1 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 \
         TOKENIZERS_PARALLELISM=false VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1
  T0=$(date +%s); O=${OUT:-/tmp/out1}; L=/tmp/logs1; mkdir -p $O $L
  el() { echo "[$(( $(date +%s)-T0 ))s] $*"; }
  el start; nvidia-smi -L; nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.max.sm,power.limit,temperature.gpu --format=csv
  python3 -c "import torch, transformers, peft, triton; print('torch', torch.__version__, 'transformers', transformers.__version__, 'peft', peft.__version__, 'triton', triton.__version__)"
  nproc; free -g | head -2; df -h /tmp | tail -1
  ( mkdir -p /tmp/parts && cp .whl/c1/* /tmp/parts/ && cd /tmp/parts && sha256sum -c SUMS1 \
    && python3 -c "import tarfile; tarfile.open('/tmp/parts/A.tar.xz','r:xz').extractall('/tmp/site', filter='fully_trusted')" \
    && rm -f /tmp/parts/A.tar.xz && echo UNPACK_A_OK ) > $L/unpack_a.log 2>&1 &
  UP=$!
  timeout 70 python3 .vllm-h200/make_model.py /tmp/q4b /tmp/lora > $L/make_model.log 2>&1; el "make_model rc=$?"; tail -2 $L/make_model.log
  B=1 K=8 SKIP_SAMPLE=1 timeout 80 python3 bench/peft_baseline_h200.py > $O/peft_b1.jsonl 2> $L/peft_b1.err; el "peft b1 rc=$?"; cat $O/peft_b1.jsonl; tail -3 $L/peft_b1.err
  timeout 240 python3 bench/cobatch_h200.py --reps 3 --out $O > $L/cobatch.log 2>&1; el "cobatch rc=$?"
  grep '^{' $L/cobatch.log | grep -v section_done | cut -c1-330; grep -i -E "error|Traceback" $L/cobatch.log | head -5
  B=8 K=4 NEW_TOKENS=32 timeout 90 python3 bench/peft_baseline_h200.py > $O/peft_b8.jsonl 2> $L/peft_b8.err; el "peft b8 rc=$?"; cat $O/peft_b8.jsonl; tail -3 $L/peft_b8.err
  wait $UP; el "unpack A rc=$?"; tail -1 $L/unpack_a.log; du -sh /tmp/site /tmp/q4b /tmp/lora0; ls -la /tmp/parts
  tar czf $O/logs1.tgz -C $L . ; el done
}

# sampler-hf-vllm: device call 2 of 2, on the machine cobatch-peft left warm (/tmp/site, /tmp/q4b,
# /tmp/lora0..7, /tmp/parts/C.so.xz.000 must still be there), timeout 600 s.
#   - completes vLLM (_C_stable_libtorch.abi3.so from C.so.xz.000 + .000b/.001/.002) in the background
#   - sampler benchmarks through our SamplerEngine: transformers backend, then VLLMBackend (PYTHONPATH=/tmp/site)
#   - if VLLMBackend fails before measuring, the reference vLLM LLM benchmark (.vllm-h200/bench.py) instead
# Results: sampler_hf.jsonl, sampler_vllm.jsonl, [results_a1.json], logs2.tgz.
step_sampler_hf_vllm() {
  set -u
  export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false VLLM_NO_USAGE_STATS=1 \
         DO_NOT_TRACK=1 VLLM_USE_FLASHINFER_SAMPLER=0 OPENRL_FUSED_KERNELS=0
  T0=$(date +%s); O=${OUT:-/tmp/out2}; L=/tmp/logs2; mkdir -p $O $L
  el() { echo "[$(( $(date +%s)-T0 ))s] $*"; }
  el start; ls /tmp/parts /tmp/q4b | head -20; du -sh /tmp/site
  ( cp .whl/c2/C.so.xz.* .whl/c2/SUMS2 /tmp/parts/ && cd /tmp/parts \
    && cat C.so.xz.000 C.so.xz.000b C.so.xz.001 C.so.xz.002 > C.so.xz && sha256sum -c SUMS2 \
    && python3 -c "import lzma,shutil; shutil.copyfileobj(lzma.open('/tmp/parts/C.so.xz'), open('/tmp/site/vllm/_C_stable_libtorch.abi3.so','wb'))" \
    && echo UNPACK_C_OK ) > $L/unpack_c.log 2>&1 &
  UP=$!
  timeout 120 python3 bench/sampler_h200.py --backend hf --modes one,mixed8 --reps 1 --new-tokens 64 --out $O > $L/sampler_hf.log 2>&1; el "hf sampler rc=$?"
  grep '^{' $L/sampler_hf.log | cut -c1-300
  wait $UP; el "unpack C rc=$?"; cat $L/unpack_c.log | tail -2
  PYTHONPATH=/tmp/site python3 -c "import vllm, vllm._C_stable_libtorch; print('vllm', vllm.__version__, '_C loaded')" 2>&1 | tail -2
  LIM=$(( 440 - ($(date +%s)-T0) ))
  PYTHONPATH=/tmp/site timeout $LIM python3 bench/sampler_h200.py --backend vllm --try-keep-unembed --out $O > $L/sampler_vllm.log 2>&1; el "vllm sampler rc=$?"
  grep '^{' $L/sampler_vllm.log | cut -c1-300
  if ! grep -q '"what": "decode"' $O/sampler_vllm.jsonl 2>/dev/null; then
    grep -v -E "^\s+(File|\^)" $L/sampler_vllm.log | grep -i -E -B2 -A12 "Traceback|Error" | tail -60
    LIM=$(( 560 - ($(date +%s)-T0) ))
    [ $LIM -gt 150 ] && PYTHONPATH=/tmp/site BATCHES=1,8,128 REPS=2 OUT=$O timeout $LIM python3 .vllm-h200/bench.py a1 '{}' > $L/bench_a1.log 2>&1
    grep -E "^\[a1\]" $L/bench_a1.log 2>/dev/null | tail -20
  fi
  tar czf $O/logs2.tgz -C $L . ; el done
}

# ---- through the stack (issues 12, 15) ---------------------------------------------------------------------
# stack-cold: start-up and peft-sampling call (run alone, or instead of stack-sft when cold start is what you
# need; the training side, same job with the engine and peft, is stack-sft), on a fresh H200 machine:
#   - installs the stack's wheels (.gpu/wheels) into $WORK/stk; keeps the first part of vLLM's A.tar.xz (.whl/s1)
#     in $WORK/parts (stack-keep-vllm completes and unpacks it; the _C library comes in the later calls)
#   - writes the Qwen3-4B-shaped random bf16 model $WORK/q4b with the Qwen tokenizer (.gpu/tok)
#   - bench/stack_h200.py --sections cold --no-cold-sample: openrl serve on a new state dir -> first
#     forward_backward, twice (the second on warm caches); this also checks that the stack runs here
#   - the HF generate + peft sampling baseline (bench/peft_baseline_h200.py B=8 K=4 NEW_TOKENS=32)
# Build the payload first (here): bash bench/stack_payload.sh. Later steps must follow on the same warm
# machine (it is given back 30 s after a call): have them ready.
# Results (<= 8 files): stack.jsonl, stack.md, peft_b8.jsonl, logs1.tgz.
# DRY=1: the same steps on a CPU machine (tiny model, no peft).
# SETUP=0: skip the wheels, the model and vLLM part A (a machine a first call prepared); COLD=0: skip the
# start-up measurement (COLD_ARGS: more stack_h200.py arguments, e.g. --from-zero 15); PEFT=0: skip the
# peft baseline.
step_stack_cold() {
  L=$WORK/logs1; rm -rf "$L"; mkdir -p "$L"
  el start; gpu_info
  [ "${SETUP:-1}" = 1 ] && cp .whl/s1/* "$PARTS"/   # the first part of vLLM's A.tar.xz (stack-keep-vllm unpacks it)
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
  ls -la "$PARTS"
  pack_logs logs1 "$L"; el "call1 done"
}

# stack-sft: on a fresh H200 machine, the training side in one job.
#   installs the stack's wheels, keeps the first part of vLLM's A.tar.xz, writes the Qwen3-4B-shaped model, then
#   bench/stack_h200.py --sections sft (1/2/4/8 SDK runs through openrl serve), bench/cobatch_h200.py
#   --sections cobatch (the engine alone, same shapes), bench/peft_baseline_h200.py B=1 K=8 (peft, one run
#   after another): every ratio is same machine, same job. Follow at once with stack-keep-vllm, stack-sample-rl.
step_stack_sft() {
  L=$WORK/logsA; rm -rf "$L"; mkdir -p "$L"
  el start; gpu_info
  cp .whl/s1/* "$PARTS"/   # the first part of vLLM's A.tar.xz (stack-keep-vllm unpacks it)
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
  pack_logs logsA "$L"; el "callA done"
}

# stack-keep-vllm: right after stack-sft on the same machine: keeps the first part of vLLM's compiled library
# for stack-sample-rl (the whole of vLLM does not fit one call's 64 MiB).
step_stack_keep_vllm() {
  [ -x "$STK/bin/nats-server" ] || { echo "NOT WARM: run step stack-sft first"; exit 3; }
  cp .whl/s2/* "$PARTS"/ && el "part 2 kept: $(ls -la "$PARTS" | tail -n +2 | awk '{print $NF, $5}' | tr '\n' ' ')"
  ( cd "$PARTS" && cat A.tar.xz.000 A.tar.xz.001 > A.tar.xz && sha256sum -c SUMS_A \
    && "$PY" -c "import tarfile; tarfile.open('$PARTS/A.tar.xz','r:xz').extractall('$SITE', filter='fully_trusted')" \
    && rm -f A.tar.xz A.tar.xz.000 A.tar.xz.001 && echo UNPACK_A_OK ) 2>&1 | tail -2
  el "unpack A done"
}

# stack-sample-rl: right after stack-keep-vllm on the same machine:
#   - completes vLLM: C.so.xz = $WORK/parts/C.so.xz.000 (stack-keep-vllm) + .whl/s3/C.so.xz.001, checked
#     against .whl/s3/SUMS, unpacked to $WORK/site/vllm/_C_stable_libtorch.abi3.so
#   - bench/stack_h200.py --sections sample,rl,cold --cold-reuse-main --breakdown with vLLM on PYTHONPATH (the
#     stack's sampler then serves through vLLM, sharing the GPU with the trainer): 128 concurrent SDK samples
#     over 8 snapshots, first sample after `openrl serve` (vLLM cold: a new state dir), RL steps of 1 and 8
#     runs; then, the stack stopped, the same SamplerEngine called directly (vLLM) with the same adapters and
#     jobs, for the stack / direct ratio; then `openrl serve` once more on the same state dir (warm vLLM
#     compile cache) -> first forward_backward -> first sample
# CALL3_ARGS replaces the stack_h200.py arguments (e.g. --sections rl,cold --rl-runs 1,8 --warmup 1
# --cold-reuse-main --from-zero 15 --no-direct).
# Results: stack.jsonl, stack.md, logs3.tgz.
step_stack_sample_rl() {
  if [ "$DRY" != 1 ] && [ ! -x "$STK/bin/nats-server" ]; then
    echo "NOT WARM: $STK is missing (a fresh machine, not the one step stack-sft prepared): run steps stack-sft, stack-keep-vllm first"; exit 3
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
}

# stack-sweep: right after stack-sample-rl on the same machine (vLLM is complete there): the autoresearch
# sweep through the stack on the H200 (issue 15 item 6).
#   - installs .whl/s4 (optuna, SQLAlchemy, alembic, matplotlib and their wheels: the recipe's own
#     dependencies, which the GPU image lacks) into $WORK/stk4
#   - bench/autoresearch_sweep.sh: `openrl serve --model Qwen/Qwen3-4B-Instruct-2507=$WORK/q4b
#     --idle-timeout $IDLE` on $SB/main (the state dir stack-sample-rl left, so vLLM's compile cache is warm),
#     8 experiments one after another vs all at once, per row of ROWS, then the idle time to zero workers.
#     IDLE defaults to 120 s here: at 30 s the gap between two rows (the driver's table, plot and next start)
#     let the sampler scale to zero, and its 70 s vLLM start landed in the next timed row (H100, fifteenth
#     session); sweep.json's worker_started_in names any row that still has a worker start in it
# Build .whl/s4 here first: bash bench/stack_payload.sh (SKIP_VLLM=1 SKIP_GPU=1 for .whl/s4 alone).
# DRY=1: the same on a CPU machine.
# Results: ar/sweep.json, ar/*.log, logs4.tgz.
step_stack_sweep() {
  L=$WORK/logs4; rm -rf "$L"; mkdir -p "$L"
  el start; nvidia-smi --query-gpu=name,memory.used --format=csv 2>/dev/null
  if [ "$DRY" != 1 ]; then
    [ -x "$STK/bin/nats-server" ] || { echo "NOT WARM: run steps stack-sft (or stack-cold), stack-keep-vllm, stack-sample-rl (or conform-A, -B, -C) first"; exit 3; }
    # after the conformance chain: its serve stopped (the GPU to the sweep's stack), its vLLM compile cache reused
    "$PY" bench/serve_bg.py stop --state-dir "$WORK/conf-vllm" --grace-s 20 2>&1 | tail -2
    [ -d "$WORK/conf-vllm/cache/vllm" ] && export VLLM_CACHE_ROOT=$WORK/conf-vllm/cache/vllm
    "$PY" -m pip install -q --no-index --no-deps --no-compile --target "$WORK/stk4" .whl/s4/*.whl > "$L/pip_s4.log" 2>&1
    el "s4 wheels rc=$?"; tail -2 "$L/pip_s4.log"
    stack_path vllm; export PYTHONPATH=$STK:$WORK/stk4:$SITE:$PWD
    SERVE_ARGS="--model Qwen/Qwen3-4B-Instruct-2507=$MODEL"; MODEL_NAME=Qwen/Qwen3-4B-Instruct-2507
  else
    stack_path; SERVE_ARGS="--device cpu"; MODEL_NAME=
  fi
  "$PY" -c "import optuna, sqlalchemy, matplotlib; print('optuna', optuna.__version__)" 2>&1 | tail -1
  mkdir -p "$SB/main"
  # 6 steps an experiment: with 3 (the fifteenth session) the driver's own 13 s and the creates were most of
  # either run; --idle-timeout 60: idle now means no message delivered (c100c26), and a row's gap is < 30 s
  N=${N:-8} STEPS=${STEPS:-6} IDLE=${IDLE:-60} OUT=$O/ar STATE=$SB/main PY=$PY SERVE_ARGS=$SERVE_ARGS MODEL=$MODEL_NAME \
    ROWS=${ROWS:-"; --prompts 8 --max-tokens 64"} DEADLINE=$(( ${CALL_LIMIT:-575} - 200 )) \
    timeout -k 20 $(( $(left) - 25 )) bash bench/autoresearch_sweep.sh 2>&1 | tee "$L/sweep.log"
  el "sweep rc=${PIPESTATUS[0]}"
  grep -h "start-up phase\|Traceback\|Error" "$SB"/main/logs/*.log 2>/dev/null | tail -30
  cp "$O"/ar/*.log "$L"/ 2>/dev/null
  pack_logs logs4 "$L"; el "call4 done"
}

# stack-after-conform: right after conform-C (or conform-D) on the same machine: the through-the-stack benchmark
# without a chain of its own (the conformance chain already brought vLLM, the stack's wheels and the model).
#   - stops conform-C's `openrl serve` ($WORK/conf-vllm), so the benchmark's stack has the GPU to itself
#   - bench/stack_h200.py ARGS with vLLM on PYTHONPATH and VLLM_CACHE_ROOT=$WORK/conf-vllm/cache/vllm (its compile
#     cache: the benchmark's vLLM starts warm)
# Results: stack.jsonl, stack.md, logsS.tgz.
step_stack_after_conform() {
  [ "$DRY" = 1 ] || [ -x "$STK/bin/nats-server" ] || { echo "NOT WARM: run conform-A, -B, -C first"; exit 3; }
  L=$WORK/logsS; rm -rf "$L"; mkdir -p "$L"
  el start
  stack_path vllm; [ "$DRY" = 1 ] && stack_path
  "$PY" bench/serve_bg.py stop --state-dir "$WORK/conf-vllm" --grace-s 20 2>&1 | tail -2
  [ -d "$WORK/conf-vllm/cache/vllm" ] && export VLLM_CACHE_ROOT=$WORK/conf-vllm/cache/vllm
  nvidia-smi --query-gpu=name,memory.used --format=csv 2>/dev/null
  stack_rows "--sections rl,sample --rl-runs 1,8 --shapes fixed,varied --warmup 1 --breakdown --no-direct"
  pack_logs logsS "$L"; el "done"
}

# stack-fresh: one call on a fresh machine (or after conform-A, whose serve it stops), no vLLM (when the conformance
# chain will not fit the session's device time): the stack's wheels and the model as conform-A makes them, then stack_h200.py ARGS with the transformers
# sampler (the default where vLLM is not installed); AB_ENV as in stack-after-conform.
# Results: stack.jsonl, stack.md [default/, ab/], logsF.tgz.
step_stack_fresh() {
  L=$WORK/logsF; rm -rf "$L"; mkdir -p "$L"
  el start; gpu_info
  if [ "$DRY" != 1 ]; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --target "$STK" .gpu/wheels/*.whl > "$L/pip.log" 2>&1
    el "stack wheels rc=$?"
    [ -f "$MODEL/config.json" ] || { timeout 150 "$PY" bench/stack_h200.py --make-model "$MODEL" --tokenizer-from .gpu/tok \
      > "$L/make_model.log" 2>&1; el "make_model rc=$?"; tail -1 "$L/make_model.log"; }
  fi
  stack_path
  [ -f "$WORK/conf-hf/serve.pid" ] && "$PY" bench/serve_bg.py stop --state-dir "$WORK/conf-hf" --grace-s 20 | tail -1  # after conform-A
  stack_rows "--sections rl --rl-runs 1,8 --shapes fixed --warmup 1 --rl-steps 3"
  pack_logs logsF "$L"; el "done"
}

# the rows of stack-after-conform / stack-fresh: stack_h200.py ARGS (default $1), or with AB_ENV (HANDOFF_AB=1:
# AB_ENV=OPENRL_HANDOFF_DIR=off) the RL rows with the defaults ("default/"), then with AB_ENV set ("ab/"), same job
stack_rows() {  # default ARGS
  local ab=${AB_ENV:-}; [ "${HANDOFF_AB:-0}" = 1 ] && ab=${ab:-OPENRL_HANDOFF_DIR=off}
  if [ -n "$ab" ]; then  # the same rows with the defaults ("default"), then with AB_ENV's VAR=value ("ab"), same job
    local o0=$O half=$(( ($(left) - 20) / 2 ))
    echo "A/B: default vs $ab"
    for mode in default ab; do
      O=$o0/$mode; mkdir -p "$O"
      # shellcheck disable=SC2086
      ( [ $mode = ab ] && export $ab; stack_bench $half \
        ${ARGS:---sections rl --rl-runs 1,8 --shapes fixed --warmup 1 --rl-steps 5} ) > "$L/stack-$mode.log" 2>&1
      el "stack bench $mode rc=$?"; grep '^{' "$L/stack-$mode.log" | grep -E '"what": "(rl|cold|sample)"' | cut -c1-700
    done
    O=$o0
  else
    # shellcheck disable=SC2086
    stack_bench $(( $(left) - 10 )) ${ARGS:-$1} > "$L/stack.log" 2>&1; el "stack bench rc=$?"
    grep '^{' "$L/stack.log" | grep -v '"what": "env"' | cut -c1-700
  fi
  grep -h -v -E "^\s+(File|\^)" "$L"/stack*.log | grep -i -E -B2 -A8 "Traceback|Error" | head -30
}

# stack-lora-probe: after conform-C (or stack-after-conform) on the same machine: bench/vllm_lora_load.py with
# vLLM in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0), the model of conform-A; a serve still running there is
# left alone (PROBE_ARGS default --gpu-memory 0.3 fits beside conform-C's stack).
# Results: lora_load.jsonl, logsP.tgz.
step_stack_lora_probe() {
  [ "$DRY" = 1 ] || [ -x "$STK/bin/nats-server" ] || { echo "NOT WARM: run conform-A, -B, -C first"; exit 3; }
  L=$WORK/logsP; rm -rf "$L"; mkdir -p "$L"
  el start
  stack_path vllm; [ "$DRY" = 1 ] && stack_path
  nvidia-smi --query-gpu=name,memory.used --format=csv 2>/dev/null
  local extra=(); [ "$DRY" = 1 ] && { extra=(--no-vllm); MODEL_ARGS=(--model-dir "${OPENRL_HOME:-$HOME/.openrl}/models/tiny-qwen3"); }
  # shellcheck disable=SC2086
  timeout -k 15 $(( $(left) - 20 )) "$PY" bench/vllm_lora_load.py "${MODEL_ARGS[@]}" --out "$O" ${PROBE_ARGS:---gpu-memory 0.3} \
    "${extra[@]}" > "$L/probe.log" 2>&1; el "probe rc=$?"
  grep '^{' "$L/probe.log" | cut -c1-700
  grep -v -E "^\s+(File|\^)" "$L/probe.log" | grep -i -E -B2 -A8 "Traceback|Error" | head -30
  pack_logs logsP "$L"; el "done"
}

# stack-export-probe: a fresh machine, carry [".gpu"]: the stack's wheels and the model as conform-A makes them,
# then the trainer side of bench/vllm_lora_load.py (no vLLM): where the save part of an RL step goes.
step_stack_export_probe() {
  L=$WORK/logsE; rm -rf "$L"; mkdir -p "$L"
  el start
  if [ "$DRY" != 1 ]; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --target "$STK" .gpu/wheels/*.whl > "$L/pip.log" 2>&1
    el "stack wheels rc=$?"
    stack_path
    [ -f "$MODEL/config.json" ] || { timeout 150 "$PY" bench/stack_h200.py --make-model "$MODEL" --tokenizer-from .gpu/tok \
      > "$L/make_model.log" 2>&1; el "make_model rc=$?"; }
  else
    stack_path; MODEL_ARGS=(--model-dir "${OPENRL_HOME:-$HOME/.openrl}/models/tiny-qwen3")
  fi
  # shellcheck disable=SC2086
  timeout -k 15 $(( $(left) - 20 )) "$PY" bench/vllm_lora_load.py "${MODEL_ARGS[@]}" --out "$O" --no-vllm ${PROBE_ARGS:---reps 3} \
    > "$L/probe.log" 2>&1; el "probe rc=$?"
  grep '^{' "$L/probe.log" | cut -c1-700
  grep -v -E "^\s+(File|\^)" "$L/probe.log" | grep -i -E -B2 -A8 "Traceback|Error" | head -30
  el "done"
}

# engine-rl-probe: where the trainer's busy seconds of an RL step go, on the engine alone (no vLLM, no stack;
# the stack's own numbers come from stack-after-conform). Fresh machine, one call.
engine_setup() {  # LOGDIR: a fresh log dir in $L, the stack's wheels (not in a dry run), PYTHONPATH, $tiny
  L=$1; rm -rf "$L"; mkdir -p "$L"
  el start; gpu_info
  if [ "$DRY" != 1 ]; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --target "$STK" .gpu/wheels/*.whl > "$L/pip.log" 2>&1
    el "stack wheels rc=$?"
  fi
  stack_path
  tiny=""; [ "$DRY" = 1 ] && tiny=--tiny
}
step_engine_rl_probe() {
  local tiny; engine_setup "$WORK/logsE"
  local budget=$(( $(left) - 20 )); [ -n "${AB_ENV:-}" ] && budget=$(( ($(left) - 40) / 2 ))  # an A/B: half each
  # shellcheck disable=SC2086
  timeout -k 15 $budget "$PY" bench/cobatch_h200.py $tiny --sections rl --out "$O" ${RL_ARGS:---reps 3} \
    > "$L/rl.log" 2>&1; el "rl probe rc=$?"
  grep '^{' "$L/rl.log" | cut -c1-1500
  if [ -n "${AB_ENV:-}" ]; then  # AB_ENV="VAR=value ...": the same probe again with it set, same job (out: ab/)
    mkdir -p "$O/ab"
    # shellcheck disable=SC2086
    env $AB_ENV timeout -k 15 $(( $(left) - 20 )) "$PY" bench/cobatch_h200.py $tiny --sections rl --out "$O/ab" \
      ${RL_ARGS:---reps 3} > "$L/rl_ab.log" 2>&1; el "rl probe ($AB_ENV) rc=$?"
    grep '^{' "$L/rl_ab.log" | cut -c1-1500
  fi
  grep -v -E "^\s+(File|\^)" "$L/rl.log" | grep -i -E -B2 -A8 "Traceback|Error" | head -30
  pack_logs logsE "$L"; el "done"
}

# engine-sleep-probe: what the trainer's idle sleep frees and what its wake costs on the GPU (issue 32 item 1;
# the stack-level idle -> first forward_backward comes from the stack rows). Fresh machine, one call.
step_engine_sleep_probe() {
  local tiny; engine_setup "$WORK/logsZ"
  # shellcheck disable=SC2086
  timeout -k 15 $(( $(left) - 20 )) "$PY" bench/residency_probe.py $tiny --out "$O/res" ${SLEEP_ARGS:-} \
    > "$L/sleep.log" 2>&1; el "sleep probe rc=$?"
  grep '^{' "$L/sleep.log" | cut -c1-1500
  grep -v -E "^\s+(File|\^)" "$L/sleep.log" | grep -i -E -B2 -A8 "Traceback|Error" | head -30
  pack_logs logsZ "$L"; el "done"
}

# engine-probes: engine-rl-probe (AB_ENV honoured) then engine-sleep-probe on one fresh machine (one start).
step_engine_probes() {
  step_engine_rl_probe
  step_engine_sleep_probe
}

# ---- the GPU conformance chain (issue 22, docs/gpu-conformance.md) -----------------------------------------
# Four device calls in a row on ONE warm H200 machine (it is given back 30 s after a call: start each call as
# soon as the last returns). Payload: bench/stack_payload.sh, then bench/conform_payload.sh (here).
#   conform-A  carry [".gpu", ".whl/k1"]  installs the stack's wheels, writes the Qwen3-4B-shaped random bf16
#        model, starts `openrl serve --model NAME=DIR` as README.md says (vLLM is not complete yet, so the
#        sampler is the transformers backend) in its own session, and runs the trainer-side GPU tests against
#        it: test_request_mix (500 requests, lengths 1-2048, 1-16 datums, ranks 4-64, ...),
#        test_reference_peft (50 steps vs plain peft + AdamW, alone and packed with 7),
#        test_sampler_trainer_parity (30 steps); AFILES / AK (test files, a pytest -k expression) choose others.
#   conform-B  carry [".whl/k2"]  keeps vLLM part A and the middle of its _C library; unpacks A while the
#        transformers stack runs test_batch_invariance and test_stack_packing.
#   conform-C  carry [".whl/k3"]  completes vLLM, stops the transformers stack, starts `openrl serve` again on a
#        new state dir (now the vLLM sampler: the default on a GPU with vLLM installed) with the keyed tests'
#        environment, warms it through the SDK, runs the parity test and the core files of tests/stack.
#   conform-D  carry nothing  the rest of tests/stack against the same vLLM stack (the service's edges, the mix
#        on the vLLM sampler), then stops it.
#   conform-R  carry [".gpu"]  one call on a fresh machine, no vLLM: A's set-up, then RFILES (test files)
#        filtered by RK (a pytest -k expression) against a transformers-sampler stack: a re-check of
#        trainer-side changes.
# Every call writes its conformance report (gpu-conformance.md, results/measures jsonl, junit) to $OUT/<call>/,
# and the stack's logs to $OUT/logs<call>.tgz. Budgets: CALL_LIMIT (seconds this call may take, default 575).
# DRY=1 bash bench/device_call.sh conform-A (then B, C, D): the same flow here on the CPU (the .venv, the tiny
# model, fp32, small test sizes), under WORK=/tmp/dry.
step_conform() {  # X: A|B|C|D|R (after stack_env.sh is sourced)
  X=$1
  NAME="Qwen/Qwen3-4B-Instruct-2507"
  S_HF=$WORK/conf-hf; S_VL=$WORK/conf-vllm
  # the code's commit: COMMIT=$(git rev-parse HEAD) in the call's command (the payload's .gpu/COMMIT names the
  # commit the payload was built at, which is older when code changed after it)
  COMMIT=${COMMIT:-$(git rev-parse HEAD 2>/dev/null || cat .gpu/COMMIT 2>/dev/null | tr '\n' ' ' || echo unknown)}
  L=$WORK/logs$X; rm -rf "$L"; mkdir -p "$L"
  el "call $X start"
  if [ "$DRY" = 1 ]; then
    MODEL_FLAG=(); SERVE_EXTRA=(--device cpu)
    export OPENRL_TEST_MIX_REQUESTS=${MIX_N:-40} OPENRL_TEST_MIX_MAX_LEN=64 OPENRL_TEST_REFERENCE_STEPS=6 \
           OPENRL_TEST_REFERENCE_PACKED=2 OPENRL_TEST_PARITY_STEPS=3
  else
    MODEL_FLAG=(--model "$NAME=$MODEL"); SERVE_EXTRA=()
    export OPENRL_TEST_MIX_REQUESTS=${MIX_N:-500} OPENRL_TEST_MIX_MAX_LEN=2048 OPENRL_TEST_REFERENCE_STEPS=50 \
           OPENRL_TEST_REFERENCE_PACKED=7 OPENRL_TEST_REFERENCE_SFT_STEPS=${SFT_STEPS:-200} OPENRL_TEST_PARITY_STEPS=30 \
           OPENRL_TEST_REFERENCE_LR=${REF_LR:-1e-4} OPENRL_TEST_REFERENCE_HI_RUNS=${REF_HI_RUNS:-2}
    nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader 2>/dev/null
  fi

  serve() {  # STATE [extra openrl serve args...]: start in its own session (survives this call), warm, print timings
    local st=$1; shift
    "$PY" bench/serve_bg.py start --state-dir "$st" "${MODEL_FLAG[@]}" --wait-s 300 -- --idle-timeout 0 \
      "${SERVE_EXTRA[@]}" "$@" 2>&1 | tail -5
    local w=$(( $(left) - 150 )); [ $w -lt 60 ] && w=60   # leave the call time for its tests and report
    timeout $w "$PY" bench/serve_bg.py warm --state-dir "$st" --base-model "$NAME" --wait-s $w 2>&1 | tail -3
    el "serve $st warm"
  }
  conform() {  # STATE OUTNAME BUDGET_S FILES... [-- pytest args]: the runner against a running serve
    local st=$1 name=$2 budget=$3; shift 3
    "$PY" bench/gpu_conformance.py --state-dir "$st" --out "$O/$name" --commit "$COMMIT" --budget-s "$budget" \
      --test-timeout "${TEST_TIMEOUT:-420}" --files "$@" > "$L/conformance-$name.log" 2>&1
    el "conformance $name rc=$?"; grep -E "passed|failed|error" "$L/conformance-$name.log" | tail -3
  }
  finish() { cp -r "$1/logs" "$L/stack-logs" 2>/dev/null; cp "$1/serve.log" "$L/" 2>/dev/null; pack_logs "logs$X" "$L"; el "call $X done"; }

  case $X in
  A|R)
    if [ "$DRY" != 1 ]; then
      [ "$X" = A ] && cp .whl/k1/* "$PARTS"/
      "$PY" -m pip install -q --no-index --no-deps --no-compile --target "$STK" .gpu/wheels/*.whl > "$L/pip.log" 2>&1
      el "stack wheels rc=$? ($(ls .gpu/wheels | wc -l) wheels)"
    fi
    stack_path
    "$PY" -c "import tinker, liger_kernel, openrl.cli; print('imports ok, tinker', tinker.__version__)" 2>&1 | tail -1
    if [ "$DRY" != 1 ] && { [ "$X" = A ] || [ ! -f "$MODEL/config.json" ]; }; then  # R on a warm machine keeps A's
      timeout 150 "$PY" bench/stack_h200.py --make-model "$MODEL" --tokenizer-from .gpu/tok > "$L/make_model.log" 2>&1
      el "make_model rc=$?"; tail -1 "$L/make_model.log"
    fi
    rm -rf "$S_HF"; serve "$S_HF"
    if [ "$X" = A ]; then
      # shellcheck disable=SC2086
      conform "$S_HF" A $(( $(left) - 30 )) ${AFILES:-test_request_mix test_reference_peft test_sampler_trainer_parity} \
        -- ${AK:+-k "$AK"}
    else
      # shellcheck disable=SC2086
      conform "$S_HF" R $(( $(left) - 30 )) ${RFILES:?RFILES: test files} -- ${RK:+-k "$RK"}
      "$PY" bench/serve_bg.py stop --state-dir "$S_HF" --grace-s 20
    fi
    finish "$S_HF"
    ;;
  B)
    [ "$DRY" = 1 ] || cp .whl/k2/* "$PARTS"/
    stack_path
    if [ "$DRY" != 1 ]; then  # unpack vLLM part A beside the tests (CPU only)
      ( "$PY" -c "import tarfile; tarfile.open('$PARTS/A.tar.xz','r:xz').extractall('$SITE', filter='fully_trusted')" \
        && rm -f "$PARTS/A.tar.xz" && echo UNPACK_A_OK ) > "$L/unpack_a.log" 2>&1 &
      UP=$!
    fi
    BF=${BFILES-test_batch_invariance test_stack_packing}   # BFILES="": only the unpacking (a quick chain)
    # shellcheck disable=SC2086
    [ -n "$BF" ] && conform "$S_HF" B $(( $(left) - 40 )) $BF
    [ "$DRY" = 1 ] || { wait $UP; el "unpack A rc=$?"; tail -1 "$L/unpack_a.log"; }
    finish "$S_HF"
    ;;
  C)
    if [ "$DRY" != 1 ]; then
      ( cp .whl/k3/* "$PARTS"/ && cd "$PARTS" && cat C.so.xz.000 C.so.xz.001 C.so.xz.002 > C.so.xz \
        && grep C.so.xz SUMS | sha256sum -c - \
        && "$PY" -c "import lzma,shutil; shutil.copyfileobj(lzma.open('$PARTS/C.so.xz'), open('$SITE/vllm/_C_stable_libtorch.abi3.so','wb'))" \
        && rm -f C.so.xz && echo UNPACK_C_OK ) > "$L/unpack_c.log" 2>&1
      el "unpack C rc=$?"; tail -1 "$L/unpack_c.log"
      stack_path vllm
      "$PY" -c "import vllm, vllm._C_stable_libtorch; print('vllm', vllm.__version__)" 2>&1 | tail -1
    else
      stack_path
    fi
    "$PY" bench/serve_bg.py stop --state-dir "$S_HF" --grace-s 20
    rm -rf "$S_VL"; mkdir -p "$S_VL"
    eval "$("$PY" bench/gpu_conformance.py --state-dir "$S_VL" --print-env)"   # the keyed tests' keys and limits
    serve "$S_VL"
    # shellcheck disable=SC2086
    conform "$S_VL" C $(( $(left) - 30 )) ${CFILES:-test_sampler_trainer_parity test_e2e_sdk test_compat_sdk \
      test_two_d_targets_sdk test_sample_train_mismatch test_batch_invariance test_stack_packing \
      test_max_tokens_and_peft test_surface test_snapshot_handoff_sdk}
    finish "$S_VL"
    ;;
  D)
    stack_path vllm; [ "$DRY" = 1 ] && stack_path
    MIX_REQ=${MIX_D:-200}; export OPENRL_TEST_MIX_REQUESTS=$([ "$DRY" = 1 ] && echo 20 || echo "$MIX_REQ")
    conform "$S_VL" D $(( $(left) - 45 )) test_auth test_cli_status test_errors test_fair_share test_fuzz_routes test_load \
      test_metrics test_signed_urls test_tracing test_hosted_compat test_openai test_usage test_adapter_import \
      test_request_mix test_compat_sdk_matrix test_weights_download test_stable_reinforce
    "$PY" bench/serve_bg.py stop --state-dir "$S_VL" --grace-s 20
    finish "$S_VL"
    ;;
  *) echo "unknown call $X"; exit 2 ;;
  esac
}

# determinism: issue 33's deterministic mode on one GPU, one call on a fresh machine: the engine probe, then the
# SDK-level tests against openrl serve started with OPENRL_DETERMINISTIC=1 (test_deterministic_stack runs
# against an external stack only when its trainer reports the mode).
step_determinism() {
  local tiny; engine_setup "$WORK/logsM"
  # after conform-A / -B on the same machine: their serve holds the GPU and conf-hf (R restarts it in the mode)
  [ -f "$WORK/conf-hf/serve.pid" ] && "$PY" bench/serve_bg.py stop --state-dir "$WORK/conf-hf" --grace-s 20 | tail -1
  timeout -k 15 "${PROBE_S:-150}" "$PY" bench/determinism_probe.py --out "$O/determinism.jsonl" ${PROBE_ARGS:-} \
    > "$L/probe.log" 2>&1; el "determinism probe rc=$?"
  grep '^{' "$L/probe.log" | cut -c1-600
  grep -v -E "^\s+(File|\^)" "$L/probe.log" | grep -i -E -B2 -A8 "Traceback" | head -20
  if [ "${PW_S:-0}" -gt 0 ]; then  # the adapter casts made once per pass (OPENRL_LORA_PASS_CACHE), off vs on, both modes
    local dev=cuda; [ "$DRY" = 1 ] && dev=cpu
    for det in --deterministic ""; do
      # shellcheck disable=SC2086
      timeout -k 15 "$PW_S" "$PY" bench/pass_weights_probe.py --device $dev --layers "${PW_LAYERS:-8}" $det --reps 3 \
        --out "$O/pass_weights.jsonl" >> "$L/pass_weights.log" 2>&1; el "pass-weights probe ${det:-default} rc=$?"
    done
    grep '^{' "$L/pass_weights.log" | cut -c1-600
  fi
  pack_logs logsM "$L"
  export OPENRL_DETERMINISTIC=1
  RFILES=${DETFILES:-test_deterministic_stack test_e2e_sdk test_batch_invariance} step_conform R
}

# ---- dispatch --------------------------------------------------------------------------------------------
case ${1:---list} in
  --list|-l|-h|--help) list_steps; exit 0 ;;
  --carry)
    c=$(step_field "${2:?usage: device_call.sh --carry STEP}" 2) || { echo "unknown step ${2}" >&2; exit 2; }
    carry_json "$c"; exit 0 ;;
esac
STEP=$1; shift
step_field "$STEP" 1 > /dev/null || { echo "unknown step $STEP (bash bench/device_call.sh --list)" >&2; exit 2; }
cd "$(dirname "$0")/.."
case $STEP in
  cobatch-peft) step_cobatch_peft "$@" ;;
  sampler-hf-vllm) step_sampler_hf_vllm "$@" ;;
  stack-*|engine-*) source bench/stack_env.sh; "step_${STEP//-/_}" "$@" ;;
  conform-*) source bench/stack_env.sh; step_conform "${STEP#conform-}" ;;
  determinism) source bench/stack_env.sh; step_determinism ;;
esac
