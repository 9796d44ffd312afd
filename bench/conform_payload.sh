#!/usr/bin/env bash
# Build HERE what the GPU conformance chain (bench/device_call.sh conform-A, -B, -C, -D) carries to the offline H200
# machine, from what bench/stack_payload.sh made (.gpu: the stack's wheels + tokenizer; $STAGE/A.tar.xz and
# $STAGE/C.so.xz: vLLM 0.24.0 in two archives). Each device call carries at most 64 MiB with the checkout,
# and the first call must also bring the stack's wheels (it starts a stack with the transformers sampler
# while vLLM is still on its way), so vLLM travels as:
#
#   call A  .gpu (~29 MiB)   + .whl/k1/C.so.xz.000 (the first CA_MIB, default 26 MiB, of C.so.xz)
#   call B  .whl/k2/A.tar.xz (~33 MiB) + C.so.xz.001 (the next CB_MIB, default 22 MiB)
#   call C  .whl/k3/C.so.xz.002 (the rest, ~34 MiB) + SUMS (sha256 of A.tar.xz and of the whole C.so.xz)
#   call D  nothing
#
# Usage (project root):  bash bench/stack_payload.sh && bash bench/conform_payload.sh
# STAGE and VLLM_VERSION as in stack_payload.sh. Also writes .gpu/COMMIT (git HEAD, the commit the
# conformance table names; the GPU machine has no .git). Prints each call's size with the checkout.
set -euo pipefail
REPO=$(git rev-parse --show-toplevel); cd "$REPO"
VLLM_VERSION=${VLLM_VERSION:-0.24.0}  # as bench/stack_payload.sh (built there first with the same VLLM_VERSION)
if [ "$VLLM_VERSION" = 0.24.0 ]; then ST=${STAGE:-/tmp/stack-stage}; else ST=${STAGE:-/tmp/stack-stage-$VLLM_VERSION}; fi
[ -s "$ST/A.tar.xz" ] && [ -s "$ST/C.so.xz" ] && [ -d .gpu/wheels ] || { echo "run bench/stack_payload.sh first"; exit 1; }
git rev-parse HEAD > .gpu/COMMIT
if ! git diff --quiet HEAD -- . ':!.gpu' ':!.whl'; then echo "+uncommitted changes" >> .gpu/COMMIT; fi
rm -rf .whl/k1 .whl/k2 .whl/k3 && mkdir -p .whl/k1 .whl/k2 .whl/k3
cp "$ST/A.tar.xz" .whl/k2/
python3 - "$ST/C.so.xz" "${CA_MIB:-26}" "${CB_MIB:-22}" <<'PY'
import sys
src, a, b = sys.argv[1], float(sys.argv[2]), float(sys.argv[3])
data = open(src, "rb").read()
ca, cb = int(a * 2**20), int((a + b) * 2**20)
open(".whl/k1/C.so.xz.000", "wb").write(data[:ca])
open(".whl/k2/C.so.xz.001", "wb").write(data[ca:cb])
open(".whl/k3/C.so.xz.002", "wb").write(data[cb:])
PY
(cd "$ST" && sha256sum A.tar.xz C.so.xz) > .whl/k3/SUMS
co=$(git ls-files -co --exclude-standard -z | xargs -0 stat -c %s 2>/dev/null | awk '{s+=$1} END {print s}')
mib() { du -sb "$@" 2>/dev/null | awk '{s+=$1} END {printf "%.2f", s/1048576}'; }
for c in "A .gpu .whl/k1" "B .whl/k2" "C .whl/k3"; do
  set -- $c; n=$1; shift
  t=$(python3 -c "print(round($(mib "$@") + $co / 1048576, 2))")
  echo "call $n: carry $* -> $t MiB with the checkout $(python3 -c "print('ok' if $t < 63.5 else 'OVER')")"
done
