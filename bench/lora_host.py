"""Host (Python) cost of one LoRA layer call, ``LoraRouting.add_lora``, with tensors so small
that the arithmetic is negligible: what a launch-bound GPU pass pays per wrapped linear
before the kernels run (the 8-run RL pass on the H100 launched 36,299 kernels, 252 wrapped
linears per forward of Qwen3-4B: 36 layers x 7).

    python bench/lora_host.py [--runs 8] [--rank 32] [--calls 2520] [--repeats 5]

A routing of ``--runs`` adapters with contiguous rows (as the trainer orders them), one row
each, x [runs, 1, 16] float32 on CPU; ``--calls`` add_lora calls on one routing (ten
forwards' worth of 252 linears), median wall time per call over ``--repeats``, for the
modes that run on CPU ("auto": stacked blocks on CPU; "loop": one delta per adapter;
"grouped" where this CPU build's ``torch._grouped_mm`` passes its self-check). It prints one
JSON line per mode. The mode is passed in as ``LoraKernelSettings(mode=...)``; checkouts
older than that setting (the ninth session's "before", docs/benchmarks.md) are not measured
by this version.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from openrl.model.lora import LoraRouting  # noqa: E402
from openrl.model.lora import ops  # noqa: E402


def _routing(rows: list[str], mode: str) -> LoraRouting:
    return LoraRouting(rows, settings=ops.LoraKernelSettings(mode=mode))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=8)
    ap.add_argument("--rank", type=int, default=32)
    ap.add_argument("--calls", type=int, default=2520)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(1)
    names = [f"run{i}" for i in range(args.runs)]
    g = torch.Generator().manual_seed(0)
    d_in, d_out = 16, 16
    A = {n: torch.randn(args.rank, d_in, generator=g) for n in names}
    B = {n: torch.randn(d_out, args.rank, generator=g) for n in names}
    S = {n: 1.0 for n in names}
    x = torch.randn(args.runs, 1, d_in, generator=g)
    y = torch.zeros(args.runs, 1, d_out)
    modes = ["auto", "loop"] + (["grouped"] if ops.grouped_mm_support(torch.device("cpu"), torch.float32) else [])
    for mode in modes:
        times = []
        with torch.no_grad():
            for _ in range(args.repeats):
                r = _routing(names, mode)
                r.add_lora(y, x, A, B, S)  # caches (masks, offsets) built outside the timing
                t0 = time.perf_counter()
                for _ in range(args.calls):
                    r.add_lora(y, x, A, B, S)
                times.append((time.perf_counter() - t0) / args.calls)
        print(json.dumps({"mode": mode, "runs": args.runs, "rank": args.rank, "calls": args.calls,
                          "us_per_call_median": round(statistics.median(times) * 1e6, 2),
                          "us_per_call_min": round(min(times) * 1e6, 2), "plan": repr(r.plan)}))


if __name__ == "__main__":
    main()
