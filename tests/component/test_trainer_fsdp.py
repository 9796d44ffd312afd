"""The trainer on 2 ranks (FSDP2 base, data parallel datums; functions/trainer/distributed.py)
equals the one-process TrainerEngine (issue 16 item 3).

Two gloo processes on CPU (this test process is rank 0, :func:`launch` spawns rank 1), the
micro model (tests/micro_model.py); two runs with different ranks and LoRA targets co-batched
with a forward-only item, micro-batch limits small enough that the pass has several
micro-batches and one of them a single row (so rank 1 runs the dummy row). Checked against a
``TrainerEngine`` in this process, to float32 tolerance: per-datum logprobs, ``loss:sum`` and
mismatch metrics of ``forward_backward``, the summed gradients, the adapters after
``optim_step_many``, a forward-only pass after the step, and a pass whose loss is not finite
(both fail, gradients untouched). Nothing is mocked; NCCL/GPU runs are not made here.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from functions.trainer.distributed import DistributedTrainerEngine, distributed_available, launch
from functions.trainer.engine import Datum, FwdBwdItem, TrainerEngine
from openrl.model.lora import LoraSpec

pytestmark = pytest.mark.skipif(distributed_available() is not None,
                                reason=f"no torch.distributed gloo: {distributed_available()}")

VOCAB = 512
SPECS = {"a": LoraSpec(rank=4, seed=1), "b": LoraSpec(rank=2, seed=3, alpha=8, train_mlp=False)}
LIMITS = dict(max_rows=2, max_tokens=30)  # per rank; the 33-token row runs alone


async def test_trainer_function_launches_its_ranks(micro_model_dir, tmp_path):
    """``trainer_gpus=2`` (OPENRL_TRAINER_GPUS): the trainer function's engine of a base model
    is a 2-rank DistributedTrainerEngine whose follower it spawned; stop() ends it. (Runs
    before the module's engines: one process group per process.)"""
    import asyncio

    import torch.distributed

    from functions.trainer.function import TrainerFunction
    from openrl.model.registry import ModelRegistry

    reg = ModelRegistry.from_dict({"models": {"micro": {"path": str(micro_model_dir)}}}, models_dir=tmp_path)
    f = TrainerFunction()
    await f.start({"registry_obj": reg, "storage_url": (tmp_path / "store").as_uri(), "device": "cpu",
                   "trainer_gpus": 2, "flush_interval_s": 0, "preload": []})
    try:
        key = await asyncio.to_thread(f._engine_for, "micro")
        engine = f.engines[key]
        assert isinstance(engine, DistributedTrainerEngine) and engine.world == 2 and engine.rank == 0
        followers = list(engine._followers)
        assert len(followers) == 1 and followers[0].is_alive()
    finally:
        await f.stop()
    assert not torch.distributed.is_initialized()
    followers[0].join(timeout=30)
    assert followers[0].exitcode == 0


@pytest.fixture(scope="module")
def engines(micro_model_dir):
    """(one-process engine, 2-rank engine), same runs and perturbed adapters (B != 0)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    ref = TrainerEngine(micro_model_dir, **LIMITS)
    dist = launch(micro_model_dir, 2, backend="gloo", timeout_s=120, threads=1, **LIMITS)
    try:
        for name, spec in SPECS.items():
            ref.create_run(name, spec)
            g = torch.Generator().manual_seed(100 + spec.seed)
            with torch.no_grad():
                for p in ref.model.adapter_parameters(name):
                    p.add_(torch.randn(p.shape, generator=g) * 0.05)
            dist.create_run(name, spec)
            dist.load_state_dict(name, ref.state_dict(name), with_optimizer=True)
        yield ref, dist
    finally:
        dist.close()
        torch.set_num_threads(n)


def _seq(rng, n):
    return rng.randint(0, VOCAB, size=n).astype(np.int64)


def _items(rng, forward_only=False, bad=False):
    lens = [34, 13, 11, 9, 7, 6]
    seqs = [_seq(rng, n) for n in lens]
    ce = FwdBwdItem("a", [
        Datum(list(t[:-1]), {"target_tokens": t[1:], "weights": rng.uniform(0.1, 1.5, len(t) - 1).astype(np.float32)})
        for t in seqs[:3]], "cross_entropy", None, forward_only)
    if bad:
        ce.datums[1].loss_fn_inputs["weights"][:] = 1e38  # finite weights, float32-overflowing loss
    is_ = FwdBwdItem("b", [
        Datum(list(t[:-1]), {"target_tokens": t[1:], "logprobs": np.full(len(t) - 1, -6.3, np.float32),
                             "advantages": rng.normal(size=len(t) - 1).astype(np.float32)})
        for t in seqs[3:5]], "importance_sampling", None, forward_only)
    fwd = FwdBwdItem("a", [Datum(list(seqs[5][:-1]), {"target_tokens": seqs[5][1:]})], "cross_entropy", None, True)
    return [ce, is_, fwd]


def _assert_same(ra, rb):
    assert len(ra) == len(rb)
    for a, b in zip(ra, rb):
        assert a.error is None and b.error is None, (a.error, b.error)
        assert set(a.metrics) == set(b.metrics)
        for k in a.metrics:
            assert a.metrics[k] == pytest.approx(b.metrics[k], rel=1e-5, abs=1e-5), k
        assert len(a.loss_fn_outputs) == len(b.loss_fn_outputs)
        for x, y in zip(a.loss_fn_outputs, b.loss_fn_outputs):
            assert x["logprobs"].shape == y["logprobs"].shape and x["logprobs"].dtype == np.float32
            np.testing.assert_allclose(x["logprobs"], y["logprobs"], atol=1e-5, rtol=1e-5)


def _grads(e, run):
    return [torch.zeros_like(p) if p.grad is None else p.grad.clone() for p in e.model.adapter_parameters(run)]


def test_two_ranks_equal_one_process(engines):
    ref, dist = engines
    assert isinstance(dist, DistributedTrainerEngine) and dist.world == 2
    # the base really is sharded: rank 0 holds half of a decoder layer's weight
    w = dist.model.base.model.layers[0].mlp.up_proj.base_layer.weight
    assert type(w).__name__ == "DTensor" and w.to_local().shape[0] * 2 == w.shape[0]

    rng = np.random.RandomState(5)
    items = _items(rng)
    plan = dist._global_micro_batches([r for i, it in enumerate(items) for r in dist._prepare(i, it)[0]])
    assert len(plan) >= 2 and min(len(mb) for mb in plan) == 1  # several micro-batches, one a lone row

    _assert_same(dist.forward_backward(items), ref.forward_backward(items))
    for run in SPECS:
        for x, y in zip(_grads(dist, run), _grads(ref, run)):
            torch.testing.assert_close(x, y, atol=1e-5, rtol=1e-4)

    # a second pass accumulates onto the first's gradients
    items2 = _items(np.random.RandomState(6))
    _assert_same(dist.forward_backward(items2), ref.forward_backward(items2))

    # gradients put on rank 0 alone (durable's restore does this) are the ones stepped
    for e in (ref, dist):
        for p in e.runs["b"].optimizer.params:
            p.grad = p.grad * 2.0
    steps = [("a", {"learning_rate": 1e-2, "grad_clip_norm": 1.0}), ("b", {"learning_rate": 3e-3, "weight_decay": 0.1})]
    ma, mb_ = dist.optim_step_many(steps), ref.optim_step_many(steps)
    for x, y in zip(ma, mb_):
        assert x["grad_norm:mean"] == pytest.approx(y["grad_norm:mean"], rel=1e-5)
    for run in SPECS:
        da, ra = dist.state_dict(run)["adapter"], ref.state_dict(run)["adapter"]
        assert set(da) == set(ra)
        for k in ra:
            torch.testing.assert_close(da[k], ra[k], atol=1e-5, rtol=1e-5)
        assert all(p.grad is None for p in dist.model.adapter_parameters(run))

    # after the step: a forward-only pass (no backward on any rank) sees the stepped adapters
    items3 = _items(np.random.RandomState(7), forward_only=True)
    _assert_same(dist.forward_backward(items3), ref.forward_backward(items3))


def test_non_finite_loss_fails_the_pass_on_every_rank(engines):
    ref, dist = engines
    items = _items(np.random.RandomState(8), bad=True)
    for e in (ref, dist):
        before = {run: _grads(e, run) for run in SPECS}
        res = e.forward_backward(items)
        assert all(r.error is not None and "non-finite loss" in str(r.error) for r in res[:2]), res
        for run in SPECS:
            for x, y in zip(_grads(e, run), before[run]):
                assert torch.equal(x, y)
    # the group is still in step: a good pass after the failed one matches
    items = _items(np.random.RandomState(9))
    _assert_same(dist.forward_backward(items), ref.forward_backward(items))
    for run in SPECS:
        dist.zero_grad(run)
        ref.zero_grad(run)


def test_a_prepared_run_has_the_same_adapter_on_every_rank(engines):
    """The trainer function prepares a run's adapter outside its engine lock (``prepare_run``,
    which draws a missing seed) and then creates it: the follower rank gets that seed, so the
    2-rank engine's gradients equal one process's for the run created with the same spec."""
    ref, dist = engines
    prepared = dist.prepare_run(LoraSpec(rank=4))  # no seed: drawn by prepare_run
    dist.create_run("c", LoraSpec(rank=4), prepared)
    ref.create_run("c", prepared.spec)
    try:
        rng = np.random.RandomState(10)
        seqs = [_seq(rng, n) for n in (12, 9, 7)]
        items = [FwdBwdItem("c", [Datum(list(t[:-1]), {"target_tokens": t[1:]}) for t in seqs],
                            "cross_entropy", None, False)]
        _assert_same(dist.forward_backward(items), ref.forward_backward(items))
        for x, y in zip(_grads(dist, "c"), _grads(ref, "c")):  # B's gradient depends on every rank's A
            torch.testing.assert_close(x, y, atol=1e-5, rtol=1e-4)
    finally:
        dist.delete_run("c")
        ref.delete_run("c")

