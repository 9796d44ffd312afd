"""Co-batching: one packed pass over several runs equals running each run alone.

Runs with different ranks, alphas, targets and losses share a pass (plus a forward_only
item); their logprobs, losses and gradients must match solo passes, and gradients must
never leak between runs. Also: the PEFT export loads in ``peft.PeftModel`` with the same
logits.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from functions.trainer.engine import Datum, FwdBwdItem, TrainerEngine
from openrl.model.lora import LoraKernelSettings, LoraSpec, MultiLoRAModel, load_peft_adapter
from openrl.model.logprobs import pad_batch, target_logprobs

VOCAB = 512


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    # 2 shared cores: intra-op threads only add contention for these tiny matmuls
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def model_dir(micro_model_dir):
    return micro_model_dir  # tests/conftest.py, tests/micro_model.py


@pytest.fixture(params=["stacked", "loop", "blocks", "grouped"])
def mode(request) -> LoraKernelSettings:
    """Every way a layer applies several adapters (openrl.model.lora.LoraKernelSettings, set on
    the engine's model by ``_engine``); "blocks" = auto with a rank cap of 10, so r4+r2 stack
    and r8 runs alone (on CPU "auto" never groups); "grouped" = torch._grouped_mm where the CPU
    build has it (else it falls back to stacked)."""
    if request.param == "blocks":
        return LoraKernelSettings(mode="auto", stacked_max_rank_sum=10)
    return LoraKernelSettings(mode=request.param)


SPECS = {
    "r4": LoraSpec(rank=4, seed=1),
    "r8": LoraSpec(rank=8, seed=2, alpha=16),
    "r2": LoraSpec(rank=2, seed=3, train_mlp=False),
}


def _engine(model_dir, kernels: LoraKernelSettings | None = None, **kw) -> TrainerEngine:
    e = TrainerEngine(model_dir, **kw)
    if kernels is not None:
        e.model.kernel_settings = kernels
    for name, spec in SPECS.items():
        e.create_run(name, spec)
        g = torch.Generator().manual_seed(100 + spec.seed)
        with torch.no_grad():  # B = 0 at init: give every adapter a visible effect
            for p in e.model.adapter_parameters(name):
                p.add_(torch.randn(p.shape, generator=g) * 0.05)
    return e


def _seq(rng, n):
    return rng.randint(0, VOCAB, size=n).astype(np.int64)


def _items():
    rng = np.random.RandomState(7)
    t1, t2, t3, t4 = _seq(rng, 13), _seq(rng, 7), _seq(rng, 10), _seq(rng, 5)
    ce = FwdBwdItem("r4", [
        Datum(list(t1[:-1]), {"target_tokens": t1[1:], "weights": rng.uniform(-0.5, 1.5, 12).astype(np.float32)}),
        Datum(list(t2[:-1]), {"target_tokens": np.stack([t2[1:], _seq(rng, 6)], 1),   # [T, 2] soft targets
                              "weights": np.full((6, 2), 0.5, np.float32)}),
    ], "cross_entropy", None, False)
    ppo = FwdBwdItem("r8", [
        Datum(list(t3[:-1]), {"target_tokens": t3[1:], "logprobs": np.full(9, -6.3, np.float32),
                              "advantages": rng.normal(size=9).astype(np.float32)}),
    ], "ppo", {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1}, False)
    fwd_only = FwdBwdItem("r2", [
        Datum(list(t4[:-1]), {"target_tokens": t4[1:], "logprobs": np.full(4, -6.0, np.float32),
                              "advantages": np.ones(4, np.float32)}),
    ], "cispo", None, True)
    dro = FwdBwdItem("r4", [
        Datum(list(t4[:-1]), {"target_tokens": t4[1:], "logprobs": np.full(4, -6.5, np.float32),
                              "advantages": np.array([1, -1, 0.5, 2], np.float32)}),
    ], "dro", {"beta": 0.3}, False)
    return [ce, ppo, fwd_only, dro]


def _grads(e: TrainerEngine, run: str):
    return [None if p.grad is None else p.grad.clone() for p in e.model.adapter_parameters(run)]


def _assert_results_equal(a, b):
    assert a.error is None and b.error is None
    assert a.metrics["loss:sum"] == pytest.approx(b.metrics["loss:sum"], rel=1e-5, abs=1e-5)
    assert len(a.loss_fn_outputs) == len(b.loss_fn_outputs)
    for x, y in zip(a.loss_fn_outputs, b.loss_fn_outputs):
        assert x["logprobs"].dtype == np.float32 and x["logprobs"].shape == y["logprobs"].shape
        np.testing.assert_allclose(x["logprobs"], y["logprobs"], atol=1e-5, rtol=1e-5)


def _assert_grads_equal(ga, gb):
    assert len(ga) == len(gb)
    for x, y in zip(ga, gb):
        if x is None or y is None:
            assert x is None and y is None or torch.count_nonzero(x if y is None else y) == 0
        else:
            torch.testing.assert_close(x, y, atol=1e-5, rtol=1e-4)


def _solo(model_dir, items):
    """Each item alone, on a fresh engine per item: reference results and gradients."""
    out, grads = [], {}
    for it in items:
        e = _engine(model_dir)
        out.append(e.forward_backward([it])[0])
        grads.setdefault(it.model_id, []).append(_grads(e, it.model_id))
    return out, grads


def _sum_grads(lists):
    acc = None
    for gl in lists:
        if acc is None:
            acc = [None if g is None else g.clone() for g in gl]
        else:
            acc = [a if g is None else (g.clone() if a is None else a + g) for a, g in zip(acc, gl)]
    return acc


@pytest.mark.parametrize("engine_kw", [{}, {"max_rows": 2}, {"max_rows": 64, "max_tokens": 20}])
def test_cobatched_equals_solo(model_dir, engine_kw, mode):
    items = _items()
    solo_results, solo_grads = _solo(model_dir, items)

    e = _engine(model_dir, kernels=mode, **engine_kw)
    # r2 already holds gradients from an earlier forward_backward; its forward_only item in
    # the co-batched pass must leave them exactly as they are.
    prior = e.forward_backward([FwdBwdItem("r2", items[2].datums, "importance_sampling", None, False)])[0]
    assert prior.error is None
    r2_before = _grads(e, "r2")
    assert all(g is not None and torch.count_nonzero(g) > 0 for g in r2_before)

    results = e.forward_backward(items)
    for got, want in zip(results, solo_results):
        _assert_results_equal(got, want)

    # r4 had two items (cross_entropy + dro): its gradient is their sum
    _assert_grads_equal(_grads(e, "r4"), _sum_grads(solo_grads["r4"]))
    _assert_grads_equal(_grads(e, "r8"), _sum_grads(solo_grads["r8"]))
    for a, b in zip(_grads(e, "r2"), r2_before):
        assert torch.equal(a, b)
    # the forward_only item's solo run produced no gradient at all
    assert all(g is None for g in solo_grads["r2"][0])


def test_forward_only_rows_use_the_adapter(model_dir):
    """A forward_only row still gets its adapter's delta (logprobs differ from the base)."""
    e = _engine(model_dir)
    it = _items()[2]
    with_adapter = e.forward_backward([it])[0].loss_fn_outputs[0]["logprobs"]
    ids = torch.tensor([it.datums[0].tokens])
    tgt = torch.from_numpy(it.datums[0].loss_fn_inputs["target_tokens"])[None]
    with torch.no_grad():
        base = target_logprobs(e.model, ids, tgt, None, [None])[0].numpy()
    assert np.abs(with_adapter - base).max() > 1e-4


def test_rows_without_adapter_match_plain_base(model_dir):
    e = _engine(model_dir)
    plain = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    rng = np.random.RandomState(1)
    seqs = [list(_seq(rng, 9)), list(_seq(rng, 4))]
    ids, mask = pad_batch(seqs, 0)
    with torch.no_grad():
        lp = target_logprobs(e.model, ids, ids, mask, [None, "r8"])
        for b in (0,):
            ref = torch.log_softmax(plain(torch.tensor([seqs[b]])).logits.float(), -1)[0]
            want = ref.gather(-1, torch.tensor(seqs[b])[:, None])[:, 0]
            torch.testing.assert_close(lp[b, : len(seqs[b])], want, atol=1e-5, rtol=1e-5)
    assert torch.all(lp[1, 4:] == 0)  # padded positions are exactly 0


@pytest.mark.parametrize("rows", [["r8", None, "r4"], ["r8", "r4", "r8", None], ["r4", "r4", "r4"]])
def test_delta_formula_matches_manual_lora(model_dir, rows, mode):
    """One wrapped linear: y = x W^T + (x A^T) B^T * alpha/rank on the routed rows only
    (contiguous rows use slices, interleaved rows the gather/scatter path)."""
    e = _engine(model_dir, kernels=mode)
    path = "model.layers.0.self_attn.q_proj"
    layer = e.model._layers[path]
    x = torch.randn(len(rows), 5, layer.in_features)
    with torch.no_grad(), e.model.use_adapters(rows):
        assert (e.model._router.current.segments is None) == (rows == ["r8", "r4", "r8", None])
        y = layer(x)
    w = layer.base_layer.weight
    for b, name in enumerate(rows):
        want = x[b] @ w.t()
        if name is not None:
            s = SPECS[name].resolved_alpha / SPECS[name].rank
            want = want + (x[b] @ layer.lora_A[name].t()) @ layer.lora_B[name].t() * s
        torch.testing.assert_close(y[b], want, atol=1e-6, rtol=1e-5)


def test_row_order_does_not_matter(model_dir, mode):
    """Interleaved rows (gather/scatter path) give the same logprobs and gradients as the
    same rows grouped by adapter (slice path)."""
    rng = np.random.RandomState(5)
    seqs = [list(_seq(rng, n)) for n in (9, 6, 11, 7, 8)]
    names = ["r4", "r8", "r4", None, "r2"]
    perm = [0, 2, 1, 3, 4]  # grouped: r4 r4 r8 None r2

    def run(order):
        e = _engine(model_dir, kernels=mode)
        ids, mask = pad_batch([seqs[i] for i in order], 0)
        lp = target_logprobs(e.model, ids, ids, mask, [names[i] for i in order])
        lp.sum().backward()
        inv = torch.tensor([order.index(i) for i in range(len(order))])
        return lp[inv], {n: _grads(e, n) for n in SPECS}

    lp_a, g_a = run(list(range(5)))
    lp_b, g_b = run(perm)
    torch.testing.assert_close(lp_a, lp_b, atol=1e-5, rtol=1e-5)
    for n in SPECS:
        _assert_grads_equal(g_a[n], g_b[n])


def test_peft_round_trip(model_dir, tmp_path):
    from peft import PeftModel

    e = _engine(model_dir)
    out = tmp_path / "adapter"
    e.export_sampler_weights("r8", out)
    assert (out / "adapter_model.safetensors").is_file() and (out / "adapter_config.json").is_file()

    rng = np.random.RandomState(3)
    ids = torch.tensor([list(_seq(rng, 11)), list(_seq(rng, 11))])
    with torch.no_grad(), e.model.use_adapters(["r8", "r8"]):
        ours = e.model(ids).logits

    base = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    peft_model = PeftModel.from_pretrained(base, out).eval()
    with torch.no_grad():
        theirs = peft_model(input_ids=ids).logits
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)
    # and the adapter really changes the output
    plain = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    with torch.no_grad():
        assert (plain(input_ids=ids).logits - theirs).abs().max() > 1e-3

    # load_peft_adapter into another MultiLoRAModel reproduces the same logits
    m2 = MultiLoRAModel(AutoModelForCausalLM.from_pretrained(model_dir).eval())
    load_peft_adapter(m2, "x", out)
    assert m2.adapter_spec("x").rank == 8 and m2.adapter_spec("x").resolved_alpha == 16
    with torch.no_grad(), m2.use_adapters(["x", "x"]):
        torch.testing.assert_close(m2(ids).logits, ours, atol=0, rtol=0)


