"""The unmodified ``tinker`` SDK against the real embedded stack (gateway → CloudEvents on
NATS JetStream → trainer / sampler → storage). Nothing is mocked.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import tinker
from tinker import types

from conftest import BASE_MODEL
from tolerances import PRECISION, TOL, check_close, check_sampler_trainer

LR = 1e-2
# the tiny random model (CI) learns the token set first, then the bigrams; on the 4B shapes
# (bf16) 4e-3 drives every position to one token within a few steps (H200, 2026-12-02), and
# Adam's first steps move each LoRA element by about lr whatever the model's size
SFT_LR, SFT_STEPS = (4e-3 if PRECISION == "fp32" else 2e-4), 60


def datum(tokens: list[int], **inputs) -> types.Datum:
    """Next-token datum for ``tokens``; extra per-target inputs (length len(tokens)-1)."""
    fn_inputs = {"target_tokens": tokens[1:], **inputs}
    if "weights" not in fn_inputs and not ({"advantages", "logprobs"} & set(inputs)):
        fn_inputs["weights"] = [1.0] * (len(tokens) - 1)
    return types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]), loss_fn_inputs=fn_inputs)


def logprobs_of(out: types.ForwardBackwardOutput, i: int = 0) -> np.ndarray:
    return np.asarray(out.loss_fn_outputs[i]["logprobs"].tolist(), dtype=np.float64)


@pytest.fixture(scope="module")
def seq(tokenizer) -> list[int]:
    return tokenizer.encode("The quick brown fox jumps over the lazy dog.", add_special_tokens=False)


def new_client(service, seed: int = 0, rank: int = 8):
    return service.create_lora_training_client(base_model=BASE_MODEL, rank=rank, seed=seed).result()


def test_capabilities_and_tokenizer(service, tokenizer):
    caps = service.get_server_capabilities()
    names = {m.model_name for m in caps.supported_models}
    assert {"Qwen/Qwen3-4B-Instruct-2507", "Qwen/Qwen3-0.6B"} <= names
    assert tokenizer.encode("Hello world", add_special_tokens=False) == [9707, 1879]


def test_sft_memorises_and_greedy_reproduces(service, seq):
    """SFT on one fixed example lowers loss:sum by more than half; greedy sampling then
    reproduces the memorised tokens."""
    tc = new_client(service, seed=1, rank=16)
    d = datum(seq)
    first = last = None
    for _ in range(SFT_STEPS):
        fb = tc.forward_backward([d], "cross_entropy")
        tc.optim_step(types.AdamParams(learning_rate=SFT_LR)).result()
        loss = fb.result().metrics["loss:sum"]
        first = loss if first is None else first
        last = loss
    assert last < 0.5 * first, (first, last)
    sampler = tc.save_weights_and_get_sampling_client()
    prompt = seq[:3]
    out = sampler.sample(types.ModelInput.from_ints(prompt), num_samples=1,
                         sampling_params=types.SamplingParams(max_tokens=len(seq) - 3, temperature=0.0, stop=[])
                         ).result()
    assert list(out.sequences[0].tokens) == seq[3:]


def test_forward_equals_forward_backward_logprobs(service, seq):
    tc = new_client(service, seed=2)
    d = datum(seq)
    f = tc.forward([d], "cross_entropy").result()
    fb = tc.forward_backward([d], "cross_entropy").result()
    check_close("fwd_vs_fwdbwd", logprobs_of(fb), logprobs_of(f), TOL.fwd_vs_fwdbwd)
    assert len(logprobs_of(f)) == len(seq) - 1
    # cross_entropy: loss:sum = -sum(logprob * weight), of the pass's own logprobs
    assert fb.metrics["loss:sum"] == pytest.approx(-logprobs_of(fb).sum(), rel=1e-5)


def _hand_loss(name: str, lp: np.ndarray, old: np.ndarray, adv: np.ndarray, w: np.ndarray, cfg: dict) -> float:
    """The loss formulas, written out independently of the trainer's code."""
    ratio = np.exp(lp - old)
    if name == "cross_entropy":
        return float(-(lp * w).sum())
    if name == "importance_sampling":
        return float(-(ratio * adv).sum())
    # Tinker's clip thresholds are bounds on the ratio itself: clamp(ratio, low, high)
    if name == "ppo":
        lo, hi = cfg.get("clip_low_threshold", 0.8), cfg.get("clip_high_threshold", 1.2)
        return float(-np.minimum(ratio * adv, np.clip(ratio, lo, hi) * adv).sum())
    if name == "cispo":
        lo, hi = cfg.get("clip_low_threshold", 0.0), cfg.get("clip_high_threshold", 4.0)
        return float(-(np.clip(ratio, lo, hi) * adv * lp).sum())
    if name == "dro":
        beta = cfg.get("beta", 0.05)
        return float(-(adv * lp).sum() + 0.5 * beta * ((lp - old) ** 2).sum())
    raise AssertionError(name)


