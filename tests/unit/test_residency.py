"""functions/trainer/residency.py on CPU: what a trainer's idle sleep moves, and that the move
and its way back change nothing.

There is no GPU in CI, so the moves run CPU -> host stash -> CPU (``stash_tensors`` /
``unstash_tensors``, the functions ``offload`` / ``reload`` call on an accelerator, there with
``cudaHostRegister``ed memory and asynchronous copies); the GPU run is
``bench/residency_probe.py`` (device step ``engine-sleep-probe``)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from functions.trainer import residency
from functions.trainer.engine import Datum, FwdBwdItem, TrainerEngine
from openrl.model.lora import LoraSpec

VOCAB = 512
RUNS = ("a", "b")


@pytest.fixture(scope="module")
def model_dir(micro_model_dir):
    return micro_model_dir  # tests/conftest.py, tests/micro_model.py


def _datum(seed: int, n: int = 17) -> Datum:
    seq = np.random.RandomState(seed).randint(0, VOCAB, size=n).astype(np.int64)
    return Datum(list(seq[:-1]), {"target_tokens": seq[1:], "weights": np.ones(n - 1, np.float32)})


def _trained(model_dir) -> TrainerEngine:
    """Two runs of different ranks, one optimizer step each (AdamW moments exist), then one
    more forward_backward (accumulated gradients exist)."""
    e = TrainerEngine(model_dir)
    for i, r in enumerate(RUNS):
        e.create_run(r, LoraSpec(rank=4 * (i + 1), seed=i))
    e.forward_backward([FwdBwdItem(r, [_datum(i)], "cross_entropy", None, False) for i, r in enumerate(RUNS)])
    e.optim_step_many([(r, {"learning_rate": 1e-2}) for r in RUNS])
    e.forward_backward([FwdBwdItem(r, [_datum(10 + i)], "cross_entropy", None, False) for i, r in enumerate(RUNS)])
    return e


def _snapshot(e: TrainerEngine) -> list[torch.Tensor]:
    return [s.get().detach().clone() for s in residency.engine_slots(e)]


def test_slots_hold_the_adapters_their_gradients_and_moments(model_dir):
    """Every run's LoRA parameters (plain dicts in MultiLoRALinear, not registered submodule
    parameters: ``Module.to`` misses them) and their gradients are among the tensors a sleep
    moves, beside the base weights, buffers and the AdamW moments."""
    e = _trained(model_dir)
    got = [s.get() for s in residency.engine_slots(e)]
    adapters = [p for r in RUNS for p in e.model.adapter_parameters(r)]
    assert adapters and all(p.grad is not None for p in adapters)
    registered = {id(p) for p in e.model.parameters()}
    assert not any(id(p) in registered for p in adapters)  # what Module.to would have missed
    held = {t.data_ptr() for t in got}
    assert {p.data_ptr() for p in adapters} <= held and {p.grad.data_ptr() for p in adapters} <= held
    moments = [st[k] for r in RUNS for st in e.runs[r].optimizer.opt.state.values() for k in ("exp_avg", "exp_avg_sq")]
    assert len(moments) == 2 * len(adapters)
    assert {m.data_ptr() for m in moments} <= held
    base = list(e.model.parameters())
    assert len(got) == len(base) + 2 * len(adapters) + len(list(e.model.buffers())) + len(moments)


def test_stash_and_back_is_bit_for_bit_and_training_goes_on_as_a_twin(model_dir):
    """After stash_tensors every tensor of the engine is a view of the one host buffer (the
    Parameter objects and optimizer state keys unchanged); unstash_tensors gives fresh tensors
    with the same bits; a second sleep reuses the buffer; then an optimizer step and a
    forward_backward give bit for bit what a twin that never moved gives."""
    e, twin = _trained(model_dir), _trained(model_dir)
    params_before = {r: [id(p) for p in e.model.adapter_parameters(r)] for r in RUNS}
    before = _snapshot(e)
    nbytes = residency.stash_tensors(e)
    assert nbytes == sum(t.numel() * t.element_size() for t in before)
    stash = e._host_stash
    lo, hi = stash.buf.data_ptr(), stash.buf.data_ptr() + stash.nbytes
    assert all(lo <= s.get().data_ptr() < hi for s in residency.engine_slots(e))
    assert residency.stash_tensors(e) == 0  # already asleep: nothing to move
    assert residency.unstash_tensors(e, torch.device("cpu")) == nbytes
    after = [s.get() for s in residency.engine_slots(e)]
    assert not any(lo <= t.data_ptr() < hi for t in after)
    assert len(after) == len(before) and all(torch.equal(a, b) for a, b in zip(after, before))
    assert {r: [id(p) for p in e.model.adapter_parameters(r)] for r in RUNS} == params_before
    residency.stash_tensors(e)  # a second sleep: the same buffer
    assert e._host_stash is stash
    residency.unstash_tensors(e, torch.device("cpu"))
    for m in (e, twin):
        m.optim_step_many([(r, {"learning_rate": 1e-2}) for r in RUNS])
    items = [FwdBwdItem(r, [_datum(20 + i)], "cross_entropy", None, False) for i, r in enumerate(RUNS)]
    ra, rb = e.forward_backward(items), twin.forward_backward(items)
    for x, y in zip(ra, rb):
        assert x.error is None and x.metrics == y.metrics
        assert np.array_equal(x.loss_fn_outputs[0]["logprobs"], y.loss_fn_outputs[0]["logprobs"])
    for r in RUNS:
        for p, q in zip(e.model.adapter_parameters(r), twin.model.adapter_parameters(r)):
            assert torch.equal(p, q) and torch.equal(p.grad, q.grad)


def test_offload_on_a_cpu_engine_moves_nothing(model_dir):
    """``offload`` / ``reload`` (the trainer's sleep / wake) leave a CPU engine where it is."""
    e = _trained(model_dir)
    assert residency.offload(e) == 0 and residency.reload(e) == 0
    assert getattr(e, "_host_stash", None) is None


def test_model_to_device_moves_the_adapters_too(model_dir):
    """``MultiLoRAModel.to_device`` (the transformers sampler's sleep / wake) is ``Module.to``
    plus ``map_adapters``: every adapter's data and gradient go through the move, the Parameter
    objects stay. (Without a GPU the move here is a copy on the CPU: new storage, same bits.)"""
    e = _trained(model_dir)
    adapters = [p for r in RUNS for p in e.model.adapter_parameters(r)]
    before = [(id(p), p.data_ptr(), p.grad.data_ptr(), p.detach().clone(), p.grad.clone()) for p in adapters]
    e.model.map_adapters(lambda t: t.clone())
    after = [p for r in RUNS for p in e.model.adapter_parameters(r)]
    for p, (pid, ptr, gptr, val, grad) in zip(after, before):
        assert id(p) == pid and p.data_ptr() != ptr and p.grad.data_ptr() != gptr
        assert torch.equal(p, val) and torch.equal(p.grad, grad)
    e.model.to_device("cpu")
    assert [id(p) for r in RUNS for p in e.model.adapter_parameters(r)] == [b[0] for b in before]