def test_peft_round_trip_partial_targets(model_dir, tmp_path):
    """r2 adapts attention + lm_head only: PEFT config lists exactly those targets."""
    import json

    e = _engine(model_dir)
    e.export_sampler_weights("r2", tmp_path)
    cfg = json.loads((tmp_path / "adapter_config.json").read_text())
    assert sorted(cfg["target_modules"]) == sorted(["q_proj", "k_proj", "v_proj", "o_proj", "lm_head"])
    assert cfg["r"] == 2 and cfg["lora_alpha"] == 32 and cfg["peft_type"] == "LORA"


def test_fused_logprob_head_matches_checkpointed(model_dir):
    """The fused vocabulary projection (gradient precomputed in the forward; used when the
    unembedding has no LoRA and there is one target per position) gives the logprobs and
    adapter gradients of the checkpointed two-pass path, on a right-padded batch (run with
    no attention mask) and a left-padded one (masked)."""
    rng = np.random.RandomState(11)
    seqs = [list(_seq(rng, n)) for n in (9, 6, 11)]
    names = ["a", "b", "a"]

    def run(fused: bool, side: str):
        e = TrainerEngine(model_dir)
        for i, n in enumerate(("a", "b")):
            e.create_run(n, LoraSpec(rank=4, seed=i, train_unembed=False))
            g = torch.Generator().manual_seed(i)
            with torch.no_grad():
                for p in e.model.adapter_parameters(n):
                    p.add_(torch.randn(p.shape, generator=g) * 0.05)
        ids, mask = pad_batch(seqs, 0, side=side)
        lp = target_logprobs(e.model, ids, ids.roll(-1, 1), mask, names, chunk_tokens=7, fused_head=fused)
        w = torch.linspace(-1, 2, lp.numel()).view_as(lp)
        (lp * w).sum().backward()
        return lp.detach(), {n: _grads(e, n) for n in ("a", "b")}

    for side in ("right", "left"):
        lp_ref, g_ref = run(False, side)
        lp_f, g_f = run(True, side)
        torch.testing.assert_close(lp_f, lp_ref, atol=1e-5, rtol=1e-5)
        for n in g_ref:
            _assert_grads_equal(g_f[n], g_ref[n])


