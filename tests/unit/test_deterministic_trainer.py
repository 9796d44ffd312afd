"""The trainer's deterministic mode (issue 33, functions/trainer/determinism.py): a run's numbers
are bitwise the same alone or packed with other runs.

CPU, float32, exact: logprobs, ``loss:sum``, gradients and adapter weights after
forward_backward + optim_step compare by their bytes (no tolerance). The other runs of a pass
have other sequence lengths, other LoRA ranks and other losses, and a forward_only item sits
among them; a forward and a forward_backward give the same logprobs. A control shows the same
comparison is not exact with the mode off (the packed case really pads and reorders).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from functions.trainer.engine import Datum, FwdBwdItem, TrainerEngine
from functions.trainer.optim import AdamConfig
from openrl.model.lora import LoraSpec

VOCAB = 512
TARGET = "a"
SPECS = {
    "a": LoraSpec(rank=4, seed=1),
    "r8": LoraSpec(rank=8, seed=2, alpha=16),
    "r2": LoraSpec(rank=2, seed=3, train_mlp=False),
    "r16": LoraSpec(rank=16, seed=4),
    "r32": LoraSpec(rank=32, seed=5, alpha=64),
    "r1": LoraSpec(rank=1, seed=6),
    "r6": LoraSpec(rank=6, seed=7, train_mlp=False),
    "r12": LoraSpec(rank=12, seed=8),
}
ADAM = AdamConfig(learning_rate=1e-2, weight_decay=0.01, grad_clip_norm=1.0)


@pytest.fixture(autouse=True)
def _torch_state():
    """One intra-op thread (2 shared cores) and the process-wide deterministic switch restored
    after each test (the mode sets it)."""
    n, det = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
    torch.use_deterministic_algorithms(det)


def _engine(model_dir, deterministic: bool = True) -> TrainerEngine:
    """Every run of :data:`SPECS` created, adapters given a visible effect (B = 0 at init)."""
    e = TrainerEngine(model_dir, deterministic=deterministic)
    for name, spec in SPECS.items():
        e.create_run(name, spec)
        g = torch.Generator().manual_seed(100 + spec.seed)
        with torch.no_grad():
            for p in e.model.adapter_parameters(name):
                p.add_(torch.randn(p.shape, generator=g) * 0.05)
    return e


def _seq(rng, n):
    return rng.randint(0, VOCAB, size=n).astype(np.int64)


def _target_item(forward_only: bool = False) -> FwdBwdItem:
    """Run ``a``'s request: two datums of 11 and 6 tokens, cross-entropy with weights."""
    rng = np.random.RandomState(7)
    t1, t2 = _seq(rng, 12), _seq(rng, 7)
    return FwdBwdItem(TARGET, [
        Datum(list(t1[:-1]), {"target_tokens": t1[1:], "weights": rng.uniform(0.2, 1.5, 11).astype(np.float32)}),
        Datum(list(t2[:-1]), {"target_tokens": t2[1:], "weights": np.ones(6, np.float32)}),
    ], "cross_entropy", None, forward_only)


