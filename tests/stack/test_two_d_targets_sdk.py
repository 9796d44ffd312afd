"""(T, K) targets through the real SDK and the embedded stack (issue 13 item 4).

``forward`` with [T, K] ``target_tokens`` returns [T, K] logprobs; ``forward_backward_custom``
with a (T, K) loss runs its two phases (a cross_entropy forward, then a cross_entropy backward
whose [T, K] ``weights`` = -dLoss/dlogprobs the SDK sends as sparse CSR) and moves the model the
way the loss says; the cookbook 0.6.1 ``recipes/decisions`` datums and loss run unmodified on a
batch mixing 2 and 4 choices (ragged K). The decisions' questions are stand-in data written here.
Nothing is mocked.
"""

from __future__ import annotations

import numpy as np
import pytest
import tinker
import torch
from tinker import types

from conftest import BASE_MODEL
from tolerances import TOL, check_close, check_loss

SEQ = [9707, 1879, 11, 419, 374, 264, 1273, 315, 279, 11691, 9128, 13]


@pytest.fixture(scope="module")
def svc(stack, api_key):
    return tinker.ServiceClient(base_url=stack.base_url, api_key=api_key)


def _lp(out, i: int = 0) -> np.ndarray:
    td = out.loss_fn_outputs[i]["logprobs"]
    return np.asarray(td.to_numpy(), dtype=np.float64)


def _two_d_datum(K: int = 3) -> tuple[types.Datum, torch.Tensor]:
    n = len(SEQ) - 1
    tt = torch.tensor([[SEQ[t + 1], 200 + t, 7][:K] for t in range(n)], dtype=torch.int64)
    return types.Datum(model_input=types.ModelInput.from_ints(SEQ[:-1]),
                       loss_fn_inputs={"target_tokens": types.TensorData.from_torch(tt)}), tt


def test_forward_returns_t_by_k_logprobs(svc):
    tc = svc.create_lora_training_client(base_model=BASE_MODEL, rank=4, seed=31).result()
    d2, tt = _two_d_datum()
    one_d = types.Datum(model_input=types.ModelInput.from_ints(SEQ[:-1]),
                        loss_fn_inputs={"target_tokens": SEQ[1:]})
    out = tc.forward([d2, one_d], "cross_entropy").result()
    td = out.loss_fn_outputs[0]["logprobs"]
    assert td.shape == list(tt.shape)  # the SDK's TensorData carries [T, K]
    lp2, lp1 = _lp(out, 0), _lp(out, 1)
    assert lp2.shape == tuple(tt.shape) and lp1.shape == (len(SEQ) - 1,)
    # column 0 holds the 1-D targets (two rows of one pass)
    check_close("repeat_logprob", lp2[:, 0], lp1, TOL.repeat_logprob, what="[T, K] column 0 vs 1-D row, one pass")
    assert (lp2 < 0).all() and not np.allclose(lp2[:, 1], lp2[:, 2])
    assert out.metrics["loss:sum"] == pytest.approx(float(-lp2.sum() - lp1.sum()), rel=1e-5)


def test_forward_backward_custom_with_t_by_k_loss(svc):
    """A soft-target loss over K candidates at every position: the custom loss sees [T, K]
    logprobs, its reported value is the formula on the forward logprobs, and one step moves
    probability towards the target distribution."""
    tc = svc.create_lora_training_client(base_model=BASE_MODEL, rank=4, seed=32).result()
    d2, tt = _two_d_datum()
    target = torch.tensor([0.2, 0.7, 0.1])
    seen = []

    def soft_ce(data, logprobs_list):
        lp = logprobs_list[0]
        seen.append(tuple(lp.shape))
        probs = torch.softmax(lp, dim=-1)  # distribution over the K candidates
        loss = -(target * torch.log(probs)).sum()
        return loss, {"soft_ce:sum": float(loss.detach())}

    before = _lp(tc.forward([d2], "cross_entropy").result())
    hand = float(-(target.double() * torch.log_softmax(torch.from_numpy(before), -1)).sum())
    out = tc.forward_backward_custom([d2], soft_ce).result()
    assert seen == [tuple(tt.shape)]
    # the custom loss's own forward vs ``before``; |dL/dlp| sums to at most 2 per position
    check_loss("repeat_logprob", out.metrics["soft_ce:sum"], hand, TOL.repeat_logprob, 2 * len(tt))
    # a small step: Adam's first update moves every LoRA element by about lr whatever its
    # gradient (eps 1e-12), which at 1e-3 overshoots on a 36-layer 4B model (H200: the soft
    # cross-entropy went from 16.8 to 30.0); at 1e-4 the first-order decrease holds on both
    tc.optim_step(types.AdamParams(learning_rate=1e-4)).result()
    after = _lp(tc.forward([d2], "cross_entropy").result())
    p0, p1 = (torch.softmax(torch.from_numpy(x), -1) for x in (before, after))
    assert float((target.double() * torch.log(p1)).sum()) > float((target.double() * torch.log(p0)).sum())


def test_cookbook_decisions_recipe_datums_and_loss(svc):
    """recipes/decisions unmodified: decision_dist_datums ((T, K) targets and weights, the last
    row holding the K choice tokens) and probability_loss through forward_backward_custom, with
    2- and 4-choice decisions in one batch; its accuracy/target_prob metrics come back."""
    pytest.importorskip("tinker_cookbook")
    from tinker_cookbook import renderers
    from tinker_cookbook.recipes.decisions import Decision, DecisionRenderer
    from tinker_cookbook.recipes.decisions.train import decision_dist_datums, probability_loss

    tc = svc.create_lora_training_client(base_model=BASE_MODEL, rank=4, seed=33).result()
    renderer = renderers.get_renderer("role_colon", tc.get_tokenizer())
    dr = DecisionRenderer(renderer)
    teams = Decision("Who answers a question about invoices?", [("billing", "charges"), ("sdk", "the package"),
                                                                ("console", "the web UI"), ("cookbook", "recipes")])
    yes_no = Decision("Is the sky green?", [("yes", ""), ("no", "")])
    datums = decision_dist_datums(dr, [(teams, {"billing": 1.0}), (yes_no, {"no": 0.8, "yes": 0.2})])
    assert [tuple(d.loss_fn_inputs["target_tokens"].shape)[1] for d in datums] == [4, 2]
    loss = probability_loss(lambda probs, target: ((probs - target) ** 2).sum())

    fwd = tc.forward(datums, "cross_entropy").result()
    shapes = [tuple(o["logprobs"].shape) for o in fwd.loss_fn_outputs]
    assert shapes == [tuple(d.loss_fn_inputs["target_tokens"].shape) for d in datums]
    res = tc.forward_backward_custom(datums, loss).result()
    assert {"loss", "target_prob:mean", "accuracy"} <= set(res.metrics)
    # the recipe's loss on the forward logprobs, by hand
    want = []
    for d, o in zip(datums, fwd.loss_fn_outputs):
        probs = torch.softmax(torch.tensor(o["logprobs"].to_numpy()[-1], dtype=torch.float64), -1)
        want.append(float(((probs - d.loss_fn_inputs["weights"].to_torch()[-1].double()) ** 2).sum()))
    # the custom loss's own forward vs ``fwd``; |dL/dlp| <= 4 per choice row (mean over datums)
    check_loss("repeat_logprob", res.metrics["loss"], float(np.mean(want)), TOL.repeat_logprob, 4.0)
    tc.optim_step(types.AdamParams(learning_rate=1e-3)).result()
    res2 = tc.forward_backward_custom(datums, loss).result()
    assert res2.metrics["loss"] < res.metrics["loss"]
