"""Sampler–trainer mismatch (issue 13 item 7): the estimators by hand, which tokens count, the
sums over a packed pass split into micro-batches, and the Prometheus histograms.

Real engine on the micro model (tests/micro_model.py); the "sampler logprobs" are the trainer's
own logprobs plus known offsets, so every expected value is a hand sum of those offsets.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from prometheus_client import REGISTRY

from functions.trainer.engine import Datum, FwdBwdItem, TrainerEngine
from functions.trainer.mismatch import METRIC_KEYS, MismatchStats, sampled_token_mask
from openrl.model.lora import LoraSpec
from openrl.observe import metrics as prom

VOCAB = 512


def _t(x) -> torch.Tensor:
    return torch.tensor(x, dtype=torch.float32)


def test_estimators_by_hand():
    # d = q - lp over the masked tokens: [0.1, -0.3, 0.2]  (the 4th token is masked out)
    lp = _t([-1.0, -2.0, -0.5, -3.0])
    q = _t([-0.9, -2.3, -0.3, -9.0])
    s = MismatchStats()
    s.add(lp, q, torch.tensor([True, True, True, False]))
    m = s.metrics()
    assert set(m) == set(METRIC_KEYS)
    assert m["sample_train_tokens:sum"] == 3
    assert m["kl_sample_train_v1:mean"] == pytest.approx((0.1 - 0.3 + 0.2) / 3, abs=1e-6)
    assert m["kl_sample_train_v2:mean"] == pytest.approx(0.5 * (0.01 + 0.09 + 0.04) / 3, abs=1e-6)
    assert m["sample_train_logprob_diff_abs:mean"] == pytest.approx(0.6 / 3, abs=1e-6)
    assert m["sample_train_logprob_diff_abs:max"] == pytest.approx(0.3, abs=1e-6)
    # a second datum: sums, not a mean of means
    s.add(_t([-1.0]), _t([-2.0]), None)  # d = -1
    m = s.metrics()
    assert m["sample_train_tokens:sum"] == 4
    assert m["kl_sample_train_v1:mean"] == pytest.approx((0.1 - 0.3 + 0.2 - 1.0) / 4, abs=1e-6)
    assert m["kl_sample_train_v2:mean"] == pytest.approx(0.5 * (0.01 + 0.09 + 0.04 + 1.0) / 4, abs=1e-6)
    assert m["sample_train_logprob_diff_abs:max"] == pytest.approx(1.0, abs=1e-6)


def test_no_counted_token_reports_zeros_and_shape_errors():
    s = MismatchStats()
    s.add(_t([-1.0, -2.0]), _t([0.0, 0.0]), torch.tensor([False, False]))
    assert s.metrics() == {k: 0.0 for k in METRIC_KEYS}
    with pytest.raises(ValueError, match="one shape"):
        s.add(_t([-1.0, -2.0]), _t([0.0]), None)


def test_sampled_token_mask_is_nonzero_logprob_or_advantage():
    q = _t([0.0, 0.0, -0.2, 0.0, -1.0])
    adv = _t([0.0, 0.0, 0.0, 0.5, 1.0])  # position 3: a sampled token with q == 0 exactly but A != 0
    assert sampled_token_mask({"advantages": adv}, q).tolist() == [False, False, True, True, True]
    assert sampled_token_mask({}, q).tolist() == [False, False, True, False, True]


@pytest.fixture(scope="module")
def engine(micro_model_dir):
    e = TrainerEngine(micro_model_dir, max_rows=1)  # one datum per micro-batch: sums must span them
    e.create_run("a", LoraSpec(rank=4, seed=1))
    e.create_run("b", LoraSpec(rank=2, seed=2))
    return e


@pytest.mark.parametrize("loss_fn", ["importance_sampling", "ppo", "cispo", "gspo", "dro"])
def test_engine_reports_mismatch_over_a_packed_pass(engine, loss_fn):
    rng = np.random.default_rng(3)
    seqs = [rng.integers(0, VOCAB, n).tolist() for n in (12, 7)]
    prompt = [4, 2]
    # the trainer's own logprobs (no optimizer step happens in this test)
    fwd = engine.forward_backward([FwdBwdItem("a", [Datum(s[:-1], {"target_tokens": np.array(s[1:])}) for s in seqs],
                                              "cross_entropy", forward_only=True)])[0]
    datums, diffs = [], []
    for s, p, out in zip(seqs, prompt, fwd.loss_fn_outputs):
        lp = out["logprobs"].astype(np.float64)
        n = len(lp)
        sampled = np.arange(n) >= p
        delta = np.where(sampled, rng.uniform(-0.05, 0.05, n), 0.0)
        q = np.where(sampled, lp + delta, 0.0).astype(np.float32)
        adv = np.where(sampled, rng.normal(size=n), 0.0).astype(np.float32)
        adv[-1] = 0.0  # a sampled token with zero advantage still counts (q != 0)
        datums.append(Datum(s[:-1], {"target_tokens": np.array(s[1:]), "logprobs": q, "advantages": adv}))
        diffs.append((q.astype(np.float64) - lp)[sampled])
    other = FwdBwdItem("b", [Datum(seqs[0][:-1], {"target_tokens": np.array(seqs[0][1:]),
                                                   "weights": np.ones(len(seqs[0]) - 1, np.float32)})],
                       "cross_entropy")
    res, ce = engine.forward_backward([FwdBwdItem("a", datums, loss_fn), other])
    engine.zero_grad("a"), engine.zero_grad("b")
    d = np.concatenate(diffs)
    m = res.metrics
    assert m["sample_train_tokens:sum"] == len(d) == (11 - 4) + (6 - 2)
    assert m["kl_sample_train_v1:mean"] == pytest.approx(d.mean(), abs=2e-6)
    assert m["kl_sample_train_v2:mean"] == pytest.approx(0.5 * (d ** 2).mean(), abs=2e-7)
    assert m["sample_train_logprob_diff_abs:mean"] == pytest.approx(np.abs(d).mean(), abs=2e-6)
    assert m["sample_train_logprob_diff_abs:max"] == pytest.approx(np.abs(d).max(), abs=2e-6)
    assert res.mismatch is not None and math.isfinite(m["loss:sum"])
    assert set(ce.metrics) == {"loss:sum"} and ce.mismatch is None  # no sampler logprobs: no mismatch keys


def _sample(name: str, **labels) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


def test_prometheus_histograms_per_base_model():
    base = "test/mismatch-model"
    s = MismatchStats()
    s.add(_t([-1.0, -2.0]), _t([-1.0002, -2.0004]), None)
    before = _sample("openrl_trainer_kl_sample_train_v1_count", base_model=base)
    le = _sample("openrl_trainer_sample_train_logprob_diff_abs_bucket", base_model=base, le="0.0005")
    le0 = _sample("openrl_trainer_kl_sample_train_v1_bucket", base_model=base, le="0.0")
    prom.record_sample_train(base, s.metrics())
    assert _sample("openrl_trainer_kl_sample_train_v1_count", base_model=base) == before + 1
    # d = q - lp = [-2e-4, -4e-4]: v1 = -3e-4 (sampler below trainer), in the le="0" bucket
    assert _sample("openrl_trainer_kl_sample_train_v1_sum", base_model=base) == pytest.approx(-3e-4, abs=1e-6)
    assert _sample("openrl_trainer_kl_sample_train_v1_bucket", base_model=base, le="0.0") == le0 + 1
    assert _sample("openrl_trainer_sample_train_logprob_diff_abs_bucket", base_model=base, le="0.0005") == le + 1
    assert _sample("openrl_trainer_sample_train_tokens_total", base_model=base) >= 2
    prom.record_sample_train(base, MismatchStats().metrics())  # no measured token: nothing observed
    assert _sample("openrl_trainer_kl_sample_train_v1_count", base_model=base) == before + 1
