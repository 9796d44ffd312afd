"""stable_reinforce (openrl's definition openrl_tis_k3_v1, functions/trainer/losses.py) and the
provenance spans it reads (openrl/edge/proto/spans.py), in process: the loss against a hand
computation, its on-policy gradient against importance_sampling's (torch autograd), the input
checks, and spans written by the real SDK's protobuf encoder decoded and tiling-checked."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from functions.trainer import losses
from functions.trainer.losses import RECORDED_LOGPROBS, SAMPLED_MASK, STABLE_REINFORCE_DEFINITION
from openrl.edge import proto
from openrl.errors import UserError


def _inputs(mu, mask, adv, n):
    raw = {"target_tokens": np.arange(n), "advantages": np.asarray(adv, np.float32),
           RECORDED_LOGPROBS: np.asarray(mu, np.float32), SAMPLED_MASK: np.asarray(mask, np.float32)}
    return losses.prepare_inputs("stable_reinforce", raw, n, 0)


def test_value_gradient_and_metrics_match_a_hand_computation():
    """T=4: a prompt position, then three sampled tokens; the last one's ratio e^0.9 > C=2 is
    truncated. Expected values are the formula written out in plain floats."""
    lp_v = [-1.0, -0.5, -2.0, -0.1]
    mu = [0.0, -0.7, -1.0, -1.0]
    mask = [0.0, 1.0, 1.0, 1.0]
    adv = [0.0, 1.0, -0.5, 2.0]
    cap, beta = 2.0, 0.5
    lp = torch.tensor(lp_v, requires_grad=True)
    cfg = losses.resolve_config("stable_reinforce", {"kl_coeff": beta, "tis_cap": cap})
    loss, out, metrics = losses.compute_loss("stable_reinforce", lp, _inputs(mu, mask, adv, 4), cfg)
    loss.backward()
    loss = loss.detach()

    exp_loss, grad, k3_sum, clipped = 0.0, [], 0.0, 0
    for t in range(4):
        if not mask[t]:
            grad.append(0.0)
            continue
        r = math.exp(lp_v[t] - mu[t])
        w = min(r, cap)
        clipped += r > cap
        k3 = (r - 1) - (lp_v[t] - mu[t])
        k3_sum += k3
        exp_loss += -w * adv[t] * lp_v[t] + beta * k3
        grad.append(-w * adv[t] + beta * (r - 1))
    assert float(loss) == pytest.approx(exp_loss, rel=1e-6)
    assert float(loss) == pytest.approx(1.117264593, rel=1e-6)  # the same, worked out once by hand
    np.testing.assert_allclose(lp.grad.numpy(), grad, rtol=1e-5, atol=1e-7)
    np.testing.assert_array_equal(out["logprobs"].numpy(), np.float32(lp_v))
    assert metrics[STABLE_REINFORCE_DEFINITION] == 1.0
    assert metrics["stable_reinforce/sampled_tokens:sum"] == 3
    assert metrics["stable_reinforce/tis_clipped_tokens:sum"] == clipped == 1
    assert metrics["stable_reinforce/kl_k3:sum"] == pytest.approx(k3_sum, rel=1e-6)
    assert metrics["loss:sum"] == pytest.approx(exp_loss, rel=1e-6)


def test_on_policy_gradient_equals_importance_sampling():
    """Recorded logprobs equal to the trainer's (detached), kl_coeff 0: the gradient is
    importance_sampling's with the same logprobs as its ``logprobs`` input."""
    g = torch.Generator().manual_seed(0)
    n, prompt = 12, 4
    theta = torch.randn(n, generator=g)
    mask = (torch.arange(n) >= prompt).float()
    adv = torch.randn(n, generator=g) * mask

    def grad_of(loss_fn, inputs, cfg):
        p = theta.clone().requires_grad_(True)
        lp = torch.nn.functional.logsigmoid(p)  # some differentiable logprobs
        loss, _, _ = losses.compute_loss(loss_fn, lp, inputs, cfg)
        loss.backward()
        return p.grad, lp.detach()

    _, lp0 = grad_of("cross_entropy", {"target_tokens": torch.arange(n)}, {})
    g_sr, _ = grad_of("stable_reinforce", _inputs(lp0.numpy(), mask.numpy(), adv.numpy(), n),
                      losses.resolve_config("stable_reinforce", None))
    is_inputs = losses.prepare_inputs("importance_sampling", {"target_tokens": np.arange(n), "logprobs": lp0.numpy(),
                                                              "advantages": adv.numpy()}, n, 0)
    g_is, _ = grad_of("importance_sampling", is_inputs, {})
    assert g_is.abs().sum() > 0
    torch.testing.assert_close(g_sr, g_is, rtol=1e-6, atol=1e-7)


def test_advantage_on_a_prompt_position_is_a_user_error():
    with pytest.raises(UserError) as e:
        _inputs([0, -1, -1], [0, 1, 1], [0.5, 1, 1], 3)
    assert e.value.field == "data[0].loss_fn_inputs.advantages" and "position 0" in str(e.value)


@pytest.mark.parametrize("config,field", [({"kl_coeff": -0.1}, "loss_fn_config.kl_coeff"),
                                          ({"tis_cap": 0.5}, "loss_fn_config.tis_cap"),
                                          ({"beta": 1.0}, "loss_fn_config.beta")])
