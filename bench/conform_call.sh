#!/usr/bin/env bash
# The GPU conformance chain (issue 22): four device calls in a row on ONE warm H200 machine (it is given
# back 30 s after a call: start each call as soon as the last returns). Payload: bench/stack_payload.sh,
# then bench/conform_payload.sh (here). Each call: `bash bench/conform_call.sh X` with
#   A  carry [".gpu", ".whl/k1"]  installs the stack's wheels, writes the Qwen3-4B-shaped random bf16 model,
#        starts `openrl serve --model NAME=DIR` as README.md says (vLLM is not complete yet, so the sampler is the
#        transformers backend) in its own session, and runs the trainer-side GPU tests against it:
#        test_request_mix (500 requests, lengths 1-2048, 1-16 datums, ranks 4-64, ...), test_reference_peft
#        (50 steps vs plain peft + AdamW, alone and packed with 7), test_sampler_trainer_parity (30 steps);
#        AFILES / AK (test files, a pytest -k expression) choose others.
#   B  carry [".whl/k2"]  keeps vLLM part A and the middle of its _C library; unpacks A while the transformers
#        stack runs test_batch_invariance and test_stack_packing.
#   C  carry [".whl/k3"]  completes vLLM, stops the transformers stack, starts `openrl serve` again on a new
#        state dir (now the vLLM sampler: the default on a GPU with vLLM installed) with the keyed tests'
#        environment, warms it through the SDK, runs the parity test and the core files of tests/stack.
#   D  carry nothing  the rest of tests/stack against the same vLLM stack (the service's edges, the mix on
#        the vLLM sampler), then stops it.
#   R  carry [".gpu"]  one call on a fresh machine, no vLLM: A's set-up, then RFILES (test files) filtered by
#        RK (a pytest -k expression) against a transformers-sampler stack: a re-check of trainer-side changes.
# Every call writes its conformance report (gpu-conformance.md, results/measures jsonl, junit) to $OUT/<call>/,
# and the stack's logs to $OUT/logs<call>.tgz. Budgets: CALL_LIMIT (seconds this call may take, default 560).
# DRY=1 bash bench/conform_call.sh A|B|C|D: the same flow here on the CPU (the .venv, the tiny model, fp32,
# small test sizes), under WORK=/tmp/dry.
set -u
X=${1:?usage: conform_call.sh A|B|C|D}
cd "$(dirname "$0")/.." && source bench/stack_env.sh
NAME="Qwen/Qwen3-4B-Instruct-2507"
S_HF=$WORK/conf-hf; S_VL=$WORK/conf-vllm
COMMIT=$(cat .gpu/COMMIT 2>/dev/null | tr '\n' ' ' || echo unknown)
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
         OPENRL_TEST_REFERENCE_LR=${REF_LR:-1e-4}
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
  if [ "$DRY" != 1 ]; then
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
  conform "$S_HF" B $(( $(left) - 40 )) test_batch_invariance test_stack_packing
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
  conform "$S_VL" C $(( $(left) - 30 )) test_sampler_trainer_parity test_e2e_sdk test_compat_sdk test_two_d_targets_sdk \
    test_sample_train_mismatch test_batch_invariance test_stack_packing test_max_tokens_and_peft test_surface
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