@pytest.mark.parametrize("loss_fn,cfg", [
    ("cross_entropy", {}),
    ("importance_sampling", {}),
    ("ppo", {"clip_low_threshold": 0.9, "clip_high_threshold": 1.3}),
    ("cispo", {"clip_low_threshold": 0.5, "clip_high_threshold": 1.1}),
    ("dro", {"beta": 0.3}),
])
def test_loss_value_matches_hand_computation(service, seq, loss_fn, cfg):
    tc = new_client(service, seed=3)
    n = len(seq) - 1
    rng = np.random.default_rng(0)
    f = tc.forward([datum(seq)], "cross_entropy").result()
    lp = logprobs_of(f)
    # sampler logprobs near the current ones so that some ratios fall inside and some outside the clip range
    old = (lp + rng.uniform(-0.6, 0.6, n)).astype(np.float32).astype(np.float64)
    adv = rng.normal(0, 1, n).astype(np.float32).astype(np.float64)
    w = rng.uniform(-0.5, 1.5, n).astype(np.float32).astype(np.float64)  # float and negative weights
    if loss_fn == "cross_entropy":
        d = datum(seq, weights=w.tolist())
    else:
        d = datum(seq, logprobs=old.tolist(), advantages=adv.tolist())
    fb = tc.forward_backward([d], loss_fn, loss_fn_config=cfg or None).result()
    # the formula on the pass's own logprobs; the forward's logprobs (which built ``old``) agree
    # with them within fwd_vs_fwdbwd
    check_close("fwd_vs_fwdbwd", logprobs_of(fb), lp, TOL.fwd_vs_fwdbwd, loss_fn=loss_fn)
    expected = _hand_loss(loss_fn, logprobs_of(fb), old, adv, w, cfg)
    assert fb.metrics["loss:sum"] == pytest.approx(expected, rel=1e-4, abs=1e-4)


def test_pipelined_calls_run_in_seq_id_order(service, seq):
    """Submitting every call at once (no waiting) gives exactly what waiting for each gives."""
    a, b = new_client(service, seed=4), new_client(service, seed=4)
    d1, d2 = datum(seq), datum(seq[::-1])
    adam = types.AdamParams(learning_rate=LR)
    for d in (d1, d2, d1):
        a.forward_backward([d], "cross_entropy").result()
        a.optim_step(adam).result()
    futs = []
    for d in (d1, d2, d1):
        futs.append(b.forward_backward([d], "cross_entropy"))
        futs.append(b.optim_step(adam))
    [f.result() for f in futs]
    la = logprobs_of(a.forward([d1], "cross_entropy").result())
    lb = logprobs_of(b.forward([d1], "cross_entropy").result())
    check_close("repeat_logprob", lb, la, TOL.repeat_logprob, what="pipelined vs waited, 3 steps")


def test_save_state_and_create_from_state_reproduce_logprobs(service, seq):
    tc = new_client(service, seed=5)
    adam = types.AdamParams(learning_rate=LR)
    for _ in range(2):
        tc.forward_backward([datum(seq)], "cross_entropy").result()
        tc.optim_step(adam).result()
    path = tc.save_state("two-steps").result().path
    assert path.startswith("tinker://") and path.endswith("/weights/two-steps")
    before = logprobs_of(tc.forward([datum(seq)], "cross_entropy").result())

    restored = service.create_training_client_from_state(path).result()
    check_close("save_load", logprobs_of(restored.forward([datum(seq)], "cross_entropy").result()), before,
                TOL.save_load)

    # with the optimizer state, one more step lands on the same weights as the original's next step
    with_opt = service.create_training_client_from_state_with_optimizer(path).result()
    for c in (tc, with_opt):
        c.forward_backward([datum(seq)], "cross_entropy").result()
        c.optim_step(adam).result()
    check_close("save_load", logprobs_of(with_opt.forward([datum(seq)], "cross_entropy").result()),
                logprobs_of(tc.forward([datum(seq)], "cross_entropy").result()), TOL.save_load,
                what="one more step after loading with the optimizer")


