"""The trainer's adapter casts made once per pass (``OPENRL_LORA_PASS_CACHE``,
``openrl/model/lora/pass_weights.py``): one pass of 8 rank-32 runs with the cache off and on,
same job, same engine settings: casts (``aten::_to_copy``) and all ``aten::`` ops counted by
``torch.profiler``, and the pass's wall time (median of ``--reps``, the two engines alternating).

Shapes: each run sends ``--datums`` datums of random lengths in ``[--min-len, --max-len)``
(cross_entropy), so each run's rows spread over the micro-batches (the engine sorts rows longest
first); ``--deterministic`` plans one row per micro-batch. On CUDA the base is Qwen3-4B layer
shapes with ``--layers`` decoder layers of random bf16 weights, built on the device; on the CPU
it is the tests' micro model in bf16 (``tests/micro_model.py``). One JSON line per setting:

    python bench/pass_weights_probe.py [--device cuda] [--layers 36] [--deterministic] [--out FILE]

The cache is checked for equal results as it runs: the two engines' losses must be equal
(``equal_loss``); ``tests/unit/test_pass_weights.py`` checks the bits.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))


def build_engines(args) -> tuple:
    """Two engines on the same base weights and adapters: cache off, cache on."""
    from functions.trainer.engine import TrainerEngine
    from openrl.model.lora import LoraSpec

    if args.device == "cuda":
        sys.path.insert(0, str(ROOT / "bench"))
        from determinism_probe import build_base

        base = build_base(args.layers)
        engines = [TrainerEngine.from_base_model(copy.deepcopy(base), device="cuda", deterministic=args.deterministic)
                   for _ in range(2)]
        vocab = 151936
    else:
        from micro_model import write_micro_qwen3

        d = write_micro_qwen3(Path(tempfile.mkdtemp()))
        engines = [TrainerEngine(d, dtype=torch.bfloat16, deterministic=args.deterministic, max_tokens=args.max_tokens)
                   for _ in range(2)]
        vocab = 512
    for e, cached in zip(engines, (False, True)):
        e.pass_cache = cached
        if args.device != "cuda":
            e.max_tokens = args.max_tokens
        for i in range(args.runs):
            e.create_run(f"r{i}", LoraSpec(rank=args.rank, seed=i))
    return engines, vocab


def items(args, vocab: int):
    from functions.trainer.engine import Datum, FwdBwdItem

    rng = np.random.RandomState(0)
    out = []
    for i in range(args.runs):
        ds = []
        for _ in range(args.datums):
            t = rng.randint(0, vocab, size=rng.randint(args.min_len, args.max_len)).astype(np.int64)
            ds.append(Datum(list(t[:-1]), {"target_tokens": t[1:], "weights": np.ones(len(t) - 1, np.float32)}))
        out.append(FwdBwdItem(f"r{i}", ds, "cross_entropy", None, False))
    return out


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--layers", type=int, default=36, help="CUDA: decoder layers of Qwen3-4B shape")
    ap.add_argument("--runs", type=int, default=8)
    ap.add_argument("--rank", type=int, default=32)
    ap.add_argument("--datums", type=int, default=8)
    ap.add_argument("--min-len", type=int, default=20)
    ap.add_argument("--max-len", type=int, default=120)
    ap.add_argument("--max-tokens", type=int, default=1024, help="CPU: the engine's micro-batch cap")
    ap.add_argument("--deterministic", action="store_true")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", default=None, help="append the JSON line here too")
    args = ap.parse_args()
    if args.device == "cpu":
        torch.set_num_threads(1)
    engines, vocab = build_engines(args)
    batch = items(args, vocab)
    losses = [[r.metrics["loss:sum"] for r in e.forward_backward(batch)] for e in engines]  # warm-up
    line = dict(what="pass_weights", device=torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
                deterministic=args.deterministic, runs=args.runs, rank=args.rank, datums=args.datums,
                lengths=[args.min_len, args.max_len], equal_loss=losses[0] == losses[1],
                micro_batches=len(engines[0]._plan(engines[0]._prepare_all(batch)[2])))
    for name, e in zip(("off", "on"), engines):
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            e.forward_backward(batch)
            sync(args.device)
        ev = {x.key: x for x in prof.key_averages()}
        cp = ev.get("aten::_to_copy")
        line[f"casts_{name}"] = cp.count if cp else 0
        line[f"cast_cpu_ms_{name}"] = round(cp.self_cpu_time_total / 1e3, 2) if cp else 0.0
        line[f"aten_ops_{name}"] = sum(x.count for k, x in ev.items() if k.startswith("aten::"))
    times: dict[str, list[float]] = {"off": [], "on": []}
    for _ in range(args.reps):
        for name, e in zip(("off", "on"), engines):
            sync(args.device)
            t0 = time.perf_counter()
            e.forward_backward(batch)
            sync(args.device)
            times[name].append(time.perf_counter() - t0)
    for name in times:
        line[f"pass_s_{name}"] = round(statistics.median(times[name]), 4)
    line["ratio_on_off"] = round(line["pass_s_on"] / line["pass_s_off"], 3)
    print(json.dumps(line), flush=True)
    if args.out:
        with open(args.out, "a") as f:
            f.write(json.dumps(line) + "\n")


if __name__ == "__main__":
    main()
