"""Resolving the provenance spans of a ``stable_reinforce`` request to the sampler logprobs
recorded at sampling time (:mod:`openrl.contract.stability`).

For each datum, every span's ``sequence_id`` must name a record of the training run's own client
session that has not expired; sampled spans must lie inside the recorded sequence and (in
``model_input`` and in 1-D ``target_tokens``) repeat its tokens; prompt spans must lie inside
its prompt. The datum then gets two server-side ``loss_fn_inputs``
(:data:`functions.trainer.losses.RECORDED_LOGPROBS`, float32 [T]: the recorded logprob of each
target covered by a ``SampledProvenanceSpan``, 0 elsewhere; :data:`~functions.trainer.losses.SAMPLED_MASK`,
float32 [T]: 1 there, 0 elsewhere), and every record used is touched (its day restarts).
"""

from __future__ import annotations

import asyncio

import numpy as np

from functions.trainer.losses import RECORDED_LOGPROBS, RESERVED_INPUTS, SAMPLED_MASK
from openrl.contract.stability import SequenceRecord, session_of
from openrl.edge.proto import FwdBwdRequest, Span, check_spans
from openrl.errors import UserError

LOSS = "stable_reinforce"


async def resolve_request(store, fb: FwdBwdRequest, *, model_id: str, owner: str | None) -> None:
    """Add the recorded sampler logprobs to every datum of ``fb`` (in place) and touch the records.

    Args:
        store: a :class:`openrl.transport.stability.StabilityStore` (``get`` / ``expired`` /
            ``touch`` / ``delete``).
        fb: the decoded request (``loss_fn == "stable_reinforce"``).
        model_id: the training run; its client session is the only one whose records it may use.
        owner: the run's owner id, when known (a record of another owner is refused too).

    Raises:
        UserError: naming the field: ``data[i].loss_fn_input_spans`` (none sent),
            ``data[i].<spans>[j].sequence_id`` (unknown, expired, or of another session),
            ``data[i].<spans>[j]`` (outside the recorded sequence or its prompt, or tokens that
            differ from the recorded ones), ``data[i].loss_fn_inputs.<reserved key>`` (sent by
            the client).
    """
    session = session_of(model_id)
    ids = set()
    for i, d in enumerate(fb.data):
        for key in RESERVED_INPUTS:
            if key in d.loss_fn_inputs:
                raise UserError(f"data[{i}].loss_fn_inputs.{key}", "is set by the server for stable_reinforce "
                                                                    "from the recorded samples; do not send it")
        if d.loss_fn_input_spans is None or d.model_input_spans is None:
            raise UserError(f"data[{i}].loss_fn_input_spans", "stable_reinforce needs provenance on every datum")
        check_spans(d, i)
        ids.update(s.sequence_id for s in (*d.model_input_spans, *d.loss_fn_input_spans))
    order = sorted(ids)
    found = dict(zip(order, await asyncio.gather(*(store.get(sid) for sid in order))))
    used: dict[str, SequenceRecord] = {}
    for i, d in enumerate(fb.data):
        for name in ("model_input_spans", "loss_fn_input_spans"):
            for j, s in enumerate(getattr(d, name)):
                used[s.sequence_id] = await _record(store, found, s, f"data[{i}].{name}[{j}]", session, owner)
        tt = d.loss_fn_inputs.get("target_tokens")
        _check_tokens(d.model_input_spans, np.asarray(d.tokens), found, f"data[{i}].model_input_spans")
        n = len(d.tokens)
        recorded = np.zeros(n, dtype=np.float32)
        mask = np.zeros(n, dtype=np.float32)
        targets = np.asarray(tt) if tt is not None and np.asarray(tt).ndim == 1 else None
        _check_tokens(d.loss_fn_input_spans, targets, found, f"data[{i}].loss_fn_input_spans",
                      recorded=recorded, mask=mask)
        d.loss_fn_inputs[RECORDED_LOGPROBS] = recorded
        d.loss_fn_inputs[SAMPLED_MASK] = mask
    await store.touch(used.items())


async def _record(store, found: dict, s: Span, fld: str, session: str | None, owner: str | None) -> SequenceRecord:
    rec = found.get(s.sequence_id)
    f = f"{fld}.sequence_id"
    if rec is None:
        raise UserError(f, f"unknown sequence_id {s.sequence_id!r}: no stability record (sample with "
                           "record_stability_info=True; records last one day after sampling or their last use)")
    if store.expired(rec):
        await store.delete(s.sequence_id)
        found[s.sequence_id] = None
        raise UserError(f, f"sequence_id {s.sequence_id!r} expired: stability records are trainable for one day "
                           "after sampling or after their last training use")
    if session is None or rec.session_id != session or (owner and rec.owner and rec.owner != owner):
        raise UserError(f, f"sequence_id {s.sequence_id!r} was sampled in another session; stability records "
                           "are session-scoped (train with a training client of the session that sampled it)")
    return rec


def _check_tokens(spans: list[Span], tokens: np.ndarray | None, found: dict, fld: str, *,
                  recorded: np.ndarray | None = None, mask: np.ndarray | None = None) -> None:
    """Walk the runs of one field: bounds against the record, token identity on sampled runs
    (when ``tokens`` is given), and fill ``recorded`` / ``mask`` on sampled runs."""
    pos = 0
    for j, s in enumerate(spans):
        rec: SequenceRecord = found[s.sequence_id]
        f = f"{fld}[{j}]"
        if s.kind == "prompt":
            if s.offset + s.length > rec.prompt_len:
                raise UserError(f, f"prompt positions [{s.offset}, {s.offset + s.length}) lie outside the "
                                   f"{rec.prompt_len}-token prompt of sequence {s.sequence_id!r}")
        else:
            n = len(rec.tokens)
            if s.offset + s.length > n:
                raise UserError(f, f"sampled positions [{s.offset}, {s.offset + s.length}) lie outside the "
                                   f"{n} sampled tokens of sequence {s.sequence_id!r}")
            want = rec.tokens[s.offset:s.offset + s.length]
            if tokens is not None and not np.array_equal(tokens[pos:pos + s.length], want):
                raise UserError(f, f"the tokens at positions [{pos}, {pos + s.length}) are not the sampled tokens "
                                   f"[{s.offset}, {s.offset + s.length}) of sequence {s.sequence_id!r}")
            if recorded is not None:
                recorded[pos:pos + s.length] = rec.logprobs[s.offset:s.offset + s.length]
                mask[pos:pos + s.length] = 1.0
        pos += s.length