def test_bad_config(config, field):
    with pytest.raises(UserError) as e:
        losses.resolve_config("stable_reinforce", config)
    assert e.value.field == field


def test_defaults_and_accepted_inputs():
    assert losses.resolve_config("stable_reinforce", None) == {"kl_coeff": 0.0, "tis_cap": 2.0}
    # the cookbook also sends its own copy of the sampler logprobs: accepted (and not used)
    raw = {"target_tokens": np.arange(2), "advantages": np.zeros(2, np.float32), "logprobs": np.zeros(2, np.float32),
           RECORDED_LOGPROBS: np.zeros(2, np.float32), SAMPLED_MASK: np.ones(2, np.float32)}
    assert set(losses.prepare_inputs("stable_reinforce", raw, 2, 0)) == set(raw)
    with pytest.raises(UserError) as e:
        losses.prepare_inputs("stable_reinforce", {**raw, "mask": np.ones(2)}, 2, 0)
    assert e.value.field == "data[0].loss_fn_inputs.mask"


def test_merge_metrics_sums_and_maxes():
    acc = {"loss:sum": 5.0}
    losses.merge_metrics(acc, {"loss:sum": 1.0, "a:sum": 2.0, "b:max": 1.0})
    losses.merge_metrics(acc, {"a:sum": 3.0, "b:max": 0.5})
    assert acc == {"loss:sum": 5.0, "a:sum": 5.0, "b:max": 1.0}


# ------------------------------------------------------------------------- spans on the wire


def _sdk_body(datum, loss_fn="stable_reinforce") -> bytes:
    """A ForwardBackwardRequest body as the SDK 0.38 encodes it."""
    from tinker import types
    from tinker.proto.request_conv import forward_backward_request_to_proto

    req = types.ForwardBackwardRequest(
        forward_backward_input=types.ForwardBackwardInput(data=[datum], loss_fn=loss_fn), model_id="m", seq_id=1)
    return forward_backward_request_to_proto(req).SerializeToString()


def _datum(n_prompt=3, n_sampled=4):
    from tinker import types

    n = n_prompt + n_sampled - 1
    return types.Datum(model_input=types.ModelInput.from_ints(list(range(n))),
                       loss_fn_inputs={"target_tokens": list(range(1, n + 1)), "advantages": [0.0] * n})


def test_sdk_spans_decode_and_tile():
    from tinker import types

    d = _datum().with_provenance(
        model_input=[types.PromptProvenanceSpan(sequence_id="s:1", length=3),
                     types.SampledProvenanceSpan(sequence_id="s:1", length=3)],
        loss_fn_inputs=[types.PromptProvenanceSpan(sequence_id="s:1", offset=1, length=2),
                        types.SampledProvenanceSpan(sequence_id="s:1", offset=0, length=4)])
    fb = proto.decode_forward_backward_request(_sdk_body(d))
    got = fb.data[0]
    assert got.model_input_spans == [proto.Span("prompt", "s:1", 0, 3), proto.Span("sampled", "s:1", 0, 3)]
    assert got.loss_fn_input_spans == [proto.Span("prompt", "s:1", 1, 2), proto.Span("sampled", "s:1", 0, 4)]
    proto.check_spans(got, 0)
    # our encoder writes what the SDK writes
    again = proto.decode_forward_backward_request(proto.encode_forward_backward_request("m", 1, fb.data, "ppo"))
    assert again.data[0].model_input_spans == got.model_input_spans
    # no spans: None
    assert proto.decode_forward_backward_request(_sdk_body(_datum())).data[0].model_input_spans is None


def test_bad_tiling_and_half_pairs_name_the_field():
    d = proto.decode_forward_backward_request(_sdk_body(_datum())).data[0]  # 6 tokens
    d.model_input_spans = [proto.Span("prompt", "x", 0, 5)]
    d.loss_fn_input_spans = [proto.Span("sampled", "x", 0, 6)]
    with pytest.raises(UserError) as e:
        proto.check_spans(d, 2)
    assert e.value.field == "data[2].model_input_spans" and "cover 5 positions" in str(e.value)
    d.model_input_spans = [proto.Span("prompt", "x", 0, 6)]
    d.loss_fn_input_spans = [proto.Span("sampled", "x", 0, 7)]
    with pytest.raises(UserError) as e:
        proto.check_spans(d, 0)
    assert e.value.field == "data[0].loss_fn_input_spans"
    d.loss_fn_input_spans = None
    with pytest.raises(UserError) as e:
        proto.check_spans(d, 0)
    assert e.value.field == "data[0].loss_fn_input_spans" and "pair" in str(e.value)


def test_malformed_span_messages():
    from openrl.edge.proto.schema import ForwardBackwardRequest

    msg = ForwardBackwardRequest()
    msg.ParseFromString(_sdk_body(_datum()))
    msg.data[0].model_input_spans.add()  # no arm set
    with pytest.raises(UserError) as e:
        proto.decode_forward_backward_request(msg.SerializeToString())
    assert e.value.field == "data[0].model_input_spans[0]"
    del msg.data[0].model_input_spans[:]
    s = msg.data[0].loss_fn_input_spans.add().sampled_tokens
    s.sequence_id, s.length = "x", -1
    with pytest.raises(UserError) as e:
        proto.decode_forward_backward_request(msg.SerializeToString())
    assert e.value.field == "data[0].loss_fn_input_spans[0].length"
