"""The rows of a packed pass: one datum each, how they are cut into micro-batches, and the
per-row step (logprobs → loss → outputs) that the one-GPU engine and the distributed engine
share.

A :class:`Row` is one datum of one forward / forward_backward request ("item") after
validation (:func:`prepare_item`). :func:`plan_micro_batches` is a pure function of the rows
and the caps; :func:`row_step` is what every engine does with one row of a micro-batch's
target logprobs. Nothing here holds engine state.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

import numpy as np
import torch

from functions.trainer import losses
from functions.trainer.mismatch import sampled_token_mask, sampler_logprobs_of
from openrl.edge.proto import FwdBwdDatum
from openrl.errors import UserError


@dataclass
class Row:
    """One validated datum of a packed pass.

    Attributes:
        item: index of its request in the pass's item list.
        datum: index of the datum in its request (``data[datum]``).
        tokens: int64 [T], the model input.
        inputs: the loss's inputs (:func:`functions.trainer.losses.prepare_inputs`), on the
            engine's device; ``target_tokens`` is int64 [T] or [T, K].
        grad: the row trains (its request is a forward_backward).
    """

    item: int
    datum: int
    tokens: torch.Tensor
    inputs: dict[str, torch.Tensor]
    grad: bool

    @property
    def n(self) -> int:
        """T, the row's tokens."""
        return int(self.tokens.shape[0])

    @property
    def k(self) -> int:
        """Targets per position: 1 for 1-D ``target_tokens``, else K."""
        tt = self.inputs["target_tokens"]
        return 1 if tt.dim() == 1 else int(tt.shape[1])


def prepare_item(idx: int, datums: Sequence[FwdBwdDatum], loss_fn: str, forward_only: bool, *,
                 vocab_size: int, max_positions: int | None, device: torch.device) -> list[Row]:
    """Validate the datums of request ``idx`` and make its rows.

    Args:
        idx: the request's index in the pass.
        datums: its decoded datums (``tokens`` int [T], ``loss_fn_inputs`` dense arrays).
        loss_fn: the Tinker loss name (its inputs are checked by ``losses.prepare_inputs``).
        forward_only: a forward request (its rows carry no gradient).
        vocab_size: token ids must lie in ``[0, vocab_size)``.
        max_positions: the model's context in tokens (None: unchecked).
        device: where the loss inputs go.

    Raises:
        UserError: ``data[j].model_input`` empty, not integers, out of the vocabulary or longer
            than the context; or a ``data[j].loss_fn_inputs.*`` field the loss rejects.
    """
    rows = []
    for j, d in enumerate(datums):
        toks = np.asarray(d.tokens)
        fld = f"data[{j}].model_input"
        if toks.ndim != 1 or toks.size == 0:
            raise UserError(fld, "must hold at least one token")
        if toks.dtype.kind not in "iu":
            raise UserError(fld, "tokens must be integers")
        if toks.min() < 0 or toks.max() >= vocab_size:
            raise UserError(fld, f"token ids must lie in [0, {vocab_size})")
        if max_positions is not None and toks.size > max_positions:
            raise UserError(fld, f"length {toks.size} exceeds the model's context of {max_positions} tokens")
        inputs = losses.prepare_inputs(loss_fn, d.loss_fn_inputs, int(toks.size), j,
                                       vocab_size=vocab_size, device=device)
        rows.append(Row(idx, j, torch.from_numpy(toks.astype(np.int64)), inputs, not forward_only))
    return rows


def plan_micro_batches(rows: Sequence[Row], max_rows: int, max_tokens: int) -> list[list[Row]]:
    """``rows`` longest first, cut into micro-batches of at most ``max_rows`` rows and
    ``max_tokens`` padded tokens (rows × the longest row); a row longer than ``max_tokens``
    runs alone. Pure: the same rows and caps give the same plan on every rank."""
    order = sorted(rows, key=lambda r: -r.n)
    batches: list[list[Row]] = []
    cur: list[Row] = []
    for r in order:
        longest = cur[0].n if cur else r.n  # rows come longest first
        if cur and (len(cur) + 1 > max_rows or (len(cur) + 1) * longest > max_tokens):
            batches.append(cur)
            cur = []
        cur.append(r)
    if cur:
        batches.append(cur)
    return batches


