#!/usr/bin/env bash
# Device call 2 of 2 (carry [".whl/c2", ".vllm-h200"]), on the machine call 1 left warm (/tmp/site, /tmp/q4b,
# /tmp/lora0..7, /tmp/parts/C.so.xz.000 must still be there), timeout 600 s.
#   - completes vLLM (_C_stable_libtorch.abi3.so from C.so.xz.000 + .000b/.001/.002) in the background
#   - sampler benchmarks through our SamplerEngine: transformers backend, then VLLMBackend (PYTHONPATH=/tmp/site)
#   - if VLLMBackend fails before measuring, the reference vLLM LLM benchmark (.vllm-h200/bench.py) instead
# Results: sampler_hf.jsonl, sampler_vllm.jsonl, [results_a1.json], logs2.tgz.
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