def test_fused_logprob_function_softcap_gradcheck():
    """_FusedTargetLogprob against autograd through log_softmax, float64, with a softcap."""
    from openrl.model.logprobs import _FusedTargetLogprob

    g = torch.Generator().manual_seed(0)
    h = torch.randn(7, 5, generator=g, dtype=torch.float64, requires_grad=True)
    W = torch.randn(11, 5, generator=g, dtype=torch.float64)
    t = torch.randint(0, 11, (7,), generator=g)
    for cap in (None, 3.0):
        lp = _FusedTargetLogprob.apply(h, W, t, 3, cap)
        z = h @ W.t()
        if cap:
            z = torch.tanh(z / cap) * cap
        ref = torch.log_softmax(z, -1).gather(-1, t[:, None])[:, 0]
        torch.testing.assert_close(lp.double(), ref)
        w = torch.randn(7, generator=g, dtype=torch.float64)
        (ga,) = torch.autograd.grad((lp * w).sum(), h)
        (gb,) = torch.autograd.grad((ref * w).sum(), h)
        torch.testing.assert_close(ga, gb, atol=1e-6, rtol=1e-5)  # lp is float32: so is dL/dlp


def test_accelerate_model_leaves_cpu_numerics_alone(model_dir):
    """accelerate_model patches norms / MLPs / rotary for CUDA tensors only: on CPU the
    logits are bit-identical."""
    from openrl.model.kernels import accelerate_model

    base = AutoModelForCausalLM.from_pretrained(model_dir)
    ids = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        before = base(input_ids=ids).logits
        status = accelerate_model(base, compile=False)
        after = base(input_ids=ids).logits
    assert "2 mlps" in status["patched"] and status["rms_norm"] in ("eager", "liger")
    assert torch.equal(before, after)