def runs_span_micro_batches(plan: Sequence[Sequence[Row]], run_of: Callable[[Row], str]) -> bool:
    """Whether some run's rows fall in two or more micro-batches of ``plan`` (rows of varied
    lengths, sorted longest first, spread each run over the pass; the deterministic mode's one
    row per micro-batch): then its adapter's compute-dtype cast is worth making once for the
    pass (``MultiLoRAModel.pass_weights``); otherwise each is used once and caching it would
    only hold its memory until the pass ends. ``run_of`` maps a row to its run id."""
    seen: set[str] = set()
    for mb in plan:
        here = {run_of(r) for r in mb}
        if here & seen:
            return True
        seen |= here
    return False


def padded_tokens(mb: Sequence[Row]) -> int:
    """Padded tokens of a micro-batch: rows × its longest row (0 when empty)."""
    return len(mb) * max((r.n for r in mb), default=0)


def row_logprobs(lp: torch.Tensor, b: int, r: Row) -> torch.Tensor:
    """Row ``b`` of a micro-batch's ``lp`` (float32 [B, T, K]) cut to datum ``r``: [n] for 1-D
    targets, else [n, k]; detached when ``r`` does not train."""
    row_lp = lp[b, : r.n, 0] if r.inputs["target_tokens"].dim() == 1 else lp[b, : r.n, : r.k]
    return row_lp if r.grad else row_lp.detach()


def mismatch_inputs(r: Row) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(sampler logprobs [T], bool mask [T])`` of a row whose datum carries the sampler's
    logprobs of 1-D targets (:mod:`functions.trainer.mismatch`), else None. A loss whose sampled
    tokens and logprobs come from elsewhere hooks in here: stable_reinforce's recorded logprobs
    count on the tokens its provenance spans name as sampled."""
    recorded = r.inputs.get(losses.RECORDED_LOGPROBS)
    if recorded is not None:
        return recorded, r.inputs[losses.SAMPLED_MASK] != 0
    q = sampler_logprobs_of(r.inputs)
    if q is None or r.inputs["target_tokens"].dim() != 1:
        return None
    return q, sampled_token_mask(r.inputs, q)


@dataclass
class RowStep:
    """What one row of a micro-batch gives.

    Attributes:
        logprobs: the row's target logprobs, float32 [n] or [n, k] (with graph when it trains).
        loss: 0-dim float32, the row's loss (with graph when it trains).
        outputs: its ``loss_fn_outputs`` tensors (e.g. ``logprobs`` [n] / [n, k]).
        metrics: the loss's metrics for this row (merged per request by the caller).
        sampled: ``(sampler logprobs [n], bool mask [n])`` when the datum carries them
            (:func:`mismatch_inputs`), else None.
    """

    logprobs: torch.Tensor
    loss: torch.Tensor
    outputs: dict[str, torch.Tensor]
    metrics: dict[str, float]
    sampled: tuple[torch.Tensor, torch.Tensor] | None


def row_step(lp: torch.Tensor, b: int, r: Row, loss_fn: str, config: Mapping[str, float]) -> RowStep:
    """The loss of row ``b`` of a micro-batch whose target logprobs are ``lp`` (float32
    [B, T, K]): the step the one-GPU and the distributed engine share. Call it under the
    grad mode of the micro-batch; the caller sums the losses of training rows and runs the
    backward.

    Raises:
        whatever :func:`functions.trainer.losses.compute_loss` raises for the loss.
    """
    row_lp = row_logprobs(lp, b, r)
    loss, outputs, metrics = losses.compute_loss(loss_fn, row_lp, r.inputs, config)
    return RowStep(row_lp, loss, outputs, metrics, mismatch_inputs(r))


__all__ = ["Row", "RowStep", "mismatch_inputs", "padded_tokens", "plan_micro_batches", "prepare_item",
           "row_logprobs", "row_step", "runs_span_micro_batches"]
