"""Idle sleep of the trainer on the GPU: what a sleep frees and what a wake costs (issue 32 item 1).

    python bench/residency_probe.py [--tiny] [--runs 8] [--rank 32] [--out DIR]

Builds the Qwen3-4B-shaped random bf16 model in memory (``bench/cobatch_h200.py: build_model``),
a :class:`~functions.trainer.engine.TrainerEngine` with ``--runs`` runs, then per run one packed
forward_backward (--datums, default 4, x 191 tokens), one optim_step (AdamW moments exist) and one more
forward_backward (gradients exist). Then ``functions.trainer.residency.offload`` (the trainer's
``sleep()``) and ``reload`` (its ``wake()``), twice (the first sleep allocates and page-locks the
host stash, the second reuses it), timed, with the device memory before and after
(``torch.cuda.memory_allocated`` / ``memory_reserved`` / ``mem_get_info``). Every tensor the engine
holds (parameters, gradients, optimizer moments) is copied to the host before and compared bit for
bit after the round trip, and a forward-only pass gives the same logprobs before and after.

One JSON line per measurement on stdout (and in ``OUT/residency.jsonl``).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

OUT: Path | None = None


def log(**kw) -> None:
    line = json.dumps(kw)
    print(line, flush=True)
    if OUT is not None:
        with open(OUT / "residency.jsonl", "a") as f:
            f.write(line + "\n")


def mem() -> dict:
    if not torch.cuda.is_available():
        return {}
    free, total = torch.cuda.mem_get_info()
    return {"allocated_gb": round(torch.cuda.memory_allocated() / 1e9, 3),
            "reserved_gb": round(torch.cuda.memory_reserved() / 1e9, 3),
            "device_used_gb": round((total - free) / 1e9, 3)}


def tensors(engine) -> list[torch.Tensor]:
    """Every tensor a sleep moves (base weights and buffers, adapters, their gradients, AdamW moments)."""
    from functions.trainer.residency import engine_slots

    return [s.get() for s in engine_slots(engine)]


def main() -> None:
    global OUT
    ap = argparse.ArgumentParser()
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--runs", type=int, default=8)
    ap.add_argument("--rank", type=int, default=32)
    ap.add_argument("--datums", type=int, default=4, help="datums per run (191 tokens each)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.out:
        OUT = Path(args.out)
        OUT.mkdir(parents=True, exist_ok=True)
    from cobatch_h200 import build_model
    from functions.trainer import residency
    from functions.trainer.engine import FwdBwdItem, TrainerEngine
    from openrl.edge.proto import FwdBwdDatum
    from openrl.model.lora import LoraSpec

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    t0 = time.time()
    model, cfg = build_model(args.tiny, dev)
    engine = TrainerEngine.from_base_model(model, device=dev, name="random-qwen3-4b")
    runs = [f"run{i}" for i in range(args.runs)]
    for i, r in enumerate(runs):
        engine.create_run(r, LoraSpec(rank=args.rank, alpha=32, seed=i, train_unembed=False))
    log(what="setup", device=torch.cuda.get_device_name(0) if dev == "cuda" else "cpu", runs=args.runs,
        rank=args.rank, build_s=round(time.time() - t0, 1), torch=torch.__version__, **mem())
    rng = np.random.default_rng(0)
    V, T = int(cfg.vocab_size), 32 if args.tiny else 191

    def datum():
        toks = rng.integers(0, V, T + 1).astype(np.int64)
        return FwdBwdDatum(toks[:-1].tolist(), {"target_tokens": toks[1:], "weights": np.ones(T, np.float32)})

    batch = {r: [datum() for _ in range(args.datums)] for r in runs}

    def items(forward_only=False):
        return [FwdBwdItem(r, batch[r], "cross_entropy", None, forward_only) for r in runs]

    for step in range(2):
        res = engine.forward_backward(items())
        assert all(x.error is None for x in res), [x.error for x in res]
        if step == 0:
            engine.optim_step_many([(r, {"learning_rate": 1e-4}) for r in runs])
    fwd_before = [x.loss_fn_outputs[0]["logprobs"].copy() for x in engine.forward_backward(items(True))]
    if dev == "cuda":
        torch.cuda.synchronize()
    before = mem()
    host = [t.detach().to("cpu", copy=True) for t in tensors(engine)]
    cycles = []
    for cycle in range(2):  # the first sleep allocates and page-locks the host stash; the second reuses it
        t1 = time.perf_counter()
        freed = residency.offload(engine)
        off_s = time.perf_counter() - t1
        asleep = mem()
        on_device = sum(t.device.type == dev for t in tensors(engine))
        t2 = time.perf_counter()
        residency.reload(engine)
        if dev == "cuda":
            torch.cuda.synchronize()
        on_s = time.perf_counter() - t2
        stash = getattr(engine, "_host_stash", None)
        cycles.append(dict(cycle=cycle, freed_gb=round(freed / 1e9, 3), offload_s=round(off_s, 3),
                           reload_s=round(on_s, 3), left_on_device_asleep=on_device, asleep=asleep,
                           stash_gb=round(stash.nbytes / 1e9, 3) if stash else 0,
                           stash_registered=bool(stash and stash.registered)))
    awake = mem()
    after = tensors(engine)
    same = len(after) == len(host) and all(
        a.device.type == dev and torch.equal(a.detach().cpu(), h) for a, h in zip(after, host))
    fwd_after = [x.loss_fn_outputs[0]["logprobs"] for x in engine.forward_backward(items(True))]
    fwd_same = all(np.array_equal(a, b) for a, b in zip(fwd_after, fwd_before))
    for c in cycles:
        log(what="sleep_wake", tensors=len(host), bitwise_same=bool(same), forward_same=bool(fwd_same),
            before=before, awake=awake, **c)
    res = engine.forward_backward(items())
    log(what="after_wake_pass", ok=all(x.error is None for x in res), **mem())


if __name__ == "__main__":
    main()