def _other_items(n: int) -> list[FwdBwdItem]:
    """``n`` (1..7) requests of other runs: other lengths (17, 3, 9, 24, 40, 1, 13, 30, 5 tokens),
    ranks (1 to 32) and losses; the r2 and r6 ones are forward_only."""
    rng = np.random.RandomState(11)
    a, b, c, d = _seq(rng, 18), _seq(rng, 4), _seq(rng, 10), _seq(rng, 25)
    e, f, g, h, k = _seq(rng, 41), _seq(rng, 2), _seq(rng, 14), _seq(rng, 31), _seq(rng, 6)
    items = [
        FwdBwdItem("r8", [
            Datum(list(a[:-1]), {"target_tokens": a[1:], "logprobs": np.full(17, -6.3, np.float32),
                                 "advantages": rng.normal(size=17).astype(np.float32)}),
            Datum(list(d[:-1]), {"target_tokens": d[1:], "weights": np.ones(24, np.float32)}),
        ], "ppo", {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1}, False),
        FwdBwdItem("r2", [
            Datum(list(b[:-1]), {"target_tokens": b[1:], "logprobs": np.full(3, -6.0, np.float32),
                                 "advantages": np.ones(3, np.float32)}),
        ], "cispo", None, True),
        FwdBwdItem("r16", [
            Datum(list(c[:-1]), {"target_tokens": c[1:], "logprobs": np.full(9, -6.5, np.float32),
                                 "advantages": rng.normal(size=9).astype(np.float32)}),
        ], "importance_sampling", None, False),
        FwdBwdItem("r32", [
            Datum(list(e[:-1]), {"target_tokens": e[1:], "weights": rng.uniform(0.0, 2.0, 40).astype(np.float32)}),
        ], "cross_entropy", None, False),
        FwdBwdItem("r1", [
            Datum(list(f[:-1]), {"target_tokens": f[1:], "weights": np.ones(1, np.float32)}),
            Datum(list(k[:-1]), {"target_tokens": k[1:], "weights": np.ones(5, np.float32)}),
        ], "cross_entropy", None, False),
        FwdBwdItem("r6", [
            Datum(list(g[:-1]), {"target_tokens": g[1:], "weights": np.ones(13, np.float32)}),
        ], "cross_entropy", None, True),
        FwdBwdItem("r12", [
            Datum(list(h[:-1]), {"target_tokens": h[1:], "logprobs": np.full(30, -6.2, np.float32),
                                 "advantages": rng.normal(size=30).astype(np.float32)}),
        ], "ppo", {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}, False),
    ]
    assert 1 <= n <= len(items), n
    return items[:n]


def _packed(target: FwdBwdItem, n_others: int) -> tuple[list[FwdBwdItem], int]:
    """The target among ``n_others`` other runs' requests (one before it, the rest after):
    ``(items, index of the target)``."""
    others = _other_items(n_others)
    return others[:1] + [target] + others[1:], 1


def _bytes_of(result) -> list[bytes]:
    assert result.error is None, result.error
    return [o["logprobs"].tobytes() for o in result.loss_fn_outputs]


def _tensors(e: TrainerEngine, grads: bool) -> list[bytes]:
    """Run ``a``'s gradients (or weights) as bytes, in parameter order."""
    out = []
    for p in e.model.adapter_parameters(TARGET):
        t = p.grad if grads else p.data
        out.append(b"" if t is None else t.detach().contiguous().numpy().tobytes())
    return out


def _train(e: TrainerEngine, items: list[FwdBwdItem], at: int, steps: int = 2):
    """``steps`` x (forward_backward of ``items`` in one pass, then one optim_step of every
    training run together): run ``a``'s (loss:sum, logprobs, grads) per step and its final weights."""
    runs = sorted({it.model_id for it in items if not it.forward_only})
    seen = []
    for _ in range(steps):
        r = e.forward_backward(items)[at]
        seen.append((r.metrics["loss:sum"], _bytes_of(r), _tensors(e, grads=True)))
        out = e.optim_step_many([(m, ADAM) for m in runs])
        assert all(isinstance(o, dict) for o in out), out
    return seen, _tensors(e, grads=False)


@pytest.mark.parametrize("n_others", [1, 3, 7])
def test_forward_logprobs_alone_equal_packed(micro_model_dir, n_others):
    target = _target_item(forward_only=True)
    alone = _engine(micro_model_dir).forward_backward([target])[0]
    items, at = _packed(target, n_others)
    packed = _engine(micro_model_dir).forward_backward(items)[at]
    assert _bytes_of(packed) == _bytes_of(alone)
    assert packed.metrics["loss:sum"] == alone.metrics["loss:sum"]


@pytest.mark.parametrize("n_others", [1, 3, 7])
def test_training_alone_equals_packed(micro_model_dir, n_others):
    """Loss, logprobs and gradients of each of 2 steps, and the adapter after them, bitwise."""
    target = _target_item()
    alone, w_alone = _train(_engine(micro_model_dir), [target], 0)
    items, at = _packed(target, n_others)
    packed, w_packed = _train(_engine(micro_model_dir), items, at)
    for (la, lpa, ga), (lb, lpb, gb) in zip(alone, packed):
        assert la == lb
        assert lpa == lpb
        assert ga == gb
    assert w_alone == w_packed
    assert alone[0][2] != alone[1][2]  # the step changed the adapter (the second pass saw it)


