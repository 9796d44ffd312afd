"""functions/trainer/rows.py: the micro-batch plan is a pure function of the rows and the caps
(what the one-GPU engine and every rank of the distributed engine compute alike), datums are
checked with errors naming the field, and the per-row step gives the loss and outputs the
loss function gives on the row's logprobs. CPU, no model (fixed inputs, nothing random)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from functions.trainer import losses
from functions.trainer.rows import Row, padded_tokens, plan_micro_batches, prepare_item, row_step
from openrl.edge.proto import FwdBwdDatum
from openrl.errors import UserError


def _row(item: int, n: int, grad: bool = True) -> Row:
    t = torch.arange(n, dtype=torch.long)
    return Row(item, 0, t, {"target_tokens": t, "weights": torch.ones(n)}, grad)


def test_plan_caps_rows_and_padded_tokens_longest_first():
    rows = [_row(i, n) for i, n in enumerate([3, 10, 5, 10, 2, 7])]
    plan = plan_micro_batches(rows, max_rows=2, max_tokens=20)
    assert [[r.n for r in mb] for mb in plan] == [[10, 10], [7, 5], [3, 2]]
    assert all(len(mb) <= 2 and padded_tokens(mb) <= 20 for mb in plan)
    # a token cap under two of the longest rows: each of them runs alone
    plan = plan_micro_batches(rows, max_rows=8, max_tokens=15)
    assert [[r.n for r in mb] for mb in plan] == [[10], [10], [7, 5], [3, 2]]
    # a row longer than the cap still runs, alone
    assert [[r.n for r in mb] for mb in plan_micro_batches(rows, 8, 4)] == [[10], [10], [7], [5], [3], [2]]
    # pure: same input, same plan; the input list is not reordered
    before = [r.n for r in rows]
    assert plan_micro_batches(rows, 2, 20) == plan_micro_batches(list(rows), 2, 20)
    assert [r.n for r in rows] == before
    assert plan_micro_batches([], 2, 20) == [] and padded_tokens([]) == 0


@pytest.mark.parametrize("tokens, field, words", [
    ([], "data[0].model_input", "at least one token"),
    ([1.5, 2.0], "data[0].model_input", "integers"),
    ([1, 99], "data[0].model_input", "[0, 50)"),
    (list(range(9)), "data[0].model_input", "context of 8 tokens"),
])
def test_prepare_item_names_the_field(tokens, field, words):
    d = FwdBwdDatum(np.asarray(tokens), {"target_tokens": np.zeros(max(len(tokens), 1), np.int64),
                                         "weights": np.ones(max(len(tokens), 1), np.float32)})
    with pytest.raises(UserError) as e:
        prepare_item(0, [d], "cross_entropy", False, vocab_size=50, max_positions=8, device=torch.device("cpu"))
    assert e.value.field == field and words in str(e.value)


def test_prepare_item_and_row_step_match_the_loss():
    seq = np.array([3, 1, 4, 1, 5], np.int64)
    d = FwdBwdDatum(seq, {"target_tokens": np.array([1, 4, 1, 5, 9], np.int64),
                          "weights": np.array([0, 1, 1, 1, 1], np.float32)})
    (row,) = prepare_item(2, [d], "cross_entropy", True, vocab_size=50, max_positions=None,
                          device=torch.device("cpu"))
    assert (row.item, row.datum, row.n, row.k, row.grad) == (2, 0, 5, 1, False)
    lp = -torch.arange(1.0, 2 * 7 * 1 + 1).reshape(2, 7, 1) / 10  # [B=2, T=7, K=1], row b=1
    step = row_step(lp, 1, row, "cross_entropy", losses.resolve_config("cross_entropy", None))
    want_lp = lp[1, :5, 0]
    want_loss, want_out, _ = losses.compute_loss("cross_entropy", want_lp, row.inputs,
                                                 losses.resolve_config("cross_entropy", None))
    assert torch.equal(step.logprobs, want_lp) and torch.equal(step.loss, want_loss)
    assert torch.equal(step.outputs["logprobs"], want_out["logprobs"])
    assert step.sampled is None and not step.logprobs.requires_grad
