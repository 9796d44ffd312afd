#!/usr/bin/env bash
# Device call B (carry [".whl/s2"]), right after stack_callA.sh on the same machine: keeps the first part of
# vLLM's compiled library for stack_call3.sh (the whole of vLLM does not fit one call's 64 MiB).
cd "$(dirname "$0")/.." && source bench/stack_env.sh
[ -x "$STK/bin/nats-server" ] || { echo "NOT WARM: run bench/stack_callA.sh first"; exit 3; }
cp .whl/s2/* "$PARTS"/ && el "part 2 kept: $(ls -la "$PARTS" | tail -n +2 | awk '{print $NF, $5}' | tr '\n' ' ')"