def test_forward_equals_forward_backward_logprobs(micro_model_dir):
    e = _engine(micro_model_dir)
    items, at = _packed(_target_item(forward_only=True), 3)
    fwd = e.forward_backward(items)[at]
    items, at = _packed(_target_item(), 3)
    fb = e.forward_backward(items)[at]
    assert _bytes_of(fwd) == _bytes_of(fb)
    assert fwd.metrics["loss:sum"] == fb.metrics["loss:sum"]


def test_mode_off_is_not_exact_here(micro_model_dir):
    """Control: without the mode the same packed pass pads run ``a``'s rows to the longest row
    of the micro-batch and reorders them, and its numbers move here (so the tests above can fail).
    Skipped, not failed, on a CPU whose kernels happen to give the same bits (the product
    promises nothing outside the mode)."""
    target = _target_item()
    alone, _ = _train(_engine(micro_model_dir, deterministic=False), [target], 0, steps=1)
    items, at = _packed(target, 3)
    packed, _ = _train(_engine(micro_model_dir, deterministic=False), items, at, steps=1)
    (la, lpa, ga), (lb, lpb, gb) = alone[0], packed[0]
    if (la, lpa, ga) == (lb, lpb, gb):  # the CPU's BLAS may block these shapes alike: nothing to show then
        pytest.skip("packing happened to be exact on this CPU without the mode")
    assert (la, lpa, ga) != (lb, lpb, gb)


def test_mode_plans_one_row_per_micro_batch_in_row_order(micro_model_dir):
    e = _engine(micro_model_dir)
    assert e.deterministic and not e.fused_head and torch.are_deterministic_algorithms_enabled()
    items, _ = _packed(_target_item(), 3)
    _, _, rows = e._prepare_all(items)
    plan = e._plan(rows)
    assert [len(mb) for mb in plan] == [1] * len(rows)
    assert [(mb[0].item, mb[0].datum) for mb in plan] == [(r.item, r.datum) for r in rows]
    assert [(r.item, r.datum) for r in rows] == sorted((r.item, r.datum) for r in rows)


def test_setting_flag_and_registry_override(tmp_path, monkeypatch):
    """``OPENRL_DETERMINISTIC``, ``openrl serve --deterministic`` (the stack's workers'
    environment) and a registry entry's ``deterministic`` (overrides the server setting)."""
    from openrl.cli import build_parser
    from openrl.config import Settings
    from openrl.errors import RegistryError
    from openrl.model.registry import ModelRegistry
    from openrl.transport.embedded import Stack, _stack_from_args

    monkeypatch.delenv("OPENRL_DETERMINISTIC", raising=False)
    assert Settings().deterministic is False
    monkeypatch.setenv("OPENRL_DETERMINISTIC", "1")
    assert Settings().deterministic is True
    monkeypatch.delenv("OPENRL_DETERMINISTIC")
    args = build_parser().parse_args(["serve", "--deterministic"])
    assert _stack_from_args(args).env()["OPENRL_DETERMINISTIC"] == "1"
    assert "OPENRL_DETERMINISTIC" not in Stack(state_dir=tmp_path, storage="file:///x").env()
    reg = ModelRegistry.from_dict({"models": {"on": {"path": "x", "deterministic": True},
                                              "off": {"path": "x", "deterministic": False},
                                              "server": {"path": "x"}}}, models_dir=tmp_path)
    assert [reg.resolve(n).is_deterministic(False) for n in ("on", "off", "server")] == [True, False, False]
    assert [reg.resolve(n).is_deterministic(True) for n in ("on", "off", "server")] == [True, False, True]
    with pytest.raises(RegistryError, match="deterministic"):
        ModelRegistry.from_dict({"models": {"m": {"path": "x", "deterministic": "yes"}}}, models_dir=tmp_path)
