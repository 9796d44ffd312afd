"""The deterministic mode on a GPU (issue 33), the trainer engine alone: is a run's training
bitwise the same alone and packed with 1, 3 and 7 other runs, with the mode on and off?

One job, Qwen3-4B layer shapes (hidden 2560, MLP 9728, 32/8 heads of 128, vocab 151936) with
``--layers`` decoder layers of random bf16 weights, built on the device (no model directory).
The runs, datums and losses are those of ``tests/unit/test_deterministic_trainer.py`` (run ``a``
rank 4, others of ranks 1 to 32 with cross_entropy / ppo / cispo / importance_sampling, two of
them forward only),
with ``--scale`` times longer sequences. For each mode and each packing it writes one JSON
line: ``equal`` (run ``a``'s loss:sum, logprobs, gradients of 2 steps and final weights, by
bytes), ``max_logprob_diff`` (nats) and ``s`` (wall seconds of the two steps).

    python bench/determinism_probe.py --out OUT/determinism.jsonl [--layers 4] [--scale 8]

Raises SystemExit 2 without CUDA. An op with no deterministic implementation raises its
``RuntimeError`` in the mode: the line then carries ``error``.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.unit import test_deterministic_trainer as T  # noqa: E402  (the same runs and datums)


def build_base(layers: int):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(hidden_size=2560, intermediate_size=9728, num_hidden_layers=layers, num_attention_heads=32,
                      num_key_value_heads=8, head_dim=128, vocab_size=151936, max_position_embeddings=4096,
                      tie_word_embeddings=True)
    torch.manual_seed(0)
    with torch.device("cuda"):
        base = Qwen3ForCausalLM(cfg).to(torch.bfloat16)
    return base


def engine(base, deterministic: bool):
    from functions.trainer.engine import TrainerEngine

    e = TrainerEngine.from_base_model(copy.deepcopy(base), device=base.device, deterministic=deterministic)
    for name, spec in T.SPECS.items():
        e.create_run(name, spec)
        g = torch.Generator().manual_seed(100 + spec.seed)
        with torch.no_grad():
            for p in e.model.adapter_parameters(name):
                p.add_((torch.randn(p.shape, generator=g) * 0.05).to(p.device))
    return e


def tensors(e, grads: bool) -> list[bytes]:
    out = []
    for p in e.model.adapter_parameters(T.TARGET):
        t = p.grad if grads else p.data
        out.append(b"" if t is None else t.detach().float().cpu().contiguous().numpy().tobytes())
    return out


def train(e, items, at, steps=2):
    runs = sorted({it.model_id for it in items if not it.forward_only})
    seen, lps = [], []
    for _ in range(steps):
        r = e.forward_backward(items)[at]
        assert r.error is None, r.error
        lps.append(np.concatenate([o["logprobs"] for o in r.loss_fn_outputs]))
        seen.append((r.metrics["loss:sum"], [o["logprobs"].tobytes() for o in r.loss_fn_outputs],
                     tensors(e, grads=True)))
        e.optim_step_many([(m, T.ADAM) for m in runs])
    torch.cuda.synchronize()
    return seen, tensors(e, grads=False), lps


def scaled(item, k: int):
    """``item`` with every datum's tokens and per-token inputs repeated ``k`` times."""
    from functions.trainer.engine import Datum, FwdBwdItem

    ds = [Datum(list(d.tokens) * k, {n: np.tile(np.asarray(v), k) for n, v in d.loss_fn_inputs.items()})
          for d in item.datums]
    return FwdBwdItem(item.model_id, ds, item.loss_fn, item.loss_fn_config, item.forward_only)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--scale", type=int, default=8)
    a = ap.parse_args()
    if not torch.cuda.is_available():
        print("needs CUDA", file=sys.stderr)
        return 2
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    base = build_base(a.layers)
    for det in (True, False):
        ref = None
        for n in (0, 1, 3, 7):
            line = {"deterministic": det, "others": n, "layers": a.layers, "scale": a.scale,
                    "gpu": torch.cuda.get_device_name()}
            try:
                target = scaled(T._target_item(), a.scale)
                items, at = ([target], 0) if n == 0 else (
                    [scaled(i, a.scale) for i in T._other_items(n)[:1]] + [target]
                    + [scaled(i, a.scale) for i in T._other_items(n)[1:]], 1)
                t0 = time.perf_counter()
                seen, weights, lps = train(engine(base, det), items, at)
                line["s"] = round(time.perf_counter() - t0, 3)
                if ref is None:
                    ref = (seen, weights, lps)
                line["equal"] = (seen, weights) == (ref[0], ref[1])
                line["max_logprob_diff"] = float(max(np.abs(x - y).max() for x, y in zip(lps, ref[2])))
                line["loss_sum"] = [s[0] for s in seen]
            except Exception as exc:  # noqa: BLE001  (recorded: the probe's answer for this case)
                line["error"] = f"{type(exc).__name__}: {exc}"[:400]
            print(json.dumps(line), flush=True)
            with out.open("a") as f:
                f.write(json.dumps(line) + "\n")
        torch.use_deterministic_algorithms(False)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
