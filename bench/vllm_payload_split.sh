#!/usr/bin/env bash
# Run HERE after `bash .vllm-h200/build_payload.sh` (../shared/vllm-h200/README.md): moves all but the first
# 24 MiB of .whl/c1/C.so.xz.000 into .whl/c2/C.so.xz.000b and rewrites SUMS1, so that part 1 plus the checkout
# stays under the device tool's 64 MiB (part 1 was 61.4 MiB; part 2 gets ~6 MiB more). `bench/device_call.sh
# sampler-hf-vllm` concatenates C.so.xz.000 .000b .001 .002 and checks SUMS2 (the whole C.so.xz) as before.
set -euo pipefail
cd "$(git rev-parse --show-toplevel)/.whl"
python3 - <<'PY'
import hashlib
p = "c1/C.so.xz.000"
data = open(p, "rb").read()
cut = 24 * 2**20
if len(data) > cut:
    open("c2/C.so.xz.000b", "wb").write(data[cut:])
    open(p, "wb").write(data[:cut])
sums = [f"{hashlib.sha256(open('c1/' + n, 'rb').read()).hexdigest()}  {n}" for n in ("A.tar.xz", "C.so.xz.000")]
open("c1/SUMS1", "w").write("\n".join(sums) + "\n")
PY
(cd c1 && sha256sum -c SUMS1) && du -b c1 c2
