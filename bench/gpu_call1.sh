#!/usr/bin/env bash
# Device call 1 of 2 on one H200 (device tool `run`, carry [".whl/c1", ".vllm-h200"]), timeout 600 s.
#   - unpacks vLLM part A to /tmp/site in the background (CPU only; see ../shared/vllm-h200/README.md)
#   - writes the random Qwen3-4B-shaped model /tmp/q4b + 8 rank-32 adapters /tmp/lora0..7 (for call 2)
#   - transformers + peft baseline (bench/peft_baseline_h200.py) at 1 x 1024 and 8 x 1024 rows, and our
#     co-batching benchmark (bench/cobatch_h200.py), in the same job, so every ratio is from one run.
# .whl/c1 = A.tar.xz (vLLM site dir minus _C) + the first 24 MiB of C.so.xz (the rest rides in c2): build with
#   bash .vllm-h200/build_payload.sh && bash bench/vllm_payload_split.sh
# Results (<= 8 files): cobatch.jsonl, profile_cobatch8.txt, peft_b1.jsonl, peft_b8.jsonl, logs1.tgz.
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