def test_sampling_seed_stop_and_prompt_logprobs(service, seq):
    tc = new_client(service, seed=6)
    sampler = tc.save_weights_and_get_sampling_client()
    prompt = types.ModelInput.from_ints(seq[:4])
    p = types.SamplingParams(max_tokens=8, temperature=1.0, seed=123)
    s1 = sampler.sample(prompt, num_samples=3, sampling_params=p).result()
    s2 = sampler.sample(prompt, num_samples=3, sampling_params=p).result()
    assert [list(s.tokens) for s in s1.sequences] == [list(s.tokens) for s in s2.sequences]
    s3 = sampler.sample(prompt, num_samples=3, sampling_params=types.SamplingParams(max_tokens=8, seed=7)).result()
    assert [list(s.tokens) for s in s1.sequences] != [list(s.tokens) for s in s3.sequences]
    for s in s1.sequences:
        assert len(s.logprobs) == len(s.tokens) and all(lp <= 0 for lp in s.logprobs)

    greedy = sampler.sample(prompt, num_samples=1, sampling_params=types.SamplingParams(
        max_tokens=6, temperature=0.0, stop=[])).result().sequences[0]
    assert greedy.stop_reason == "length" and len(greedy.tokens) == 6
    stop_id = greedy.tokens[2]
    by_id = sampler.sample(prompt, num_samples=1, sampling_params=types.SamplingParams(
        max_tokens=6, temperature=0.0, stop=[stop_id])).result().sequences[0]
    assert by_id.stop_reason == "stop" and list(by_id.tokens)[-1] == stop_id
    assert list(by_id.tokens) == list(greedy.tokens)[: list(greedy.tokens).index(stop_id) + 1]
    tok = tc.get_tokenizer()
    stop_str = tok.decode([greedy.tokens[1]])
    by_str = sampler.sample(prompt, num_samples=1, sampling_params=types.SamplingParams(
        max_tokens=6, temperature=0.0, stop=[stop_str])).result().sequences[0]
    assert by_str.stop_reason == "stop" and len(by_str.tokens) <= 2

    # compute_logprobs: first position None, the rest the trainer's forward logprobs
    lps = sampler.compute_logprobs(types.ModelInput.from_ints(seq)).result()
    assert lps[0] is None
    fwd = logprobs_of(tc.forward([datum(seq)], "cross_entropy").result())
    check_sampler_trainer(lps[1:], fwd, what="compute_logprobs")


def test_bad_inputs_get_user_errors_and_server_keeps_serving(service, seq):
    with pytest.raises(tinker.BadRequestError, match="base_model"):
        service.create_lora_training_client(base_model="nope/unknown-model", rank=4).result()
    tc = new_client(service, seed=7)
    with pytest.raises(tinker.BadRequestError, match="vocabulary"):
        tc.forward_backward([datum([1, 2, 10**7])], "cross_entropy").result()
    bad_len = types.Datum(model_input=types.ModelInput.from_ints(seq[:5]),
                          loss_fn_inputs={"target_tokens": seq[1:4], "weights": [1.0, 1.0, 1.0]})
    with pytest.raises(tinker.BadRequestError, match="target_tokens|weights"):
        tc.forward_backward([bad_len], "cross_entropy").result()
    with pytest.raises(tinker.RequestFailedError) as ei:
        tc.forward_backward([datum(seq)], "no_such_loss").result()
    assert ei.value.category == "user" and "loss_fn" in str(ei.value)
    # the run and the server still work after all of that
    out = tc.forward_backward([datum(seq)], "cross_entropy").result()
    assert math.isfinite(out.metrics["loss:sum"])
