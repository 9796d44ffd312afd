"""(T, K) targets (issue 13 item 4): ``target_tokens`` / ``weights`` of shape [T, K] give
[T, K] logprobs ``log softmax(logits_t)[target_tokens[t, k]]`` and the cross-entropy loss
``-sum_{t,k} w[t,k] * lp[t,k]``, checked against the micro model's ``log_softmax`` gathered by
hand; ragged K across the datums of one request comes back to the SDK with each datum's shape.

Nothing is mocked: the real engine on the micro model (tests/micro_model.py), the real SDK
protobuf decoder (``tinker.proto.response_conv``).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tinker.proto import response_conv
from transformers import AutoModelForCausalLM

from functions.trainer.engine import Datum, FwdBwdItem, TrainerEngine
from openrl.edge import proto as P
from openrl.model.lora import LoraSpec

VOCAB = 512


@pytest.fixture(scope="module")
def engine(micro_model_dir):
    e = TrainerEngine(micro_model_dir)
    e.create_run("a", LoraSpec(rank=4, seed=1))
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():  # B = 0 at init: give the adapter a visible effect
        for p in e.model.adapter_parameters("a"):
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    return e


def _hand_logprobs(engine: TrainerEngine, tokens: list[int], targets: np.ndarray) -> np.ndarray:
    """float64 [T, K]: log_softmax of the adapted model's logits, gathered by hand."""
    with torch.no_grad(), engine.model.use_adapters(["a"]):
        logits = engine.model(torch.tensor([tokens])).logits[0].double()
    return torch.log_softmax(logits, -1).gather(-1, torch.from_numpy(targets)).numpy()


def _grads(e: TrainerEngine) -> list[torch.Tensor]:
    return [torch.zeros_like(p) if p.grad is None else p.grad.clone() for p in e.model.adapter_parameters("a")]


def test_adapter_hand_reference_is_the_plain_model_without_lora(engine, micro_model_dir):
    """The hand reference runs the engine's own wrapped model; with no adapter it must equal a
    freshly loaded Hugging Face model (so the reference is not circular)."""
    plain = AutoModelForCausalLM.from_pretrained(micro_model_dir).eval()
    toks = [5, 17, 300, 2, 44, 9]
    with torch.no_grad(), engine.model.use_adapters([None]):
        ours = engine.model(torch.tensor([toks])).logits
        ref = plain(torch.tensor([toks])).logits
    torch.testing.assert_close(ours, ref, atol=1e-5, rtol=1e-5)


def test_two_d_logprobs_loss_and_gradient_match_hand(engine):
    rng = np.random.default_rng(0)
    T, K = 9, 4
    tokens = rng.integers(0, VOCAB, T).tolist()
    tt = rng.integers(0, VOCAB, (T, K)).astype(np.int64)
    tt[3, 2] = tt[3, 0]  # a repeated candidate is scored twice
    w = rng.uniform(-0.5, 1.0, (T, K)).astype(np.float32)
    w[:5] = 0  # the decisions recipe weights only its last row(s)
    engine.zero_grad("a")
    res = engine.forward_backward([FwdBwdItem("a", [Datum(tokens, {"target_tokens": tt, "weights": w})],
                                              "cross_entropy")])[0]
    assert res.error is None
    lp = res.loss_fn_outputs[0]["logprobs"]
    assert lp.shape == (T, K) and lp.dtype == np.float32
    want = _hand_logprobs(engine, tokens, tt)
    np.testing.assert_allclose(lp, want, atol=2e-5)
    assert lp[3, 2] == lp[3, 0]
    assert res.metrics["loss:sum"] == pytest.approx(float(-(want * w).sum()), rel=1e-5, abs=1e-5)
    two_d = _grads(engine)

    # the [T, K] gradient is the sum of K one-column cross-entropy passes with weights w[:, k]
    engine.zero_grad("a")
    cols = [Datum(tokens, {"target_tokens": tt[:, k].copy(), "weights": w[:, k].copy()}) for k in range(K)]
    engine.forward_backward([FwdBwdItem("a", cols, "cross_entropy")])
    for x, y in zip(two_d, _grads(engine)):
        torch.testing.assert_close(x, y, atol=1e-6, rtol=1e-4)
    engine.zero_grad("a")


