"""Adapter weights cast once per pass (``openrl/model/lora/pass_weights.py``): a
bf16 pass of several micro-batches gives the same bits with the cache as without it (results and
float32 gradients), in every kernel mode; the cache is really used (each cast made once, reused
by later micro-batches); an in-place update of an adapter, or a switch from ``no_grad`` to grad
mode, rebuilds the cast instead of reusing a stale or graph-less one.

bf16 on the CPU: the casts the cache saves only exist when the activations' dtype differs from
the float32 adapters' (on CUDA, bf16). The CPU's bf16 kernels stand in for the GPU's; the GPU run
is the conformance run's (docs/gpu-conformance.md).
"""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
import torch

from functions.trainer.engine import Datum, FwdBwdItem, TrainerEngine
from openrl.model.lora import LoraKernelSettings, LoraSpec

VOCAB = 512
SPECS = {"a": LoraSpec(rank=4, seed=1), "b": LoraSpec(rank=8, seed=2, alpha=16),
         "c": LoraSpec(rank=2, seed=3, train_mlp=False)}


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _engine(model_dir, mode: str, cached: bool) -> tuple[TrainerEngine, list]:
    """A bf16 CPU engine with 3 runs (adapters moved off their zero init) and small micro-batches;
    ``cached`` sets the engine's ``pass_cache`` (``OPENRL_LORA_PASS_CACHE``; off by default).
    Returns the engine and a list that gets ``(builds, hits)`` of each pass's cache."""
    e = TrainerEngine(model_dir, dtype=torch.bfloat16, max_tokens=40)
    e.model.kernel_settings = (LoraKernelSettings(mode="auto", stacked_max_rank_sum=10) if mode == "blocks"
                               else LoraKernelSettings(mode=mode))
    for name, spec in SPECS.items():
        e.create_run(name, spec)
        g = torch.Generator().manual_seed(100 + spec.seed)
        with torch.no_grad():
            for p in e.model.adapter_parameters(name):
                p.add_(torch.randn(p.shape, generator=g) * 0.05)
    seen: list = []
    assert e.pass_cache is False  # the default
    e.pass_cache = cached
    if cached:
        inner = e.model.pass_weights

        @contextlib.contextmanager
        def spy():
            with inner() as pw:
                yield pw
            seen.append((pw.builds, pw.hits))

        e.model.pass_weights = spy
    return e, seen


def _items(seed: int = 7) -> list[FwdBwdItem]:
    rng = np.random.RandomState(seed)

    def seq(n):
        return rng.randint(0, VOCAB, size=n).astype(np.int64)

    def ce(run, n):
        t = seq(n)
        return Datum(list(t[:-1]), {"target_tokens": t[1:], "weights": np.ones(n - 1, np.float32)})

    return [
        FwdBwdItem("a", [ce("a", 13), ce("a", 7), ce("a", 9)], "cross_entropy", None, False),
        FwdBwdItem("b", [ce("b", 11), ce("b", 5)], "cross_entropy", None, False),
        FwdBwdItem("c", [ce("c", 8)], "cross_entropy", None, True),  # forward only: no-grad rows
        FwdBwdItem("c", [ce("c", 12), ce("c", 6)], "cross_entropy", None, False),
    ]


def _grads(e: TrainerEngine) -> dict[str, list]:
    return {n: [None if p.grad is None else p.grad.clone() for p in e.model.adapter_parameters(n)] for n in SPECS}


@pytest.mark.parametrize("mode", ["stacked", "loop", "blocks", "grouped"])
def test_cached_pass_equals_uncached_bitwise(micro_model_dir, mode):
    cached, seen = _engine(micro_model_dir, mode, cached=True)
    plain, _ = _engine(micro_model_dir, mode, cached=False)
    for step in range(2):  # two passes: the second starts from updated weights (a new cache)
        ra = cached.forward_backward(_items(7 + step))
        rb = plain.forward_backward(_items(7 + step))
        for x, y in zip(ra, rb):
            assert x.error is None and y.error is None
            assert x.metrics["loss:sum"] == y.metrics["loss:sum"]
            for ox, oy in zip(x.loss_fn_outputs, y.loss_fn_outputs):
                np.testing.assert_array_equal(ox["logprobs"], oy["logprobs"])
        ga, gb = _grads(cached), _grads(plain)
        for n in SPECS:
            for p, q in zip(ga[n], gb[n]):
                assert (p is None) == (q is None)
                if p is not None:
                    assert torch.equal(p, q), n
        for e in (cached, plain):
            assert not any(isinstance(r, Exception)
                           for r in e.optim_step_many([(n, {"learning_rate": 1e-2}) for n in SPECS]))
    assert len(seen) == 2
    builds, hits = seen[0]
    # several micro-batches: each adapter cast once per pass, then reused
    assert builds > 0 and hits >= builds, seen


def test_in_place_update_and_grad_mode_rebuild(micro_model_dir):
    e, _ = _engine(micro_model_dir, "stacked", cached=True)
    m = e.model
    ids = torch.randint(0, VOCAB, (2, 6))
    with m.pass_weights() as pw:
        with torch.no_grad(), m.use_adapters(["a", "a"]):
            before = m(input_ids=ids).logits.float()
        with m.use_adapters(["a", "a"]):  # grad mode: the no_grad cast must not be reused
            out = m(input_ids=ids).logits.float()
        out.sum().backward()
        assert all(p.grad is not None and torch.count_nonzero(p.grad) > 0 for p in m.adapter_parameters("a"))
        torch.testing.assert_close(out.detach(), before, rtol=0, atol=0)
        builds = pw.builds
        with torch.no_grad():
            for p in m.adapter_parameters("a"):
                p.mul_(3.0)  # in place, as an optimizer step
            with m.use_adapters(["a", "a"]):
                after = m(input_ids=ids).logits.float()
        assert pw.builds > builds
        with m.use_adapters(["a", "a"]), torch.no_grad():
            again = m(input_ids=ids).logits.float()
        torch.testing.assert_close(after, again, rtol=0, atol=0)
    assert not torch.equal(after, before)
    assert m._pass_weights is None  # dropped on exit


def test_cache_only_where_a_run_spans_micro_batches(micro_model_dir):
    """Each run's rows in one micro-batch (equal lengths, one run per micro-batch): nothing to
    reuse, so the pass holds no cached copies; rows of varied lengths spread the runs: cached."""
    e, seen = _engine(micro_model_dir, "loop", cached=True)  # each adapter applied alone: its casts are cached
    rng = np.random.RandomState(3)

    def datum(n):
        t = rng.randint(0, VOCAB, size=n).astype(np.int64)
        return Datum(list(t[:-1]), {"target_tokens": t[1:], "weights": np.ones(n - 1, np.float32)})

    same = [FwdBwdItem(n, [datum(11), datum(11)], "cross_entropy", None, False) for n in ("a", "b")]
    assert all(r.error is None for r in e.forward_backward(same))  # 2 rows x 10 tokens = one micro-batch each
    assert seen == []
    spread = [FwdBwdItem(n, [datum(21), datum(6)], "cross_entropy", None, False) for n in ("a", "b")]
    assert all(r.error is None for r in e.forward_backward(spread))  # [a21, b21] [a6, b6]
    assert len(seen) == 1 and seen[0][1] > 0, seen
