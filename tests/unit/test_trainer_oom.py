"""TrainerEngine after a CUDA out-of-memory in a packed pass: it halves its micro-batches and
reruns the pass (results and gradients equal an uncapped pass), and only a request too big by
itself fails, with a message saying what to do.

The out-of-memory error is simulated (no GPU in CI): ``_run_micro_batch`` raises
``torch.cuda.OutOfMemoryError`` whenever a micro-batch holds more padded tokens than a budget,
as a GPU with that much free memory for activations would. The real failure this covers was
seen on an H200 (an RL pass of 8 runs x 16 samples over a trainer capped at 45 % of the GPU).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from functions.trainer.engine import Datum, FwdBwdItem, TrainerEngine
from openrl.model.lora import LoraSpec

VOCAB = 512


@pytest.fixture(scope="module")
def engine(micro_model_dir):
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield TrainerEngine(micro_model_dir)
    torch.set_num_threads(n)


def _datum(seed: int, n: int = 17) -> Datum:
    seq = np.random.RandomState(seed).randint(0, VOCAB, size=n).astype(np.int64)
    return Datum(list(seq[:-1]), {"target_tokens": seq[1:], "weights": np.ones(n - 1, np.float32)})


def _items(runs, per_run=4):
    return [FwdBwdItem(r, [_datum(10 * k + j) for j in range(per_run)], "cross_entropy", None, False)
            for k, r in enumerate(runs)]


def _grads(e, run):
    return [p.grad.detach().clone() for p in e.model.adapter_parameters(run)]


def _simulate_gpu(monkeypatch, engine, budget_tokens: int) -> list[int]:
    """Micro-batches above ``budget_tokens`` padded tokens raise CUDA OOM; returns the sizes run."""
    real = TrainerEngine._run_micro_batch
    seen: list[int] = []

    def run_mb(self, mb, *a, **k):
        tokens = len(mb) * max(r.n for r in mb)
        seen.append(tokens)
        if tokens > budget_tokens:
            x = torch.ones(1000, requires_grad=True)
            (x * 2).sum()  # a live tensor in this frame, as real activations would be
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 58.00 MiB (simulated)")
        return real(self, mb, *a, **k)

    monkeypatch.setattr(TrainerEngine, "_run_micro_batch", run_mb)
    return seen


@pytest.fixture
def twins(engine):
    runs = ["oa", "ob", "oc"]
    for r in runs:
        for suffix in ("", "_ref"):
            engine.create_run(r + suffix, LoraSpec(rank=4, seed=7))
    yield runs
    for r in runs:
        for suffix in ("", "_ref"):
            engine.delete_run(r + suffix)
    engine.max_tokens = 32768


def test_oom_halves_micro_batches_and_the_pass_still_packs(engine, twins, monkeypatch):
    ref = engine.forward_backward(_items([r + "_ref" for r in twins]))  # uncapped
    seen = _simulate_gpu(monkeypatch, engine, budget_tokens=3 * 16)
    got = engine.forward_backward(_items(twins))
    assert all(r.error is None for r in got), [r.error for r in got]
    assert engine.max_tokens <= 3 * 16  # kept for later passes
    assert max(seen) > 3 * 16 and seen[-1] <= 3 * 16
    for a, b, run in zip(got, ref, twins):
        assert a.metrics["loss:sum"] == pytest.approx(b.metrics["loss:sum"], rel=1e-5)
        for x, y in zip(a.loss_fn_outputs, b.loss_fn_outputs):
            np.testing.assert_allclose(x["logprobs"], y["logprobs"], rtol=1e-5, atol=1e-5)
        for g, h in zip(_grads(engine, run), _grads(engine, run + "_ref")):  # applied once, not per attempt
            torch.testing.assert_close(g, h, rtol=1e-4, atol=1e-6)


def test_a_row_too_big_alone_fails_only_its_request(engine, twins, monkeypatch):
    _simulate_gpu(monkeypatch, engine, budget_tokens=20)
    big = FwdBwdItem(twins[0], [_datum(99, n=40)], "cross_entropy", None, False)  # 39 tokens > 20 alone
    small = FwdBwdItem(twins[1], [_datum(98, n=17)], "cross_entropy", None, False)
    got = engine.forward_backward([big, small])
    assert got[1].error is None
    assert got[0].error is not None and "out of memory" in str(got[0].error)
    assert "--trainer-gpu-memory" in str(got[0].error) and "Nothing was applied" in str(got[0].error)
    assert all(p.grad is None for p in engine.model.adapter_parameters(twins[0]))