def test_forward_only_two_d_and_mixed_k_in_one_request(engine):
    """forward (no gradient) with datums of K = 1-D, 2 and 5 in one request: each datum gets
    its own shape back, through the protobuf the SDK decodes."""
    rng = np.random.default_rng(1)
    shapes = [(7, None), (5, 2), (8, 5), (3, 5)]
    datums, targets = [], []
    for T, K in shapes:
        toks = rng.integers(0, VOCAB, T).tolist()
        tt = rng.integers(0, VOCAB, T if K is None else (T, K)).astype(np.int64)
        datums.append(Datum(toks, {"target_tokens": tt}))
        targets.append((toks, tt))
    res = engine.forward_backward([FwdBwdItem("a", datums, "cross_entropy", forward_only=True)])[0]
    assert res.error is None and all(p.grad is None or not p.grad.any() for p in engine.model.adapter_parameters("a"))
    sdk = response_conv.deserialize_forward_backward_output(
        P.encode_forward_backward_output(res.loss_fn_outputs, res.metrics))
    assert len(sdk.loss_fn_outputs) == len(shapes)
    total = 0.0
    for (toks, tt), out in zip(targets, sdk.loss_fn_outputs):
        td = out["logprobs"]
        assert td.shape == list(tt.shape)
        hand = _hand_logprobs(engine, toks, tt.reshape(len(toks), -1)).reshape(tt.shape)
        np.testing.assert_allclose(td.to_numpy(), hand, atol=2e-5)
        total += float(-hand.sum())
    assert sdk.metrics["loss:sum"] == pytest.approx(total, rel=1e-5)


def test_ragged_outputs_encode_as_several_records():
    outs = [{"logprobs": np.zeros((3, 2), np.float32)}, {"logprobs": np.ones((4, 2), np.float32)},
            {"logprobs": np.full(5, 2.0, np.float32)}, {"logprobs": np.full((1, 3), 3.0, np.float32)}]
    msg = P.ForwardBackwardOutput()
    msg.ParseFromString(P.encode_forward_backward_output(outs, {"loss:sum": 0.0}))
    assert [r.num_datums for r in msg.loss_fn_outputs] == [2, 1, 1]
    sdk = response_conv.deserialize_forward_backward_output(msg.SerializeToString())
    for ours, theirs in zip(outs, sdk.loss_fn_outputs):
        assert theirs["logprobs"].shape == list(ours["logprobs"].shape)
        np.testing.assert_array_equal(theirs["logprobs"].to_numpy(), ours["logprobs"])


# ------------------------------------------------------------------ edge validation (gateway)


def _fb(loss_fn: str, inputs: dict) -> P.FwdBwdRequest:
    return P.FwdBwdRequest("m", 1, loss_fn, {}, False, [P.FwdBwdDatum([1, 2, 3], inputs)])


@pytest.mark.parametrize("loss_fn, inputs, field, match", [
    ("importance_sampling", {"target_tokens": np.zeros((3, 2), np.int64), "logprobs": np.zeros(3, np.float32),
                             "advantages": np.zeros(3, np.float32)}, "target_tokens", "cross_entropy"),
    ("cross_entropy", {"target_tokens": np.zeros((3, 0), np.int64)}, "target_tokens", "K dimension"),
    ("cross_entropy", {"target_tokens": np.zeros((3, 2, 2), np.int64)}, "target_tokens", r"\[T\] or \[T, K\]"),
    ("cross_entropy", {"target_tokens": np.zeros((3, 2), np.int64), "weights": np.zeros(3, np.float32)},
     "weights", "must equal"),
    ("ppo", {"target_tokens": np.zeros(3, np.int64), "logprobs": np.zeros((3, 2), np.float32),
             "advantages": np.zeros(3, np.float32)}, "logprobs", "one value per position"),
])
def test_gateway_refuses_bad_target_shapes_naming_the_field(loss_fn, inputs, field, match):
    from functions.gateway.fwdbwd import validate_datums
    from openrl.errors import UserError

    with pytest.raises(UserError, match=match) as e:
        validate_datums(_fb(loss_fn, inputs), vocab=VOCAB)
    assert f"data[0].loss_fn_inputs.{field}" in str(e.value)


def test_gateway_accepts_two_d_cross_entropy():
    from functions.gateway.fwdbwd import validate_datums

    validate_datums(_fb("cross_entropy", {"target_tokens": np.ones((3, 4), np.int64),
                                          "weights": np.full((3, 4), 0.25, np.float32)}), vocab=VOCAB)
