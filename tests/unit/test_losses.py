"""Tinker loss functions: values and gradients against hand-computed numbers; validation errors.

Every expected number here is worked out by hand in the comments (not by calling the code
under test).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from functions.trainer import losses
from openrl.errors import UserError


def _lp(values):
    return torch.tensor(values, dtype=torch.float32, requires_grad=True)


def _t(values):
    return torch.tensor(values, dtype=torch.float32)


def _run(name, lp, inputs, config=None):
    cfg = losses.resolve_config(name, config)
    inputs = {"target_tokens": torch.zeros(lp.shape, dtype=torch.long), **inputs}
    loss, outputs, metrics = losses.compute_loss(name, lp, inputs, cfg)
    loss.backward()
    return loss.item(), lp.grad.clone(), outputs, metrics


# ------------------------------------------------------------------ cross_entropy


def test_cross_entropy_negative_and_fractional_weights():
    # loss = -sum(lp * w) = -(-1*1 + -2*-0.5 + -0.5*0.25) = -(-1 + 1 - 0.125) = 0.125
    lp = _lp([-1.0, -2.0, -0.5])
    loss, grad, outputs, metrics = _run("cross_entropy", lp, {"weights": _t([1.0, -0.5, 0.25])})
    assert loss == pytest.approx(0.125, abs=1e-6)
    assert metrics == {"loss:sum": pytest.approx(0.125, abs=1e-6)}
    # d loss / d lp = -w
    torch.testing.assert_close(grad, _t([-1.0, 0.5, -0.25]))
    torch.testing.assert_close(outputs["logprobs"], _t([-1.0, -2.0, -0.5]))
    assert outputs["logprobs"].dtype == torch.float32


def test_cross_entropy_default_weights_are_one():
    # -(-1 - 2) = 3
    loss, grad, _, _ = _run("cross_entropy", _lp([-1.0, -2.0]), {})
    assert loss == pytest.approx(3.0)
    torch.testing.assert_close(grad, _t([-1.0, -1.0]))


def test_cross_entropy_two_d_targets():
    # lp [[-1, -2], [-0.5, -3]], w [[0.5, 0.5], [1, 0]]
    # loss = -(-0.5 - 1 - 0.5 + 0) = 2.0
    lp = _lp([[-1.0, -2.0], [-0.5, -3.0]])
    loss, grad, outputs, _ = _run("cross_entropy", lp, {"weights": _t([[0.5, 0.5], [1.0, 0.0]])})
    assert loss == pytest.approx(2.0)
    torch.testing.assert_close(grad, _t([[-0.5, -0.5], [-1.0, 0.0]]))
    assert outputs["logprobs"].shape == (2, 2)


# ------------------------------------------------------------ importance_sampling


def test_importance_sampling():
    # ratio = p/q = [0.5/0.25, 0.25/0.5] = [2, 0.5]; A = [1, -2]
    # loss = -(2*1 + 0.5*(-2)) = -1 ; d loss/d lp = -ratio*A = [-2, 1]
    lp = _lp([math.log(0.5), math.log(0.25)])
    inputs = {"logprobs": _t([math.log(0.25), math.log(0.5)]), "advantages": _t([1.0, -2.0])}
    loss, grad, _, _ = _run("importance_sampling", lp, inputs)
    assert loss == pytest.approx(-1.0, abs=1e-5)
    torch.testing.assert_close(grad, _t([-2.0, 1.0]))


# ------------------------------------------------------------------------- ppo

# ratios r = [2.0, 0.5, 1.1, 0.5], advantages A = [1, 1, -1, -1]
_PPO_R = [2.0, 0.5, 1.1, 0.5]
_PPO_A = [1.0, 1.0, -1.0, -1.0]


def _ppo_case():
    lp = _lp([-1.0, -1.0, -1.0, -1.0])
    q = _t([-1.0 - math.log(r) for r in _PPO_R])  # so that exp(lp - q) = r
    return lp, {"logprobs": q, "advantages": _t(_PPO_A)}


def test_ppo_default_clipping():
    # defaults clip(r, 0.8, 1.2):
    # t0 r=2,  A=1 : min(2, 1.2)      = 1.2   (clipped -> no gradient)
    # t1 r=.5, A=1 : min(.5, .8)      = .5    (unclipped, d obj/d lp = r*A = .5)
    # t2 r=1.1,A=-1: min(-1.1, -1.1)  = -1.1  (inside the range, d obj/d lp = -1.1)
    # t3 r=.5, A=-1: min(-.5, -.8)    = -.8   (clipped -> no gradient)
    # objective = 1.2 + .5 - 1.1 - .8 = -0.2 -> loss = 0.2
    lp, inputs = _ppo_case()
    loss, grad, _, _ = _run("ppo", lp, inputs)
    assert loss == pytest.approx(0.2, abs=1e-5)
    torch.testing.assert_close(grad, _t([0.0, -0.5, 1.1, 0.0]))


def test_ppo_config_thresholds():
    # clip(r, 0.9, 1.05): t0 min(2, 1.05)=1.05 ; t1 min(.5,.9)=.5 ; t2 min(-1.1,-1.05)=-1.1 ;
    # t3 min(-.5,-.9)=-.9 -> objective = 1.05 + .5 - 1.1 - .9 = -0.45 -> loss 0.45
    lp, inputs = _ppo_case()
    loss, grad, _, _ = _run("ppo", lp, inputs, {"clip_low_threshold": 0.9, "clip_high_threshold": 1.05})
    assert loss == pytest.approx(0.45, abs=1e-5)
    torch.testing.assert_close(grad, _t([0.0, -0.5, 1.1, 0.0]))


def test_ppo_per_token_thresholds_override_config():
    # lo = [.8, .8, .8, .4], hi = [3, 1.2, 1.2, 1.2]
    # t0 min(2, 2)=2 (inside [.8, 3]) ; t1 .5 ; t2 -1.1 ; t3 min(-.5, -.5) = -.5 (inside [.4, 1.2])
    # objective = 2 + .5 - 1.1 - .5 = 0.9 -> loss -0.9 ; every token now has gradient -r*A
    lp, inputs = _ppo_case()
    inputs["clip_low_threshold"] = _t([0.8, 0.8, 0.8, 0.4])
    inputs["clip_high_threshold"] = _t([3.0, 1.2, 1.2, 1.2])
    loss, grad, _, _ = _run("ppo", lp, inputs)
    assert loss == pytest.approx(-0.9, abs=1e-5)
    torch.testing.assert_close(grad, _t([-2.0, -0.5, 1.1, 0.5]))


# ----------------------------------------------------------------------- cispo


def _cispo_case():
    # lp = [-1, -2, -0.5], ratios r = [2, 0.5, 5], A = [1, -1, 1]
    lp = _lp([-1.0, -2.0, -0.5])
    q = _t([-1.0 - math.log(2.0), -2.0 - math.log(0.5), -0.5 - math.log(5.0)])
    return lp, {"logprobs": q, "advantages": _t([1.0, -1.0, 1.0])}


def test_cispo_default_clipping():
    # defaults clip(r, 0, 4): coef = [2, .5, 4] (stop-gradient)
    # loss = -sum(coef*A*lp) = -(2*1*-1 + .5*-1*-2 + 4*1*-.5) = -(-2 + 1 - 2) = 3
    # d loss/d lp = -coef*A = [-2, .5, -4]  (the coefficient gets no gradient)
    lp, inputs = _cispo_case()
    loss, grad, _, _ = _run("cispo", lp, inputs)
    assert loss == pytest.approx(3.0, abs=1e-5)
    torch.testing.assert_close(grad, _t([-2.0, 0.5, -4.0]))


def test_cispo_config_thresholds():
    # clip(r, .8, 1.2): coef = [1.2, .8, 1.2]
    # loss = -(1.2*1*-1 + .8*-1*-2 + 1.2*1*-.5) = -(-1.2 + 1.6 - .6) = 0.2 ; grad = [-1.2, .8, -1.2]
    lp, inputs = _cispo_case()
    loss, grad, _, _ = _run("cispo", lp, inputs, {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2})
    assert loss == pytest.approx(0.2, abs=1e-5)
    torch.testing.assert_close(grad, _t([-1.2, 0.8, -1.2]))


# ------------------------------------------------------------------------- dro


def _dro_case():
    # lp = [-1, -2], q = [-1.5, -1], A = [1, -1]  ->  lp - q = [0.5, -1]
    return _lp([-1.0, -2.0]), {"logprobs": _t([-1.5, -1.0]), "advantages": _t([1.0, -1.0])}


def test_dro_beta():
    # beta = 0.1: objective = A*lp - 0.05*(lp-q)^2 = [-1 - .0125, 2 - .05] = [-1.0125, 1.95]
    # loss = -(0.9375) = -0.9375 ; d loss/d lp = -(A - beta*(lp-q)) = [-(1 - .05), -(-1 + .1)] = [-.95, .9]
    lp, inputs = _dro_case()
    loss, grad, _, _ = _run("dro", lp, inputs, {"beta": 0.1})
    assert loss == pytest.approx(-0.9375, abs=1e-6)
    torch.testing.assert_close(grad, _t([-0.95, 0.9]))


def test_dro_default_beta_is_0_05():
    # beta = 0.05: [-1 - .025*.25, 2 - .025*1] = [-1.00625, 1.975] -> loss = -0.96875
    lp, inputs = _dro_case()
    loss, _, _, _ = _run("dro", lp, inputs)
    assert loss == pytest.approx(-0.96875, abs=1e-6)


# ---------------------------------------------------------------------- errors


@pytest.mark.parametrize("name", ["nope", "custom", ""])
def test_unknown_loss_fn(name):
    with pytest.raises(UserError) as e:
        losses.resolve_config(name, None)
    assert e.value.field == "loss_fn"


@pytest.mark.parametrize(
    "name,config,field",
    [
        ("ppo", {"eps": 0.1}, "loss_fn_config.eps"),
        ("cross_entropy", {"beta": 1.0}, "loss_fn_config.beta"),
        ("dro", {"clip_low_threshold": 0.8}, "loss_fn_config.clip_low_threshold"),
        ("ppo", {"clip_low_threshold": "low"}, "loss_fn_config.clip_low_threshold"),
        ("ppo", {"clip_high_threshold": float("nan")}, "loss_fn_config.clip_high_threshold"),
        ("ppo", {"clip_low_threshold": 1.5, "clip_high_threshold": 1.2}, "loss_fn_config.clip_high_threshold"),
        ("cispo", {"clip_low_threshold": -0.1}, "loss_fn_config.clip_low_threshold"),
        ("dro", {"beta": -1.0}, "loss_fn_config.beta"),
    ],
)
def test_bad_config(name, config, field):
    with pytest.raises(UserError) as e:
        losses.resolve_config(name, config)
    assert e.value.field == field


def test_config_defaults_filled():
    assert losses.resolve_config("ppo", None) == {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}
    assert losses.resolve_config("cispo", {}) == {"clip_low_threshold": 0.0, "clip_high_threshold": 4.0}
    assert losses.resolve_config("dro", {"beta": 1}) == {"beta": 1.0}
    assert losses.resolve_config("cross_entropy", None) == {}


def _rl_inputs(n):
    return {
        "target_tokens": np.arange(n, dtype=np.int64),
        "logprobs": np.full(n, -1.0, np.float32),
        "advantages": np.ones(n, np.float32),
    }


@pytest.mark.parametrize(
    "name,mutate,field",
    [
        ("ppo", lambda d: d.pop("advantages"), "data[3].loss_fn_inputs.advantages"),
        ("importance_sampling", lambda d: d.pop("logprobs"), "data[3].loss_fn_inputs.logprobs"),
        ("cross_entropy", lambda d: d.pop("target_tokens"), "data[3].loss_fn_inputs.target_tokens"),
        ("ppo", lambda d: d.update(mask=np.ones(4, np.float32)), "data[3].loss_fn_inputs.mask"),
        ("ppo", lambda d: d.update(target_tokens=np.arange(5)), "data[3].loss_fn_inputs.target_tokens"),
        ("ppo", lambda d: d.update(advantages=np.ones(3, np.float32)), "data[3].loss_fn_inputs.advantages"),
        ("dro", lambda d: d.update(logprobs=np.array([0, np.nan, 0, 0], np.float32)), "data[3].loss_fn_inputs.logprobs"),
        ("ppo", lambda d: d.update(target_tokens=np.zeros((4, 2), np.int64)), "data[3].loss_fn_inputs.target_tokens"),
        ("ppo", lambda d: d.update(target_tokens=np.array([0, 1, 2, 99])), "data[3].loss_fn_inputs.target_tokens"),
        ("ppo", lambda d: d.update(target_tokens=np.array([0.5, 1, 2, 3])), "data[3].loss_fn_inputs.target_tokens"),
        ("ppo", lambda d: d.update(clip_low_threshold=np.ones(2, np.float32)), "data[3].loss_fn_inputs.clip_low_threshold"),
    ],
)
def test_bad_inputs(name, mutate, field):
    inputs = _rl_inputs(4)
    if name == "cross_entropy":
        inputs = {"target_tokens": inputs["target_tokens"], "weights": np.ones(4, np.float32)}
    mutate(inputs)
    with pytest.raises(UserError) as e:
        losses.prepare_inputs(name, inputs, n_tokens=4, index=3, vocab_size=10)
    assert e.value.field == field


def test_cross_entropy_weight_shape_must_match_targets():
    inputs = {"target_tokens": np.zeros((4, 2), np.int64), "weights": np.ones(4, np.float32)}
    with pytest.raises(UserError) as e:
        losses.prepare_inputs("cross_entropy", inputs, n_tokens=4, index=0)
    assert e.value.field == "data[0].loss_fn_inputs.weights"


# ------------------------------------------ inputs the loss does not read (issue 24 item 1)


@pytest.mark.parametrize("name", ["cross_entropy", "importance_sampling", "ppo", "cispo", "gspo", "dro"])
def test_known_inputs_a_loss_does_not_read_are_accepted_and_ignored(name):
    # the datum of Tinker's losses page (target_tokens, weights, logprobs, advantages) plus the
    # clip thresholds and sequence_ratio_mask: every loss accepts it and computes the loss (and the
    # gradient) of only the inputs it reads
    n = 4
    full = {"target_tokens": np.arange(n, dtype=np.int64), "weights": np.array([0, 0, 1, 1], np.float32),
            "logprobs": np.full(n, -1.0, np.float32), "advantages": np.array([0.0, 0.0, 1.0, -0.5], np.float32),
            "clip_low_threshold": np.full(n, 0.5, np.float32), "clip_high_threshold": np.full(n, 1.5, np.float32),
            "sequence_ratio_mask": np.ones(n, np.float32)}
    d = losses.get_loss(name)
    reads = {"target_tokens", *d.required, *d.optional}
    prepared = losses.prepare_inputs(name, full, n_tokens=n, index=0)
    assert set(prepared) == reads & set(full)
    only_read = losses.prepare_inputs(name, {k: v for k, v in full.items() if k in reads}, n_tokens=n, index=0)
    results = []
    for inputs in (prepared, only_read):
        lp = _lp([-0.9, -1.2, -0.7, -1.1])
        cfg = losses.resolve_config(name, None)
        loss, _, _ = losses.compute_loss(name, lp, inputs, cfg)
        loss.backward()
        results.append((loss.item(), lp.grad.clone()))
    assert results[0][0] == results[1][0]
    torch.testing.assert_close(results[0][1], results[1][1], rtol=0, atol=0)


def test_weights_do_not_mask_an_rl_loss():
    # importance_sampling reads target_tokens, logprobs, advantages (Tinker's documented
    # formula): loss = -sum(exp(lp - q) * A) with lp = q gives -sum(A) = -(1 + 1) = -2 whether
    # weights zero the first position or not
    n = 2
    base = {"target_tokens": np.arange(n), "logprobs": np.array([-1.0, -2.0], np.float32),
            "advantages": np.ones(n, np.float32)}
    for w in (None, np.array([0.0, 1.0], np.float32)):
        raw = dict(base) if w is None else {**base, "weights": w}
        inputs = losses.prepare_inputs("importance_sampling", raw, n_tokens=n, index=0)
        loss, _, _ = losses.compute_loss("importance_sampling", _lp([-1.0, -2.0]), inputs, {})
        assert loss.item() == pytest.approx(-2.0)


@pytest.mark.parametrize(
    "name,extra,field",
    [
        # known inputs the loss ignores are still checked: shape, finiteness, clip sign
        ("cross_entropy", {"advantages": np.ones(3, np.float32)}, "data[1].loss_fn_inputs.advantages"),
        ("cross_entropy", {"logprobs": np.array([0, np.inf, 0, 0], np.float32)}, "data[1].loss_fn_inputs.logprobs"),
        ("importance_sampling", {"weights": np.ones((4, 2), np.float32)}, "data[1].loss_fn_inputs.weights"),
        ("importance_sampling", {"clip_low_threshold": np.full(4, -1.0, np.float32)},
         "data[1].loss_fn_inputs.clip_low_threshold"),
        ("dro", {"sequence_ratio_mask": np.array([[1.0]] * 4, np.float32)}, "data[1].loss_fn_inputs.sequence_ratio_mask"),
        # a key that no loss knows is refused (the cookbook strips its client-side "mask")
        ("cross_entropy", {"mask": np.ones(4, np.float32)}, "data[1].loss_fn_inputs.mask"),
        ("importance_sampling", {"weight": np.ones(4, np.float32)}, "data[1].loss_fn_inputs.weight"),
        ("ppo", {losses.RECORDED_LOGPROBS: np.ones(4, np.float32)}, f"data[1].loss_fn_inputs.{losses.RECORDED_LOGPROBS}"),
    ],
)
def test_extra_inputs_are_still_validated(name, extra, field):
    raw = {**_rl_inputs(4), "weights": np.ones(4, np.float32)}
    if name == "cross_entropy":
        raw.pop("logprobs"), raw.pop("advantages")
    raw.update(extra)
    with pytest.raises(UserError) as e:
        losses.prepare_inputs(name, raw, n_tokens=4, index=1)
    assert e.value.field == field


def test_prepare_inputs_converts_dtypes():
    inputs = {"target_tokens": np.arange(3, dtype=np.int32), "weights": np.array([1, 0, 2])}
    out = losses.prepare_inputs("cross_entropy", inputs, n_tokens=3, index=0)
    assert out["target_tokens"].dtype == torch.int64 and out["weights"].dtype == torch.float32
    torch.testing.assert_close(out["weights"], _t([1.0, 0.0, 2.0]))
