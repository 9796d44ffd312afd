"""What users copy from hosted Tinker works here (issue 24): datums that carry inputs their loss
does not read, and the smaller divergences other projects' Tinker suites found.

Everything runs through the unmodified ``tinker`` SDK (or raw HTTP where the SDK cannot send
the request) against the session's embedded ``stack`` (real gateway, NATS JetStream, trainer
and sampler processes).
"""

from __future__ import annotations

import numpy as np
import pytest
import tinker
from tinker import types

from conftest import BASE_MODEL

SEQ = [9707, 1879, 11, 419, 374, 264, 1273, 315, 279, 11691, 9128, 13]


@pytest.fixture(scope="module")
def svc(stack, api_key):
    return tinker.ServiceClient(base_url=stack.base_url, api_key=api_key)


@pytest.fixture(scope="module")
def tc(svc):
    return svc.create_lora_training_client(base_model=BASE_MODEL, rank=4, seed=0).result()


def _datum(**inputs) -> types.Datum:
    """One datum of SEQ (inputs SEQ[:-1], targets SEQ[1:]) with ``inputs`` as float32 lists."""
    n = len(SEQ) - 1
    fn_inputs = {"target_tokens": types.TensorData(data=SEQ[1:], dtype="int64", shape=[n])}
    for key, values in inputs.items():
        fn_inputs[key] = types.TensorData(data=[float(v) for v in values], dtype="float32", shape=[n])
    return types.Datum(model_input=types.ModelInput.from_ints(SEQ[:-1]), loss_fn_inputs=fn_inputs)


# ------------------------------------------------ item 1: inputs a loss does not read


def test_cross_entropy_datum_with_rl_fields_as_hosted_tinker_tests_send_it(tc):
    # cooperbench/hosted_tinker's make_cross_entropy_datum: weights plus zero logprobs and
    # advantages, sent to the official API in its reference tests; cross_entropy reads only
    # target_tokens and weights
    n = len(SEQ) - 1
    w = [0.0] * 3 + [1.0] * (n - 3)
    plain = tc.forward([_datum(weights=w)], "cross_entropy").result()
    extra = tc.forward([_datum(weights=w, logprobs=[0.0] * n, advantages=[0.0] * n)], "cross_entropy").result()
    assert extra.metrics["loss:sum"] == plain.metrics["loss:sum"] > 0
    np.testing.assert_array_equal(extra.loss_fn_outputs[0]["logprobs"].to_numpy(),
                                  plain.loss_fn_outputs[0]["logprobs"].to_numpy())


@pytest.mark.parametrize("loss_fn", ["importance_sampling", "ppo"])
def test_rl_datum_with_weights_as_the_losses_page_shows_it(tc, loss_fn):
    # Tinker's losses page builds the RL datum with target_tokens, weights, logprobs and
    # advantages; its documented RL formulas do not read weights, so they mask nothing here
    n = len(SEQ) - 1
    adv = [0.0] * 4 + [1.0, -0.5] * ((n - 4) // 2) + [1.0] * ((n - 4) % 2)
    q = [-1.5] * n
    plain = tc.forward([_datum(logprobs=q, advantages=adv)], loss_fn).result()
    weighted = tc.forward([_datum(weights=[0.0] * 6 + [1.0] * (n - 6), logprobs=q, advantages=adv)], loss_fn).result()
    assert weighted.metrics["loss:sum"] == plain.metrics["loss:sum"] != 0
    # and it trains: forward_backward + optim_step on such a datum
    tc.forward_backward([_datum(weights=[1.0] * n, logprobs=q, advantages=adv)], loss_fn).result()
    tc.optim_step(types.AdamParams(learning_rate=1e-3)).result()


def test_extra_inputs_are_still_checked_and_unknown_keys_refused(tc):
    n = len(SEQ) - 1
    with pytest.raises(tinker.BadRequestError, match=r"data\[0\]\.loss_fn_inputs\.advantages"):
        tc.forward([_datum(weights=[1.0] * n, advantages=[0.0, float("nan")] + [0.0] * (n - 2))],
                   "cross_entropy").result()
    # a key no loss knows (the cookbook's client-side "mask", which its rl/train.py strips)
    with pytest.raises(tinker.BadRequestError, match=r"data\[0\]\.loss_fn_inputs\.mask.*not an input of any loss"):
        tc.forward([_datum(logprobs=[-1.0] * n, advantages=[1.0] * n, mask=[1.0] * n)], "importance_sampling").result()
    # the run still works after the refusals (their seq_ids were skipped)
    assert tc.forward([_datum(weights=[1.0] * n)], "cross_entropy").result().metrics["loss:sum"] > 0
