"""stable_reinforce end to end: the real tinker SDK and tinker_cookbook against the embedded stack.

The cookbook's own TinkerTokenCompleter samples (record_stability_info=True) and its
``rl.data_processing.trajectory_to_data`` (include_provenance on, the default) builds the datum
with provenance spans; the cookbook's ``rl.train`` drops ``mask`` before sending, as here. Then
forward_backward("stable_reinforce") trains on the sampler logprobs the server recorded. Refusals:
an unknown sequence_id, one of another session, one sampled without record_stability_info (all
failed futures, category "user", naming the field), spans that do not tile (400). Expiry after a
day is tested in tests/component/test_stability.py with an injected clock (no waiting a day).
"""

from __future__ import annotations

import asyncio
import dataclasses

import numpy as np
import pytest
import tinker
from tinker import types

from conftest import BASE_MODEL

PROMPT = [9707, 1879, 11, 419, 374, 264]
DEF_KEY = "stable_reinforce/openrl_tis_k3_v1:max"


@pytest.fixture(scope="module")
def svc(stack, api_key):
    return tinker.ServiceClient(base_url=stack.base_url, api_key=api_key)


@pytest.fixture(scope="module")
def rollout(svc):
    """A training client, and a two-turn trajectory sampled from its current weights, as datums."""
    pytest.importorskip("tinker_cookbook")  # (the GPU conformance run's image has no cookbook)
    from tinker_cookbook.completers import TinkerTokenCompleter
    from tinker_cookbook.rl.data_processing import trajectory_to_data
    from tinker_cookbook.rl.types import Trajectory, Transition

    tc = svc.create_lora_training_client(base_model=BASE_MODEL, rank=4, seed=21).result()
    sc = tc.save_weights_and_get_sampling_client(record_stability_info=True).result()
    complete = TinkerTokenCompleter(sc, max_tokens=5)
    ob1 = types.ModelInput.from_ints(PROMPT)
    ac1 = asyncio.run(complete(ob1, stop=[]))
    ob2 = types.ModelInput.from_ints(PROMPT + ac1.tokens + [13, 576])
    ac2 = asyncio.run(complete(ob2, stop=[]))
    traj = Trajectory(transitions=[Transition(ob1, ac1, 0.0, False), Transition(ob2, ac2, 1.0, True)], final_ob=ob2)
    data = trajectory_to_data(traj, 0.5)
    assert len(data) == 1 and data[0].loss_fn_input_spans is not None
    data = [dataclasses.replace(d, loss_fn_inputs={k: v for k, v in d.loss_fn_inputs.items() if k != "mask"})
            for d in data]
    return {"tc": tc, "data": data, "n_sampled": len(ac1.tokens) + len(ac2.tokens), "sc": sc}


def test_trains_on_recorded_logprobs(rollout):
    tc, data = rollout["tc"], rollout["data"]
    fb = tc.forward_backward(data, "stable_reinforce", loss_fn_config={"kl_coeff": 0.1}).result()
    m = fb.metrics
    assert m[DEF_KEY] == 1.0 and m["stable_reinforce/sampled_tokens:sum"] == rollout["n_sampled"]
    # on-policy (no step since sampling): ratios ~1, nothing truncated, k3 ~0, and the loss is
    # REINFORCE's -sum(A * lp) over the sampled tokens
    assert m["stable_reinforce/tis_clipped_tokens:sum"] == 0 and 0 <= m["stable_reinforce/kl_k3:sum"] < 1e-3
    lp = np.asarray(fb.loss_fn_outputs[0]["logprobs"].tolist())
    adv = np.asarray(data[0].loss_fn_inputs["advantages"].tolist())
    assert m["loss:sum"] == pytest.approx(-(adv * lp).sum(), rel=1e-3, abs=1e-4)
    tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    # a second use of the same samples (its day restarts), now off-policy
    again = tc.forward_backward(data, "stable_reinforce").result().metrics
    assert again[DEF_KEY] == 1.0 and again["loss:sum"] != pytest.approx(m["loss:sum"], rel=1e-6)
    # spans are accepted with every loss
    assert np.isfinite(tc.forward(data, "importance_sampling").result().metrics["loss:sum"])


def _expect_user_error(tc, data, field, text):
    with pytest.raises(tinker.RequestFailedError) as e:
        tc.forward_backward(data, "stable_reinforce").result()
    assert "user" in str(e.value.category).lower()
    assert field in str(e.value) and text in str(e.value), str(e.value)


def test_unknown_other_session_and_unrecorded_ids_fail_as_user_errors(svc, rollout, stack, api_key):
    tc, data = rollout["tc"], rollout["data"]
    d = data[0]
    renamed = [dataclasses.replace(d, model_input_spans=[dataclasses.replace(s, sequence_id="nope:sample:0:0:0")
                                                         for s in d.model_input_spans])]
    _expect_user_error(tc, renamed, "data[0].model_input_spans[0].sequence_id", "unknown sequence_id")
    # sampled without record_stability_info: nothing recorded
    plain = tc.save_weights_and_get_sampling_client().result()
    seq = plain.sample(types.ModelInput.from_ints(PROMPT), 1, types.SamplingParams(max_tokens=3)).result().sequences[0]
    n = len(PROMPT) + len(seq.tokens) - 1
    unrec = types.Datum(model_input=types.ModelInput.from_ints(PROMPT + seq.tokens[:-1]),
                        loss_fn_inputs={"target_tokens": [0] * (len(PROMPT) - 1) + seq.tokens,
                                        "advantages": [0.0] * (len(PROMPT) - 1) + [1.0] * len(seq.tokens)})
    unrec = unrec.with_provenance(
        model_input=[types.PromptProvenanceSpan(sequence_id=seq.sequence_id, length=len(PROMPT)),
                     types.SampledProvenanceSpan(sequence_id=seq.sequence_id, length=len(seq.tokens) - 1)],
        loss_fn_inputs=[types.PromptProvenanceSpan(sequence_id=seq.sequence_id, offset=1, length=len(PROMPT) - 1),
                        types.SampledProvenanceSpan(sequence_id=seq.sequence_id, length=len(seq.tokens))])
    assert unrec.model_input.length == n
    _expect_user_error(tc, [unrec], "data[0].model_input_spans[0].sequence_id", "record_stability_info")
    # another client session may not train on this session's samples
    other = tinker.ServiceClient(base_url=stack.base_url, api_key=api_key)
    tc2 = other.create_lora_training_client(base_model=BASE_MODEL, rank=4, seed=22).result()
    _expect_user_error(tc2, data, "data[0].model_input_spans[0].sequence_id", "another session")
    # the run keeps working
    assert tc.forward_backward(data, "stable_reinforce").result().metrics[DEF_KEY] == 1.0


def test_spans_that_do_not_tile_get_a_400_naming_the_field(rollout):
    tc, d = rollout["tc"], rollout["data"][0]
    short = dataclasses.replace(d, model_input_spans=d.model_input_spans[:-1])  # bypasses with_provenance's check
    with pytest.raises(tinker.BadRequestError) as e:
        tc.forward_backward([short], "importance_sampling").result()
    assert "data[0].model_input_spans" in str(e.value) and "tile" in str(e.value)
    bare = dataclasses.replace(d, model_input_spans=None, loss_fn_input_spans=None)
    with pytest.raises(tinker.BadRequestError) as e:
        tc.forward_backward([bare], "stable_reinforce").result()
    assert "data[0].loss_fn_input_spans" in str(e.value)
