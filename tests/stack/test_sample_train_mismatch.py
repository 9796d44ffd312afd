"""Sampler–trainer mismatch through the real SDK and the embedded stack (issue 13 item 7).

An importance_sampling forward_backward whose sampler logprobs are the trainer's own plus known
offsets reports exactly those offsets' estimators; a real sample → train round trip reports the
numerics gap of this stack; the trainer's /metrics exposes the histograms for the base model.
Nothing is mocked.
"""

from __future__ import annotations

import json

import httpx
import numpy as np
import pytest
import tinker
from prometheus_client.parser import text_string_to_metric_families
from tinker import types

from conftest import BASE_MODEL
from tolerances import TOL, check_close, measured

KEYS = ("kl_sample_train_v1:mean", "kl_sample_train_v2:mean", "sample_train_logprob_diff_abs:mean",
        "sample_train_logprob_diff_abs:max", "sample_train_tokens:sum")
SEQ = [9707, 1879, 11, 419, 374, 264, 1273, 315, 279, 11691, 9128, 13, 576, 3974]


def _trainer_samples(stack) -> dict:
    url = json.loads((stack.state_dir / "ports.json").read_text())["metrics"]["trainer"]
    r = httpx.get(url, timeout=10)
    assert r.status_code == 200
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(r.text) for s in fam.samples}


def _check_mismatch(m: dict) -> None:
    """The stack's own sampler-trainer metrics of a real round trip within tests/tolerances.py's bounds."""
    v1, v2 = m["kl_sample_train_v1:mean"], m["kl_sample_train_v2:mean"]
    worst, mean = m["sample_train_logprob_diff_abs:max"], m["sample_train_logprob_diff_abs:mean"]
    for name, value, bound in (("kl_sample_train", abs(v1), TOL.kl_sample_train),
                               ("kl_sample_train_v2", v2, TOL.kl_sample_train_v2),
                               ("sampler_trainer_max", worst, TOL.sampler_trainer_max),
                               ("sampler_trainer_mean", mean, TOL.sampler_trainer_mean)):
        measured(name, value, bound, what="kl metrics of a sample -> train round trip")
    assert abs(v1) <= TOL.kl_sample_train and 0 <= v2 <= TOL.kl_sample_train_v2, m
    assert worst <= TOL.sampler_trainer_max and mean <= TOL.sampler_trainer_mean, m


def _lp(out, i: int = 0) -> np.ndarray:
    return np.asarray(out.loss_fn_outputs[i]["logprobs"].tolist(), dtype=np.float64)


@pytest.fixture(scope="module")
def tc(stack, api_key):
    svc = tinker.ServiceClient(base_url=stack.base_url, api_key=api_key)
    return svc.create_lora_training_client(base_model=BASE_MODEL, rank=4, seed=21).result()


def test_importance_sampling_reports_hand_values_and_histograms(stack, tc):
    before = _trainer_samples(stack)
    n, prompt = len(SEQ) - 1, 5
    data = [types.Datum(model_input=types.ModelInput.from_ints(SEQ[:-1]),
                        loss_fn_inputs={"target_tokens": SEQ[1:], "weights": [1.0] * n})]
    lp = _lp(tc.forward(data, "cross_entropy").result())
    assert "kl_sample_train_v1:mean" not in tc.forward(data, "cross_entropy").result().metrics
    rng = np.random.default_rng(4)
    sampled = np.arange(n) >= prompt
    q = np.where(sampled, lp + rng.uniform(-0.02, 0.02, n), 0.0).astype(np.float32)
    adv = np.where(sampled, 1.0, 0.0).astype(np.float32)
    rl = types.Datum(model_input=types.ModelInput.from_ints(SEQ[:-1]),
                     loss_fn_inputs={"target_tokens": SEQ[1:], "logprobs": q.tolist(), "advantages": adv.tolist()})
    fb = tc.forward_backward([rl], "importance_sampling").result()
    m = fb.metrics
    check_close("fwd_vs_fwdbwd", _lp(fb), lp, TOL.fwd_vs_fwdbwd)
    d = (q.astype(np.float64) - _lp(fb))[sampled]  # the estimators of the pass's own logprobs
    assert set(KEYS) <= set(m)
    assert m["sample_train_tokens:sum"] == n - prompt
    assert m["kl_sample_train_v1:mean"] == pytest.approx(d.mean(), abs=1e-5)
    assert m["kl_sample_train_v2:mean"] == pytest.approx(0.5 * (d ** 2).mean(), abs=1e-6)
    assert m["sample_train_logprob_diff_abs:mean"] == pytest.approx(np.abs(d).mean(), abs=1e-5)
    assert m["sample_train_logprob_diff_abs:max"] == pytest.approx(np.abs(d).max(), abs=1e-5)

    after = _trainer_samples(stack)
    label = (("base_model", BASE_MODEL),)
    for name in ("openrl_trainer_kl_sample_train_v1_count", "openrl_trainer_kl_sample_train_v2_count",
                 "openrl_trainer_sample_train_logprob_diff_abs_count",
                 "openrl_trainer_sample_train_logprob_diff_abs_max_count"):
        assert after.get((name, label), 0) - before.get((name, label), 0) == 1, name
    tokens = "openrl_trainer_sample_train_tokens_total"
    assert after.get((tokens, label), 0) - before.get((tokens, label), 0) == n - prompt
    v2_sum = "openrl_trainer_kl_sample_train_v2_sum"
    assert after[(v2_sum, label)] - before.get((v2_sum, label), 0) == pytest.approx(0.5 * (d ** 2).mean(), abs=1e-6)


