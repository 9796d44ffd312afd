"""The trainer's micro-batch cap from free memory (functions/trainer/memory_plan.py).

No GPU in CI: the CUDA allocator's figures (``mem_get_info``, ``memory_allocated``,
``memory_reserved``, the peak, the per-process fraction) are a fake whose activation bytes grow
with the padded tokens of the micro-batch that runs, and a micro-batch above what the fake has
free raises ``torch.cuda.OutOfMemoryError`` as the real allocator would. The engine and its
arithmetic are the real CPU ones, so results are compared with an unplanned pass.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from functions.trainer import memory_plan
from functions.trainer.engine import Datum, FwdBwdItem, TrainerEngine
from functions.trainer.memory_plan import ActivationBudget, estimate_bytes_per_token
from openrl.model.lora import LoraSpec

VOCAB = 512
GB = 10**9


class FakeCuda:
    """A device of ``total`` bytes, ``fraction`` of it for this process, ``allocated`` held by
    weights and optimizer state; a running micro-batch adds ``true_bpt`` bytes per padded token."""

    def __init__(self, total=80 * GB, fraction=0.5, allocated=16 * GB, true_bpt=4.5e6, others=0):
        self.total, self.fraction, self.allocated, self.true_bpt, self.others = total, fraction, allocated, true_bpt, others
        self.peak = allocated

    def install(self, monkeypatch):
        monkeypatch.setattr(torch.cuda, "mem_get_info", lambda d=None: (self.total - self.allocated - self.others, self.total))
        monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction", self.get_fraction, raising=False)
        monkeypatch.setattr(torch.cuda, "memory_allocated", lambda d=None: self.allocated)
        monkeypatch.setattr(torch.cuda, "memory_reserved", lambda d=None: self.allocated)
        monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda d=None: self.peak)
        monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda d=None: setattr(self, "peak", self.allocated))

    def get_fraction(self, device) -> float:
        if torch.device(device).index is None:  # as torch's: "Expected a torch.device with a specified index"
            raise ValueError(f"Expected a torch.device with a specified index or an integer, but got:{device}")
        return self.fraction

    def limit(self) -> int:
        return min(int(self.fraction * self.total), self.total - self.others)

    def run(self, tokens: int) -> None:
        need = self.allocated + tokens * self.true_bpt
        if need > self.limit():
            raise torch.cuda.OutOfMemoryError(f"CUDA out of memory (simulated: {tokens} padded tokens)")
        self.peak = max(self.peak, need)


def test_the_estimate_for_qwen3_4b_shapes_errs_on_the_safe_side():
    class Qwen3_4B:  # config.json of Qwen/Qwen3-4B-Instruct-2507
        hidden_size, intermediate_size, num_hidden_layers = 2560, 9728, 36
        num_attention_heads, num_key_value_heads, head_dim = 32, 8, 128

    train, fwd = estimate_bytes_per_token(Qwen3_4B(), torch.bfloat16)
    assert 4.9e6 < train < 7e6  # the H100 measured about 4.3-4.9 MB a token
    assert fwd < train / 5


def test_cap_follows_the_headroom_and_the_measured_bytes(monkeypatch):
    fake = FakeCuda()
    fake.install(monkeypatch)
    b = ActivationBudget(torch.device("cuda", 0), (6e6, 1e6))
    headroom = 40 * GB - 16 * GB  # half of 80 GB under the cap, 16 GB held
    assert b.headroom() == headroom
    assert b.cap(True) == int(memory_plan.MARGIN * headroom / 6e6)
    assert b.cap(False) == int(memory_plan.MARGIN * headroom / 1e6)

    b.start()
    fake.run(2000)
    b.finish(2000, True)
    assert b.measured[True] and b.bytes_per_token[True] == pytest.approx(4.5e6)
    assert b.cap(True) == int(memory_plan.MARGIN * headroom / 4.5e6)

    b.start()
    fake.run(100)
    b.finish(100, False)  # too few tokens to say anything per token
    assert not b.measured[False] and b.bytes_per_token[False] == 1e6

    assert b.peak_allocated == 16 * GB + 2000 * 4.5e6  # the larger micro-batch's peak, kept past start()
    b.reset_peak()
    assert b.peak_allocated == 0

    fake.others = 60 * GB  # another process (the sampler) took the device: free memory bounds it
    assert b.headroom() == 80 * GB - 60 * GB - 16 * GB


def test_out_of_memory_halves_the_next_plan(monkeypatch):
    FakeCuda().install(monkeypatch)
    b = ActivationBudget(torch.device("cuda", 0), (1e6, 1e6))  # far too optimistic
    before = b.cap(True)
    b.out_of_memory(before, True)
    assert b.cap(True) <= before // 2
    b.out_of_memory(1000, True)
    assert b.cap(True) <= 500


def _datum(seed: int, n: int) -> Datum:
    seq = np.random.RandomState(seed).randint(0, VOCAB, size=n).astype(np.int64)
    return Datum(list(seq[:-1]), {"target_tokens": seq[1:], "weights": np.ones(n - 1, np.float32)})


def _items(runs, per_run=4, n=17):
    return [FwdBwdItem(r, [_datum(10 * k + j, n) for j in range(per_run)], "cross_entropy", None, False)
            for k, r in enumerate(runs)]


@pytest.fixture(scope="module")
def engine(micro_model_dir):
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield TrainerEngine(micro_model_dir)
    torch.set_num_threads(n)


@pytest.fixture
def runs(engine):
    names = ["ma", "mb", "mc"]
    for r in names:
        for suffix in ("", "_ref"):
            engine.create_run(r + suffix, LoraSpec(rank=4, seed=3))
    yield names
    for r in names:
        for suffix in ("", "_ref"):
            engine.delete_run(r + suffix)
    engine.budget = None
    engine.max_tokens = 32768


def _gpu(monkeypatch, engine, fake: FakeCuda, bpt: tuple[float, float]) -> list[int]:
    """Give the CPU engine a budget over ``fake``; returns the padded tokens of each micro-batch run."""
    fake.install(monkeypatch)
    engine.budget = ActivationBudget(torch.device("cuda", 0), bpt)
    real = TrainerEngine._run_micro_batch
    seen: list[int] = []

    def run_mb(self, mb, *a, **k):
        tokens = len(mb) * max(r.n for r in mb)
        seen.append(tokens)
        fake.run(tokens)
        return real(self, mb, *a, **k)

    monkeypatch.setattr(TrainerEngine, "_run_micro_batch", run_mb)
    return seen


def _same(engine, got, ref, runs):
    assert all(r.error is None for r in got), [r.error for r in got]
    for a, b, run in zip(got, ref, runs):
        assert a.metrics["loss:sum"] == pytest.approx(b.metrics["loss:sum"], rel=1e-5)
        for x, y in zip(a.loss_fn_outputs, b.loss_fn_outputs):
            np.testing.assert_allclose(x["logprobs"], y["logprobs"], rtol=1e-5, atol=1e-5)
        for g, h in zip(engine.model.adapter_parameters(run), engine.model.adapter_parameters(run + "_ref")):
            torch.testing.assert_close(g.grad, h.grad, rtol=1e-4, atol=1e-5)  # float32 sums in another order


def test_the_pass_is_planned_to_fit_with_no_out_of_memory(engine, runs, monkeypatch):
    """12 rows of 16 tokens; memory for 100 tokens at a time: micro-batches of at most 85 padded
    tokens (the margin), no out-of-memory on the way, and the results of one unplanned pass."""
    ref = engine.forward_backward(_items([r + "_ref" for r in runs]))
    fake = FakeCuda(total=10_000, fraction=1.0, allocated=1000, true_bpt=90.0)  # 9,000 bytes: 100 tokens
    seen = _gpu(monkeypatch, engine, fake, (90.0, 90.0))
    got = engine.forward_backward(_items(runs))
    assert seen and max(seen) <= 85 and sum(seen) == 12 * 16
    assert engine.max_tokens == 32768  # the configured cap stays; the budget plans each pass
    _same(engine, got, ref, runs)


def test_a_low_estimate_recovers_from_out_of_memory_and_learns(engine, runs, monkeypatch):
    """The first plan assumes 10 bytes a token where 90 are needed: the pass runs out of memory,
    is planned again at half the failed size until it fits (gradients applied once), and the
    measured bytes per token plan the next pass right the first time."""
    ref = engine.forward_backward(_items([r + "_ref" for r in runs]))
    fake = FakeCuda(total=10_000, fraction=1.0, allocated=1000, true_bpt=90.0)
    seen = _gpu(monkeypatch, engine, fake, (10.0, 10.0))
    got = engine.forward_backward(_items(runs))
    assert max(seen) > 100 and seen[-1] <= 100
    _same(engine, got, ref, runs)
    assert engine.max_tokens == 32768

    engine.budget.min_measured_tokens = 16  # the toy micro-batches count
    seen.clear()
    engine.forward_backward(_items(runs))
    assert engine.budget.measured[True] and engine.budget.bytes_per_token[True] == pytest.approx(90.0)
    seen.clear()
    engine.forward_backward(_items(runs))
    assert max(seen) <= 85  # planned from the measurement: no out-of-memory retry
    assert sum(seen) == 12 * 16


def test_a_row_too_big_for_the_memory_fails_only_its_request(engine, runs, monkeypatch):
    fake = FakeCuda(total=10_000, fraction=1.0, allocated=1000, true_bpt=300.0)  # 30 tokens fit
    _gpu(monkeypatch, engine, fake, (300.0, 300.0))
    big = FwdBwdItem(runs[0], [_datum(99, n=40)], "cross_entropy", None, False)  # 39 tokens alone
    small = FwdBwdItem(runs[1], [_datum(98, n=17)], "cross_entropy", None, False)
    got = engine.forward_backward([big, small])
    assert got[1].error is None
    assert got[0].error is not None and "out of memory" in str(got[0].error)
    assert all(p.grad is None for p in engine.model.adapter_parameters(runs[0]))
