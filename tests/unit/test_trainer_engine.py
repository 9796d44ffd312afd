"""TrainerEngine: SFT learns, AdamW honours every AdamParams field, state round-trips,
seeded init is deterministic, bad items fail alone."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from functions.trainer.engine import Datum, FwdBwdItem, TrainerEngine
from openrl.errors import NotFound, UserError
from openrl.model.lora import LoraSpec

VOCAB = 512


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def model_dir(micro_model_dir):
    return micro_model_dir  # tests/conftest.py, tests/micro_model.py


@pytest.fixture(scope="module")
def engine(model_dir):
    return TrainerEngine(model_dir)


def _sft_datum(seed=0, n=33):
    seq = np.random.RandomState(seed).randint(0, VOCAB, size=n).astype(np.int64)
    return Datum(list(seq[:-1]), {"target_tokens": seq[1:], "weights": np.ones(n - 1, np.float32)})


def _sft(model_id, datums, forward_only=False):
    return FwdBwdItem(model_id, datums, "cross_entropy", None, forward_only)


def _params(e, run):
    return [p.detach().clone() for p in e.model.adapter_parameters(run)]


def _logprobs(e, run, datum):
    r = e.forward_backward([_sft(run, [datum], forward_only=True)])[0]
    assert r.error is None
    return r.loss_fn_outputs[0]["logprobs"]


# ----------------------------------------------------------------------------- SFT


def test_sft_memorises_one_sequence(engine):
    """rank 16, lr 1e-2 (tiny model): loss:sum falls by more than half within 25 steps."""
    engine.create_run("sft", LoraSpec(rank=16, seed=0))
    d = _sft_datum()
    losses = []
    for _ in range(25):
        r = engine.forward_backward([_sft("sft", [d])])[0]
        assert r.error is None
        losses.append(r.metrics["loss:sum"])
        m = engine.optim_step("sft", {"learning_rate": 1e-2})
        assert set(m) == {"grad_norm:mean", "learning_rate:mean"}
    # initial loss ~ 32 tokens * ln(512) for a near-uniform random model
    assert losses[0] == pytest.approx(32 * math.log(VOCAB), rel=0.05)
    assert losses[-1] < 0.5 * losses[0], losses
    engine.delete_run("sft")


def test_forward_only_makes_no_gradient(engine):
    engine.create_run("fo", LoraSpec(rank=4, seed=0))
    engine.forward_backward([_sft("fo", [_sft_datum()], forward_only=True)])
    assert all(p.grad is None for p in engine.model.adapter_parameters("fo"))
    engine.delete_run("fo")


def test_gradients_accumulate_until_optim_step(engine):
    engine.create_run("acc", LoraSpec(rank=4, seed=0))
    d = _sft_datum()
    engine.forward_backward([_sft("acc", [d])])
    g1 = [p.grad.clone() for p in engine.model.adapter_parameters("acc")]
    engine.forward_backward([_sft("acc", [d])])
    for p, g in zip(engine.model.adapter_parameters("acc"), g1):
        torch.testing.assert_close(p.grad, 2 * g)
    engine.optim_step("acc", {"learning_rate": 0.0})
    assert all(p.grad is None for p in engine.model.adapter_parameters("acc"))
    engine.delete_run("acc")


# ---------------------------------------------------------------------- AdamW


def test_lr_zero_leaves_weights_unchanged(engine):
    engine.create_run("lr0", LoraSpec(rank=4, seed=0))
    before = _params(engine, "lr0")
    engine.forward_backward([_sft("lr0", [_sft_datum()])])
    engine.optim_step("lr0", {"learning_rate": 0.0, "weight_decay": 0.1, "grad_clip_norm": 1.0})
    for a, b in zip(before, _params(engine, "lr0")):
        assert torch.equal(a, b)
    engine.delete_run("lr0")


def test_decoupled_weight_decay(engine):
    # no gradient: Adam's update is 0 and only p <- p * (1 - lr * wd) = p * 0.95 remains
    engine.create_run("wd", LoraSpec(rank=4, seed=0))
    before = _params(engine, "wd")
    engine.optim_step("wd", {"learning_rate": 0.1, "weight_decay": 0.5})
    for a, b in zip(before, _params(engine, "wd")):
        torch.testing.assert_close(b, a * 0.95)
    engine.delete_run("wd")


def _reference_adamw(params, grads_per_step, cfgs):
    """Plain-tensor AdamW (decoupled decay, bias correction) with global-norm clipping."""
    p = [x.double().clone() for x in params]
    m = [torch.zeros_like(x) for x in p]
    v = [torch.zeros_like(x) for x in p]
    for t, (grads, c) in enumerate(zip(grads_per_step, cfgs), start=1):
        g = [x.double() for x in grads]
        if c["grad_clip_norm"] > 0:
            norm = math.sqrt(sum(float((x * x).sum()) for x in g))
            g = [x * min(1.0, c["grad_clip_norm"] / (norm + 1e-6)) for x in g]
        lr, b1, b2 = c["learning_rate"], c["beta1"], c["beta2"]
        for i in range(len(p)):
            p[i] = p[i] * (1 - lr * c["weight_decay"])
            m[i] = b1 * m[i] + (1 - b1) * g[i]
            v[i] = b2 * v[i] + (1 - b2) * g[i] * g[i]
            mh, vh = m[i] / (1 - b1**t), v[i] / (1 - b2**t)
            p[i] = p[i] - lr * mh / (vh.sqrt() + c["eps"])
    return p


def test_adam_params_all_honoured(engine):
    """Two steps with non-default beta1/beta2/eps/weight_decay and clipping in step 1 only
    match a hand-written AdamW."""
    engine.create_run("adam", LoraSpec(rank=4, seed=5))
    with torch.no_grad():  # make A and B both non-trivial
        for p in engine.model.adapter_parameters("adam"):
            p.add_(0.01)
    p0 = _params(engine, "adam")
    cfgs = [
        dict(learning_rate=0.01, beta1=0.5, beta2=0.7, eps=1e-2, weight_decay=0.1, grad_clip_norm=0.5),
        dict(learning_rate=0.003, beta1=0.5, beta2=0.7, eps=1e-2, weight_decay=0.1, grad_clip_norm=1e9),
    ]
    grads, norms = [], []
    for c in cfgs:
        engine.forward_backward([_sft("adam", [_sft_datum(seed=1)])])
        g = [p.grad.clone() for p in engine.model.adapter_parameters("adam")]
        grads.append(g)
        norms.append(math.sqrt(sum(float((x.double() ** 2).sum()) for x in g)))
        m = engine.optim_step("adam", c)
        assert m["grad_norm:mean"] == pytest.approx(norms[-1], rel=1e-5)
        assert m["learning_rate:mean"] == c["learning_rate"]
    assert norms[0] > cfgs[0]["grad_clip_norm"]  # step 1 really clipped
    want = _reference_adamw(p0, grads, cfgs)
    for got, w in zip(_params(engine, "adam"), want):
        torch.testing.assert_close(got.double(), w, atol=1e-6, rtol=1e-5)

    # and clipping changed the result: without it the first step would differ
    unclipped = _reference_adamw(p0, grads[:1], [dict(cfgs[0], grad_clip_norm=0.0)])
    clipped = _reference_adamw(p0, grads[:1], cfgs[:1])
    assert max(float((a - b).abs().max()) for a, b in zip(unclipped, clipped)) > 1e-4
    engine.delete_run("adam")


@pytest.mark.parametrize(
    "adam,field",
    [
        ({"learning_rate": -1.0}, "adam_params.learning_rate"),
        ({"beta1": 1.0}, "adam_params.beta1"),
        ({"beta2": -0.1}, "adam_params.beta2"),
        ({"eps": float("nan")}, "adam_params.eps"),
        ({"grad_clip_norm": -1}, "adam_params.grad_clip_norm"),
        ({"momentum": 0.9}, "adam_params.momentum"),
        ({"learning_rate": "fast"}, "adam_params.learning_rate"),
    ],
)
def test_bad_adam_params(engine, adam, field):
    engine.create_run("bad-adam", LoraSpec(rank=2, seed=0))
    try:
        with pytest.raises(UserError) as e:
            engine.optim_step("bad-adam", adam)
        assert e.value.field == field
    finally:
        engine.delete_run("bad-adam")


# ---------------------------------------------------------------------- state


def _train(e, run, steps, seed=0):
    for _ in range(steps):
        e.forward_backward([_sft(run, [_sft_datum(seed)])])
        e.optim_step(run, {"learning_rate": 1e-2, "weight_decay": 0.01})


def test_save_load_state_round_trip(engine, model_dir, tmp_path):
    engine.create_run("ck", LoraSpec(rank=8, seed=3, train_unembed=False))
    _train(engine, "ck", 3)
    probe = _sft_datum(seed=9)
    want = _logprobs(engine, "ck", probe)
    engine.save_state("ck", tmp_path)
    assert {p.name for p in tmp_path.iterdir()} >= {
        "adapter_model.safetensors", "adapter_config.json", "optimizer.pt", "run.json"}
    meta = json.loads((tmp_path / "run.json").read_text())
    assert meta["spec"]["rank"] == 8 and meta["spec"]["seed"] == 3 and meta["optimizer_steps"] == 3

    other = TrainerEngine(model_dir)
    other.load_state("restored", tmp_path, with_optimizer=True)
    assert other.run_spec("restored") == engine.run_spec("ck")
    np.testing.assert_array_equal(_logprobs(other, "restored", probe), want)
    sa, sb = engine.runs["ck"].optimizer.state_dict(), other.runs["restored"].optimizer.state_dict()
    assert sa["steps"] == sb["steps"] == 3 and sa["state"].keys() == sb["state"].keys()
    for k in sa["state"]:
        for f in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(sa["state"][k][f], sb["state"][k][f])

    # training continues identically from the restored state
    _train(engine, "ck", 2, seed=4)
    _train(other, "restored", 2, seed=4)
    for a, b in zip(_params(engine, "ck"), _params(other, "restored")):
        assert torch.equal(a, b)

    # without optimizer: same weights, fresh optimizer
    other.load_state("fresh", tmp_path, with_optimizer=False)
    np.testing.assert_array_equal(_logprobs(other, "fresh", probe), want)
    assert other.runs["fresh"].optimizer.steps == 0 and not other.runs["fresh"].optimizer.state_dict()["state"]
    engine.delete_run("ck")


def test_load_state_replaces_existing_run_and_clears_grads(engine, tmp_path):
    engine.create_run("src", LoraSpec(rank=4, seed=1))
    _train(engine, "src", 2)
    engine.save_state("src", tmp_path)
    engine.create_run("dst", LoraSpec(rank=4, seed=2))
    engine.forward_backward([_sft("dst", [_sft_datum()])])  # pending grads
    engine.load_state("dst", tmp_path, with_optimizer=True, spec=LoraSpec(rank=4))
    assert all(p.grad is None for p in engine.model.adapter_parameters("dst"))
    for a, b in zip(_params(engine, "src"), _params(engine, "dst")):
        assert torch.equal(a, b)
    engine.delete_run("src")
    engine.delete_run("dst")


def test_load_state_errors_leave_run_untouched(engine, tmp_path):
    engine.create_run("e1", LoraSpec(rank=4, seed=1))
    engine.export_sampler_weights("e1", tmp_path / "sampler")
    assert {p.name for p in (tmp_path / "sampler").iterdir()} == {"adapter_model.safetensors", "adapter_config.json"}
    engine.create_run("e2", LoraSpec(rank=2, seed=2))
    before = _params(engine, "e2")
    with pytest.raises(UserError) as e:  # sampler weights have no optimizer state
        engine.load_state("e2", tmp_path / "sampler", with_optimizer=True)
    assert e.value.field == "checkpoint"
    with pytest.raises(UserError):  # rank mismatch with the caller's spec
        engine.load_state("e2", tmp_path / "sampler", with_optimizer=False, spec=LoraSpec(rank=2))
    with pytest.raises(UserError):  # nothing there
        engine.load_state("e2", tmp_path / "missing", with_optimizer=False)
    assert engine.run_spec("e2").rank == 2
    for a, b in zip(before, _params(engine, "e2")):
        assert torch.equal(a, b)
    # a bare PEFT adapter loads without optimizer
    engine.load_state("e2", tmp_path / "sampler", with_optimizer=False)
    assert engine.run_spec("e2").rank == 4
    engine.delete_run("e1")
    engine.delete_run("e2")


def test_state_dict_round_trip(engine):
    engine.create_run("sd", LoraSpec(rank=4, seed=1))
    _train(engine, "sd", 2)
    st = engine.state_dict("sd")
    engine.load_state_dict("sd2", st, with_optimizer=True)
    for a, b in zip(_params(engine, "sd"), _params(engine, "sd2")):
        assert torch.equal(a, b)
    assert engine.runs["sd2"].optimizer.steps == 2
    with pytest.raises(UserError):
        engine.load_state_dict("sd3", engine.state_dict("sd", with_optimizer=False), with_optimizer=True)
    assert not engine.has_run("sd3")
    for r in ("sd", "sd2"):
        engine.delete_run(r)


# ----------------------------------------------------------------------- seeds


def test_seeded_init_is_deterministic(engine, model_dir):
    engine.create_run("s1", LoraSpec(rank=4, seed=42))
    engine.create_run("s2", LoraSpec(rank=4, seed=42))
    engine.create_run("s3", LoraSpec(rank=4, seed=43))
    other = TrainerEngine(model_dir)
    other.create_run("s1", LoraSpec(rank=4, seed=42))
    p1, p2, p3, q1 = (_params(engine, "s1"), _params(engine, "s2"), _params(engine, "s3"), _params(other, "s1"))
    assert all(torch.equal(a, b) for a, b in zip(p1, p2))
    assert all(torch.equal(a, b) for a, b in zip(p1, q1))
    a_mats = [i for i in range(0, len(p1), 2)]  # lora_A entries; B is zero for every seed
    assert all(not torch.equal(p1[i], p3[i]) for i in a_mats)
    assert all(torch.count_nonzero(p1[i + 1]) == 0 for i in a_mats)
    # kaiming-uniform(a=sqrt(5)) bound is 1/sqrt(fan_in) = 1/sqrt(32)
    assert max(float(p1[i].abs().max()) for i in a_mats) <= 1 / math.sqrt(32) + 1e-7
    engine.create_run("s4", LoraSpec(rank=4))  # no seed: a random one is drawn and recorded
    assert engine.run_spec("s4").seed is not None and engine.run_spec("s4").alpha == 32
    for r in ("s1", "s2", "s3", "s4"):
        engine.delete_run(r)


def test_a_prepared_run_is_the_same_run(engine):
    """``prepare_run`` (the trainer runs it outside its engine lock) makes the adapter's tensors
    without touching the model; ``create_run`` with them gives the same bits as creating in one
    go, and the seed it drew is the one recorded."""
    before = {n for n, _ in engine.model.named_parameters()}
    prepared = engine.prepare_run(LoraSpec(rank=4))
    assert {n for n, _ in engine.model.named_parameters()} == before and not engine.has_run("p1")
    engine.create_run("p1", LoraSpec(rank=4), prepared)
    engine.create_run("p2", LoraSpec(rank=4, seed=prepared.spec.seed))
    assert engine.run_spec("p1") == engine.run_spec("p2") == prepared.spec
    assert all(torch.equal(a, b) for a, b in zip(_params(engine, "p1"), _params(engine, "p2")))
    with pytest.raises(ValueError, match="already exists"):
        engine.create_run("p1", LoraSpec(rank=4), engine.prepare_run(LoraSpec(rank=4)))
    with pytest.raises(UserError, match="lora_config"):
        engine.prepare_run(LoraSpec(rank=0))
    for r in ("p1", "p2"):
        engine.delete_run(r)


# ----------------------------------------------------------------- validation


def test_bad_items_fail_alone(engine):
    engine.create_run("ok", LoraSpec(rank=4, seed=0))
    good = _sft("ok", [_sft_datum()])
    d = _sft_datum()
    rl_missing = FwdBwdItem("ok", [Datum(d.tokens, {"target_tokens": d.loss_fn_inputs["target_tokens"]})],
                            "ppo", None, False)
    unknown_run = _sft("nobody", [d])
    unknown_loss = FwdBwdItem("ok", [d], "custom", None, False)
    bad_key = FwdBwdItem("ok", [d], "cross_entropy", {"clip_low_threshold": 0.8}, False)
    short = Datum(d.tokens[:5], {"target_tokens": d.loss_fn_inputs["target_tokens"]})
    mismatch = _sft("ok", [d, short])
    oov = _sft("ok", [Datum([VOCAB + 1] * 32, d.loss_fn_inputs)])
    empty = _sft("ok", [Datum([], {"target_tokens": np.zeros(0, np.int64)})])

    res = engine.forward_backward([good, rl_missing, unknown_run, unknown_loss, bad_key, mismatch, oov, empty])
    alone = engine.forward_backward([good])[0]
    assert res[0].error is None
    assert res[0].metrics["loss:sum"] == pytest.approx(alone.metrics["loss:sum"], rel=1e-6)
    fields = [getattr(r.error, "field", None) for r in res[1:]]
    assert fields == [
        "data[0].loss_fn_inputs.logprobs",
        "model_id",
        "loss_fn",
        "loss_fn_config.clip_low_threshold",
        "data[1].loss_fn_inputs.target_tokens",
        "data[0].model_input",
        "data[0].model_input",
    ]
    assert isinstance(res[2].error, NotFound)
    assert all(r.loss_fn_outputs == [] for r in res[1:])
    engine.delete_run("ok")


def test_optim_step_unknown_run(engine):
    with pytest.raises(NotFound):
        engine.optim_step("ghost", {"learning_rate": 1e-3})


def test_invalid_lora_spec(engine):
    with pytest.raises(UserError) as e:
        engine.create_run("r0", LoraSpec(rank=0))
    assert e.value.field == "lora_config.rank"
    with pytest.raises(UserError):
        engine.create_run("none", LoraSpec(rank=2, train_attn=False, train_mlp=False, train_unembed=False))
    assert not engine.has_run("r0") and not engine.has_run("none")


def test_a_non_finite_loss_fails_the_pass_and_keeps_gradients(engine):
    """The losses of a micro-batch are read in one transfer (TrainerEngine._read_rows): a datum
    whose loss overflows still fails the whole pass before any backward, naming the datum, and
    every run's gradients stay as they were; the other datums' results are not half-written."""
    engine.create_run("nonfinite", LoraSpec(rank=4, seed=3))
    engine.forward_backward([_sft("nonfinite", [_sft_datum(1)])])
    before = [p.grad.clone() for p in engine.model.adapter_parameters("nonfinite")]
    seq = np.random.RandomState(5).randint(0, VOCAB, size=20).astype(np.int64)
    ok = Datum(list(seq[:-1]), {"target_tokens": seq[1:], "logprobs": np.full(19, -1.0, np.float32),
                                "advantages": np.ones(19, np.float32)})
    # exp(lp - q) with q = -200 overflows float32: the loss is -inf
    bad = Datum(list(seq[:-1]), {"target_tokens": seq[1:], "logprobs": np.full(19, -200.0, np.float32),
                                 "advantages": np.ones(19, np.float32)})
    res = engine.forward_backward([FwdBwdItem("nonfinite", [ok, bad], "importance_sampling")])
    assert res[0].error is not None and "non-finite loss for nonfinite datum 1" in str(res[0].error)
    for p, g in zip(engine.model.adapter_parameters("nonfinite"), before):
        assert torch.equal(p.grad, g)
    engine.delete_run("nonfinite")
