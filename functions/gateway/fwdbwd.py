"""The body of ``/forward_backward`` and ``/forward``: read, decompress, decode, check.

The SDK sends a protobuf ``ForwardBackwardRequest`` (``Content-Type: application/x-protobuf``,
zstd when ``Content-Encoding`` says so). Any other client may send the SDK's JSON types instead
(``Content-Type: application/json``: ``{model_id, seq_id, forward_backward_input: {data: [Datum],
loss_fn, loss_fn_config}}``, ``forward_input`` on ``/forward``; :class:`openrl.edge.wire.ForwardBackwardJsonRequest`),
which the gateway encodes as the SDK would. :data:`ForwardBackwardDep` gives the route the
decoded request plus the protobuf bytes, which are published as the event's data (see
:mod:`openrl.contract.payloads`); :func:`validate_datums` holds the edge checks that need the
run's base model. Every error here is a :class:`openrl.errors.UserError`, so the route's
seq_id is skipped (:mod:`functions.gateway.skips`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

import numpy as np
from fastapi import Depends, Request

from functions.gateway.context import BodyTooLarge, require
from functions.gateway.deps import GatewayDep
from openrl.edge import proto
from openrl.edge.proto.compress import decompress
from openrl.errors import UserError


@dataclass
class ForwardBackwardBody:
    """A forward_backward request as received.

    Attributes:
        request: the decoded body (model_id, seq_id, loss_fn, datums as numpy arrays).
        data: the decompressed protobuf bytes (at most ``Gateway.body_limit()``), the event's data.
    """

    request: proto.FwdBwdRequest
    data: bytes
    #: what the fields named in errors are under: ``""`` for protobuf, ``forward_backward_input.``
    #: (or ``forward_input.``) for a JSON body
    prefix: str = ""


def decompress_capped(body: bytes, encoding: str | None, limit: int) -> bytes:
    """The body, zstd-decompressed when ``encoding`` says so (:func:`openrl.edge.proto.compress.decompress`),
    at most ``limit`` bytes either way.

    Raises:
        UserError: ``Content-Encoding`` not zstd/identity; ``body`` not valid zstd.
        BodyTooLarge: more than ``limit`` bytes (413; a small zstd body cannot expand without bound).
    """
    body = decompress(body, encoding, limit=limit)
    if len(body) > limit:
        raise BodyTooLarge("body", f"forward_backward body exceeds the limit of {limit} bytes")
    return body


async def forward_backward_body(request: Request, g: GatewayDep) -> ForwardBackwardBody:
    """Dependency: the request's ``ForwardBackwardRequest``.

    Raises:
        BodyTooLarge: the body (declared, or decompressed) is over ``g.body_limit()`` (413);
            :class:`functions.gateway.app.BodyCapMiddleware` passed only its head.
        UserError: not ``application/x-protobuf``; a bad ``Content-Encoding``; malformed zstd
            or protobuf, naming the field.
    """
    body = await request.body()
    oversize = getattr(request.state, "oversize", None)
    if oversize is not None:  # only the head was read: enough to skip the seq_id
        raise BodyTooLarge("body", f"request body of {oversize} bytes exceeds the limit of {g.body_limit()} bytes")
    ctype = (request.headers.get("content-type") or "").lower()
    if "protobuf" in ctype:
        data = decompress_capped(body, request.headers.get("content-encoding"), g.body_limit())
        return ForwardBackwardBody(proto.decode_forward_backward_request(data, require_seq_id=False), data)
    if ctype and "json" not in ctype:
        raise UserError("content-type", f"{ctype!r}: send application/x-protobuf (the SDK's ForwardBackwardRequest) "
                                        "or application/json (its JSON form)")
    forward = request.url.path.rstrip("/").endswith("/forward")
    key = "forward_input" if forward else "forward_backward_input"
    body = decompress_capped(body, request.headers.get("content-encoding"), g.body_limit())
    fb, data = json_forward_backward(body, forward)
    if len(data) > g.body_limit():
        raise BodyTooLarge("body", f"the request as protobuf ({len(data)} bytes) exceeds the limit of "
                                   f"{g.body_limit()} bytes")
    return ForwardBackwardBody(fb, data, f"{key}.")


def json_forward_backward(body: bytes, forward: bool) -> tuple[proto.FwdBwdRequest, bytes]:
    """A JSON ``/forward_backward`` (``forward=False``) or ``/forward`` body, decoded and encoded
    as the SDK's protobuf ``ForwardBackwardRequest`` (the trainer's one input format).

    Returns:
        The decoded request and its protobuf bytes.

    Raises:
        UserError: naming the JSON field (``forward_backward_input.data[0].loss_fn_inputs.weights``, ...).
    """
    from openrl.edge import wire

    model = wire.ForwardJsonRequest if forward else wire.ForwardBackwardJsonRequest
    key = "forward_input" if forward else "forward_backward_input"
    req = wire.parse_request(model, body)
    require(req.seq_id is None or 1 <= req.seq_id <= 2**31 - 1, "seq_id",
            "must be between 1 and 2^31-1 (an int32 on the protobuf wire), or left out")
    inp = getattr(req, key)
    datums = []
    for i, d in enumerate(inp.data):
        fld = f"{key}.data[{i}]"
        tokens = d.model_input.to_tokens(f"{fld}.model_input")
        inputs = {k: td.to_numpy(0, f"{fld}.loss_fn_inputs.{k}") for k, td in d.loss_fn_inputs.items()}
        datums.append(proto.FwdBwdDatum(tokens, inputs))
    data = proto.encode_forward_backward_request(req.model_id, req.seq_id or 0, datums, inp.loss_fn,
                                                 inp.loss_fn_config, forward_only=forward)
    try:
        return proto.decode_forward_backward_request(data, require_seq_id=False), data
    except UserError as exc:
        raise renamed(exc, f"{key}.{exc.field}" if exc.field.startswith("data") else exc.field) from None


def with_seq_id(data: bytes, seq_id: int) -> bytes:
    """A protobuf ``ForwardBackwardRequest`` (``data``, decompressed) with its ``seq_id`` set:
    the number the gateway gave a request that came without one."""
    msg = proto.ForwardBackwardRequest()
    msg.ParseFromString(data)
    msg.seq_id = seq_id
    return msg.SerializeToString()


def renamed(exc: UserError, field: str) -> UserError:
    """``exc`` naming ``field`` instead (same class, status and message)."""
    rest = exc.message[len(exc.field) + 2:] if exc.message.startswith(exc.field + ": ") else exc.message
    exc.field, exc.message = field, f"{field}: {rest}"
    exc.args = (exc.message,)
    return exc


ForwardBackwardDep = Annotated[ForwardBackwardBody, Depends(forward_backward_body)]


def validate_datums(fb: proto.FwdBwdRequest, vocab: int, max_context: int | None = None) -> None:
    """Edge checks of a forward_backward body: non-empty, token ids in the vocabulary, at most
    ``max_context`` tokens per datum, target lengths, ``loss_fn_inputs`` keys that some loss knows
    (:data:`openrl.edge.proto.LOSS_FN_INPUT_KINDS`; a known key the loss does not read is accepted
    and checked like the others, see :mod:`functions.trainer.losses`), finite float inputs (no NaN/inf), provenance
    spans that tile the input and the targets (:func:`openrl.edge.proto.check_spans`; accepted with
    every loss), and spans on every datum of a ``stable_reinforce`` request (they name the
    recorded samples it trains on).

    Raises:
        UserError: naming the datum and field.
    """
    require(len(fb.data) > 0, "data", "at least one datum is required")
    for i, d in enumerate(fb.data):
        require(len(d.tokens) > 0, f"data[{i}].model_input", "empty model input")
        require(max_context is None or len(d.tokens) <= max_context, f"data[{i}].model_input",
                f"{len(d.tokens)} tokens exceed the model's context of {max_context}")
        bad = [t for t in d.tokens if t < 0 or t >= vocab]
        require(not bad, f"data[{i}].model_input", f"token id {bad[:1]} outside the vocabulary [0, {vocab})")
        for key, arr in d.loss_fn_inputs.items():
            a = np.asarray(arr)
            fld = f"data[{i}].loss_fn_inputs.{key}"
            require(key in proto.LOSS_FN_INPUT_KINDS, fld,
                    f"not an input of any loss (known: {', '.join(proto.LOSS_FN_INPUT_KINDS)}); keep client-side "
                    "fields out of loss_fn_inputs")
            require(a.ndim >= 1 and a.shape[0] == len(d.tokens), fld,
                    f"shape {list(a.shape)}: the first dimension must be the model_input length {len(d.tokens)}")
            require(a.dtype.kind != "f" or bool(np.isfinite(a).all()), fld, "must be finite (no NaN or inf)")
        tt = d.loss_fn_inputs.get("target_tokens")
        if tt is not None:
            require(tt.shape[0] == len(d.tokens), f"data[{i}].loss_fn_inputs.target_tokens",
                    f"length {tt.shape[0]} != model_input length {len(d.tokens)}")
            require(bool(((tt >= 0) & (tt < vocab)).all()), f"data[{i}].loss_fn_inputs.target_tokens",
                    f"token id outside the vocabulary [0, {vocab})")
            check_target_shapes(fb.loss_fn, d.loss_fn_inputs, i)
        proto.check_spans(d, i)
        require(fb.loss_fn != "stable_reinforce" or d.loss_fn_input_spans is not None, f"data[{i}].loss_fn_input_spans",
                "stable_reinforce needs provenance on every datum (Datum.with_provenance naming the sequence_id "
                "of samples drawn with record_stability_info=True)")


#: loss_fn_inputs that hold one value per position: [T] even when target_tokens is [T, K].
_PER_POSITION_KEYS = ("advantages", "logprobs", "clip_low_threshold", "clip_high_threshold", "sequence_ratio_mask")
#: losses whose target_tokens may be [T, K] (K candidate targets per position): cross_entropy,
#: which forward() and the SDK's forward_backward_custom also send.
TWO_D_LOSSES = ("cross_entropy",)


def check_target_shapes(loss_fn: str, inputs: dict[str, np.ndarray], i: int) -> None:
    """Shapes of one datum's targets: ``target_tokens`` [T] or, for :data:`TWO_D_LOSSES`, [T, K]
    with K >= 1; ``weights`` exactly ``target_tokens``' shape; per-position inputs
    (advantages, logprobs, clip thresholds, sequence_ratio_mask) [T].

    Raises:
        UserError: naming ``data[i].loss_fn_inputs.<key>``.
    """
    tt = inputs["target_tokens"]
    fld = f"data[{i}].loss_fn_inputs"
    require(tt.ndim in (1, 2), f"{fld}.target_tokens", f"must have shape [T] or [T, K], got {list(tt.shape)}")
    if tt.ndim == 2:
        require(loss_fn in TWO_D_LOSSES, f"{fld}.target_tokens",
                f"[T, K] targets are accepted with loss_fn {', '.join(map(repr, TWO_D_LOSSES))} "
                f"(forward, forward_backward, forward_backward_custom), not {loss_fn!r}")
        require(tt.shape[1] >= 1, f"{fld}.target_tokens", "the K dimension of [T, K] targets must be >= 1")
    w = inputs.get("weights")
    if w is not None:
        require(w.shape == tt.shape, f"{fld}.weights",
                f"shape {list(w.shape)} must equal that of target_tokens {list(tt.shape)}")
    for key in _PER_POSITION_KEYS:
        a = inputs.get(key)
        require(a is None or a.shape == tt.shape[:1], f"{fld}.{key}",
                f"shape {list(a.shape) if a is not None else None} must be [{tt.shape[0]}] (one value per position)")
