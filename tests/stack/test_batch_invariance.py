"""What sharing a pass or a batch does to numbers (issue 22 item 3), through the real SDK and
the session's ``stack`` (or the external stack of the GPU conformance run).

- one datum's logprobs alone vs packed in one request with a longer datum, in forward and in
  forward_backward, and vs a pass shared with another run's request (``cobatch_logprob``);
- seeded samples alone vs the same request while other sample requests share the sampler's
  batch: token for token where ``seeded_identical`` (CPU), else only the shared prefix is
  compared and the fraction of identical sequences and the first differing position are
  recorded (vLLM's batch shape changes the sampled logits' rounding on the GPU).

Bounds and what was measured: tests/tolerances.py. Nothing is mocked.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import tinker
from tinker import types

from conftest import BASE_MODEL
from tolerances import TOL, check_close, measured

SHORT = [9707, 1879, 11, 419, 374, 264, 1273, 315, 279, 11691, 9128, 13]
LONG = [(37 * i) % 5000 + 200 for i in range(3 * len(SHORT))]


def _datum(tokens: list[int]) -> types.Datum:
    return types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                       loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)})


def _lp(out, i: int = 0) -> np.ndarray:
    return np.asarray(out.loss_fn_outputs[i]["logprobs"].tolist(), dtype=np.float64)


@pytest.fixture(scope="module")
def svc(stack, api_key):
    return tinker.ServiceClient(base_url=stack.base_url, api_key=api_key)


def test_logprobs_alone_vs_packed(svc):
    tc = svc.create_lora_training_client(base_model=BASE_MODEL, rank=8, seed=41).result()
    tc.forward_backward([_datum(SHORT)], "cross_entropy").result()
    tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()  # a non-zero adapter
    alone = _lp(tc.forward([_datum(SHORT)], "cross_entropy").result())
    packed = tc.forward([_datum(LONG), _datum(SHORT)], "cross_entropy").result()
    check_close("cobatch_logprob", _lp(packed, 1), alone, TOL.cobatch_logprob, what="forward, with a 3x longer datum")
    # forward_backward (gradients only accumulate: no optim_step, the weights stay)
    fb_alone = _lp(tc.forward_backward([_datum(SHORT)], "cross_entropy").result())
    fb_packed = tc.forward_backward([_datum(LONG), _datum(SHORT)], "cross_entropy").result()
    check_close("cobatch_logprob", _lp(fb_packed, 1), fb_alone, TOL.cobatch_logprob,
                what="forward_backward, with a 3x longer datum")
    # another run's request submitted at the same time (packed into one pass when both are queued)
    other = svc.create_lora_training_client(base_model=BASE_MODEL, rank=16, seed=42).result()
    futs = [other.forward([_datum(LONG)] * 2, "cross_entropy"), tc.forward([_datum(SHORT)], "cross_entropy")]
    check_close("cobatch_logprob", _lp(futs[1].result()), alone, TOL.cobatch_logprob,
                what="forward, submitted with another run's request")
    assert all(np.isfinite(_lp(futs[0].result(), i)).all() for i in range(2))


def _first_difference(a: list[int], b: list[int]) -> int:
    """Index of the first differing token (len of the shorter when one is a prefix of the other)."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


@pytest.mark.parametrize("top_k", [20, -1], ids=["top_k20", "full_vocab"])
def test_seeded_samples_alone_vs_in_a_shared_batch(svc, top_k):
    """``top_k20``: asserted token for token where ``seeded_identical``. ``full_vocab``: recorded
    only, everywhere: a random-weight model's next-token distribution is nearly uniform over the
    whole vocabulary (each token ~1/151,643), so a float32 rounding difference of the logits in
    another batch shape moves a draw across a neighbouring token's boundary now and then, on the
    CPU too (seen: 1 of 8 sequences differed at token 15 of 16)."""
    sc = svc.create_sampling_client(base_model=BASE_MODEL).result()
    prompt = types.ModelInput.from_ints(SHORT)
    params = types.SamplingParams(max_tokens=16, temperature=1.0, top_k=top_k, seed=7, stop=[])
    alone = sc.sample(prompt, 8, params).result().sequences
    again = sc.sample(prompt, 8, params).result().sequences  # alone twice: a seed means something
    # the same request again, while other seeded requests are queued before and after it
    before = [sc.sample(types.ModelInput.from_ints(LONG[i:i + 9]), 4,
                        types.SamplingParams(max_tokens=16, temperature=1.0, seed=100 + i, stop=[])) for i in range(6)]
    shared_f = sc.sample(prompt, 8, params)
    after = [sc.sample(types.ModelInput.from_ints(LONG[i:i + 7]), 2,
                       types.SamplingParams(max_tokens=12, temperature=1.0, seed=200 + i, stop=[])) for i in range(6)]
    shared = shared_f.result().sequences
    for f in before + after:
        assert all(len(s.tokens) >= 1 for s in f.result().sequences)

    firsts, shared_prefix_lps, alone_prefix_lps = [], [], []
    for a, s in zip(alone, shared):
        k = _first_difference(list(a.tokens), list(s.tokens))
        firsts.append(k)
        shared_prefix_lps += list(s.logprobs[:k])
        alone_prefix_lps += list(a.logprobs[:k])
        assert all(math.isfinite(x) and x <= 0 for x in s.logprobs), s.logprobs
    identical = sum(list(a.tokens) == list(s.tokens) for a, s in zip(alone, shared)) / len(alone)
    asserted = TOL.seeded_identical and top_k > 0
    measured("seeded_identical", identical, 1.0 if asserted else None, first_difference=firsts, top_k=top_k,
             sequences=len(alone), max_tokens=16)
    # the tokens both drew: the sampler scored them alike (up to co-batching)
    check_close("cobatch_logprob", shared_prefix_lps, alone_prefix_lps, TOL.cobatch_logprob,
                what=f"sampled tokens' logprobs, alone vs in a shared batch (common prefix, top_k {top_k})")
    # alone twice: the same tokens where seeded_identical (CPU). On the H200's vLLM even the same
    # request sent twice alone drew other tokens (its 8 seeded requests reach the engine core in
    # different steps, so the batch shapes differ): recorded there, a batch-invariant mode is issue 27
    repeat = sum(list(a.tokens) == list(b.tokens) for a, b in zip(alone, again)) / len(alone)
    measured("seeded_identical_alone_twice", repeat, 1.0 if TOL.seeded_identical else None, top_k=top_k)
    if TOL.seeded_identical:
        assert [list(s.tokens) for s in again] == [list(s.tokens) for s in alone]
    if asserted:
        assert identical == 1.0, (firsts, [list(s.tokens) for s in alone], [list(s.tokens) for s in shared])
