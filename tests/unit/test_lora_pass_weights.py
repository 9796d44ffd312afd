"""The per-pass adapter operands (openrl/model/lora/weights.py, ``MultiLoRAModel.pass_weights``,
``TrainerEngine.pass_weights``): a pass that builds each layer's cast / stacked adapter weights
once for all its micro-batches gives the same losses, logprobs and gradients, bit for bit, as
one that builds them in every layer call; on CPU with the micro model, float32 and bfloat16.
The grouped-GEMM layout (CUDA only) is checked against the same reference by the GPU
conformance run; here the ``stack_*`` layouts are checked directly.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from functions.trainer.engine import Datum, FwdBwdItem, TrainerEngine
from openrl.model.logprobs import target_logprobs
from openrl.model.lora import LoraSpec
from openrl.model.lora.weights import LoraWeightCache, build, grad_slices

VOCAB = 512


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _datum(seed: int, n: int) -> Datum:
    rs = np.random.RandomState(seed)
    seq = rs.randint(0, VOCAB, size=n).astype(np.int64)
    return Datum(list(seq[:-1]), {"target_tokens": seq[1:],
                                  "logprobs": rs.uniform(-6, -1, n - 1).astype(np.float32),
                                  "advantages": rs.normal(size=n - 1).astype(np.float32)})


def _engine(model_dir, dtype) -> TrainerEngine:
    e = TrainerEngine(model_dir, dtype=dtype, max_tokens=80)  # rows of <= 40 tokens: 2 per micro-batch
    specs = {"r0": LoraSpec(rank=4, seed=1), "r1": LoraSpec(rank=8, seed=2),
             "r2": LoraSpec(rank=4, seed=3, train_unembed=True), "r3": LoraSpec(rank=4, seed=4)}
    g = torch.Generator().manual_seed(0)
    for name, spec in specs.items():
        e.create_run(name, spec)
        with torch.no_grad():  # B != 0, so every adapter changes outputs and gradients
            for pname, p in e.model.named_adapter_parameters(name):
                if "lora_B" in pname:
                    p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    return e


def _items() -> list[FwdBwdItem]:
    return [
        FwdBwdItem("r0", [_datum(1, 33), _datum(2, 21)], "importance_sampling"),
        FwdBwdItem("r1", [_datum(3, 40), _datum(4, 9), _datum(5, 30)], "ppo"),
        FwdBwdItem("r2", [_datum(6, 25)], "importance_sampling"),
        FwdBwdItem("r3", [_datum(7, 17), _datum(8, 35)], "importance_sampling", forward_only=True),
    ]


def _run(e: TrainerEngine, pass_weights: bool):
    e.pass_weights = pass_weights
    for r in ("r0", "r1", "r2", "r3"):
        e.zero_grad(r)
    out = []
    for _ in range(2):  # gradients accumulate over two calls, as between optim_steps
        res = e.forward_backward(_items())
        assert all(x.error is None for x in res), [x.error for x in res]
        out.append([(x.metrics["loss:sum"], [d["logprobs"] for d in x.loss_fn_outputs]) for x in res])
    grads = {r: [None if p.grad is None else p.grad.clone() for p in e.model.adapter_parameters(r)]
             for r in ("r0", "r1", "r2", "r3")}
    return out, grads


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_pass_weights_change_nothing(micro_model_dir, dtype):
    e = _engine(micro_model_dir, dtype)
    assert len(e._micro_batches(e._prepare_all(_items())[2])) >= 3  # several micro-batches per pass
    out0, grads0 = _run(e, False)
    out1, grads1 = _run(e, True)
    for call0, call1 in zip(out0, out1):
        for (l0, lp0), (l1, lp1) in zip(call0, call1):
            assert l0 == l1
            for a, b in zip(lp0, lp1):
                np.testing.assert_array_equal(a, b)
    assert all(g is None for g in grads0["r3"]) and all(g is None for g in grads1["r3"])  # forward only
    for r in ("r0", "r1", "r2"):
        for g0, g1 in zip(grads0[r], grads1[r]):
            assert g0 is not None and g0.dtype == torch.float32
            assert torch.equal(g0, g1)


def test_operands_built_once_per_pass_and_rebuilt_after_a_change(micro_model_dir):
    e = _engine(micro_model_dir, torch.float32)
    ids = torch.from_numpy(np.random.RandomState(0).randint(0, VOCAB, size=(4, 12)))
    rows = ["r0", "r0", "r1", "r1"]
    with e.model.pass_weights() as cache:
        target_logprobs(e.model, ids[:, :-1], ids[:, 1:], None, rows).sum().backward()
        built = cache.builds
        assert built > 0
        target_logprobs(e.model, ids[:, :-1], ids[:, 1:], None, rows).sum().backward()
        assert cache.builds == built  # the second micro-batch reuses every operand
        with torch.no_grad():
            e.model.adapter_parameters("r1")[0].add_(0.01)  # an in-place change (as an optimizer step)
        target_logprobs(e.model, ids[:, :-1], ids[:, 1:], None, rows).sum().backward()
        assert cache.builds > built
    assert e.model._router.weights is None  # the cache ends with the block


@pytest.mark.parametrize("kind", ["one", "cat_a", "cat_b", "stack_a", "stack_b"])
def test_layouts_route_gradients_to_their_parameters(kind):
    g = torch.Generator().manual_seed(7)
    shapes = {"one": [(3, 5)], "cat_a": [(2, 5), (4, 5)], "stack_a": [(2, 5), (4, 5)],
              "cat_b": [(5, 2), (5, 4)], "stack_b": [(5, 2), (5, 4)]}[kind]
    params = [torch.randn(s, generator=g).requires_grad_() for s in shapes]
    rank = 8 if kind.startswith("stack") else 0
    w = build(kind, params, torch.float32, rank)
    assert all(w.data_ptr() != p.data_ptr() for p in params)
    weight = torch.randn(w.shape, generator=g)
    # reference: the same layout built with autograd
    ref = {"one": lambda: params[0] * 1, "cat_a": lambda: torch.cat(params, 0), "cat_b": lambda: torch.cat(params, 1),
           "stack_a": lambda: torch.stack([torch.nn.functional.pad(p, (0, 0, 0, rank - p.shape[0])) for p in params]),
           "stack_b": lambda: torch.stack([torch.nn.functional.pad(p, (0, rank - p.shape[1])) for p in params])}[kind]
    (ref() * weight).sum().backward()
    expected = [p.grad.clone() for p in params]
    for p in params:
        p.grad = None
    cache = LoraWeightCache()
    leaf = cache.get("layer", kind, params, [True] * len(params), torch.float32, rank)
    (leaf * weight).sum().backward()
    assert leaf.grad is None  # handed on to the parameters
    for p, want in zip(params, expected):
        assert torch.equal(p.grad, want)
    parts = grad_slices(kind, weight, params)
    assert [tuple(x.shape) for x in parts] == [tuple(p.shape) for p in params]