def test_sampled_then_trained_mismatch_is_float_noise(stack, tc):
    """A real round trip: sample with the run's own weights (no step since), train
    importance_sampling on the sampler's logprobs. On the CPU float32 stack sampler and trainer
    run the same formula, so the gap is float noise, far under the ~2e-4 of a healthy bf16 GPU;
    the bounds are tests/tolerances.py's (bf16 on the GPU conformance run)."""
    sampler = tc.save_weights_and_get_sampling_client().result()
    prompt = SEQ[:6]
    res = sampler.sample(types.ModelInput.from_ints(prompt), num_samples=2,
                         sampling_params=types.SamplingParams(max_tokens=8, temperature=1.0, seed=3)).result()
    data = []
    for i, s in enumerate(res.sequences):
        toks = prompt + list(s.tokens)
        n_prompt = len(prompt) - 1
        q = [0.0] * n_prompt + list(s.logprobs)
        adv = [0.0] * n_prompt + [1.0 if i == 0 else -1.0] * len(s.tokens)
        data.append(types.Datum(model_input=types.ModelInput.from_ints(toks[:-1]),
                                loss_fn_inputs={"target_tokens": toks[1:], "logprobs": q, "advantages": adv}))
    m = tc.forward_backward(data, "importance_sampling").result().metrics
    assert m["sample_train_tokens:sum"] == sum(len(s.tokens) for s in res.sequences)
    _check_mismatch(m)
    print(f"CPU float32 stack: kl_sample_train_v1 {m['kl_sample_train_v1:mean']:.3g}, "
          f"v2 {m['kl_sample_train_v2:mean']:.3g}, max |d| {m['sample_train_logprob_diff_abs:max']:.3g}")


def test_stable_reinforce_reports_mismatch_of_recorded_logprobs(stack, tc):
    """stable_reinforce (no client-side logprobs needed): the mismatch is measured against the
    logprobs the sampler recorded, on the tokens the cookbook's provenance spans name as sampled."""
    import asyncio
    import dataclasses

    pytest.importorskip("tinker_cookbook")
    from tinker_cookbook.completers import TinkerTokenCompleter
    from tinker_cookbook.rl.data_processing import trajectory_to_data
    from tinker_cookbook.rl.types import Trajectory, Transition

    sc = tc.save_weights_and_get_sampling_client(record_stability_info=True).result()
    ob = types.ModelInput.from_ints(SEQ[:6])
    ac = asyncio.run(TinkerTokenCompleter(sc, max_tokens=6)(ob, stop=[]))
    data = trajectory_to_data(Trajectory(transitions=[Transition(ob, ac, 1.0, True)], final_ob=ob), 0.5)
    # as the cookbook's rl.train sends it: no mask, and here no client logprobs either
    data = [dataclasses.replace(d, loss_fn_inputs={k: v for k, v in d.loss_fn_inputs.items()
                                                   if k not in ("mask", "logprobs")}) for d in data]
    m = tc.forward_backward(data, "stable_reinforce").result().metrics
    assert m["sample_train_tokens:sum"] == len(ac.tokens)
    _check_mismatch(m)
