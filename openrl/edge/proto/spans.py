"""Provenance spans of a ``Datum`` (SDK >= 0.38 ``Datum.with_provenance``): decoding from the
protobuf ``ProvenanceSpan`` messages, the tiling check, and encoding (for tests and tools).

Wire (``tinker_public.Datum``): ``model_input_spans`` (3) and ``loss_fn_input_spans`` (4), each a
repeated ``ProvenanceSpan`` = oneof ``prompt_tokens`` (``PromptProvenanceSpan``) /
``sampled_tokens`` (``SampledProvenanceSpan``), both ``{sequence_id: string, offset: int64,
length: int64}``. proto3 cannot tell an empty repeated field from an absent one; a datum always
has >= 1 input token, so a present list is never empty and "empty" means "none sent".

Forward_backward bodies are protobuf in every SDK we support (0.25 to 0.38: ``/forward_backward``
takes ``application/x-protobuf`` only), so there is no JSON form of spans to decode.
"""

from __future__ import annotations

from typing import Any, Sequence

from openrl.edge.proto.types import FwdBwdDatum, Span
from openrl.errors import UserError

#: proto oneof arm -> :attr:`Span.kind`
_ARMS = {"prompt_tokens": "prompt", "sampled_tokens": "sampled"}
_KIND_ARM = {v: k for k, v in _ARMS.items()}


def decode_spans(msgs: Sequence[Any], fname: str) -> list[Span] | None:
    """The :class:`Span` list of one repeated ``ProvenanceSpan`` field, or None when it is empty.

    Args:
        msgs: the repeated field's messages. fname: the field, e.g. ``data[0].model_input_spans``.

    Raises:
        UserError: ``<fname>[j]`` with no span arm set, an empty ``sequence_id``, or a negative
            ``offset`` / ``length``.
    """
    if not len(msgs):
        return None
    out = []
    for j, m in enumerate(msgs):
        f = f"{fname}[{j}]"
        arm = m.WhichOneof("span")
        if arm not in _ARMS:
            raise UserError(f, "a provenance span must be prompt_tokens or sampled_tokens")
        s = getattr(m, arm)
        if not s.sequence_id:
            raise UserError(f"{f}.sequence_id", "must be non-empty")
        if s.offset < 0:
            raise UserError(f"{f}.offset", f"must be >= 0, got {s.offset}")
        if s.length < 0:
            raise UserError(f"{f}.length", f"must be >= 0, got {s.length}")
        out.append(Span(_ARMS[arm], s.sequence_id, int(s.offset), int(s.length)))
    return out


def check_spans(d: FwdBwdDatum, i: int) -> None:
    """The SDK's ``Datum.with_provenance`` contract, checked at the edge: spans come as a pair
    (both lists or neither), ``model_input_spans`` lengths sum to the input length and
    ``loss_fn_input_spans`` lengths to ``target_tokens``' first dimension (the input length).

    Raises:
        UserError: ``data[i].model_input_spans`` / ``data[i].loss_fn_input_spans`` naming the
            miscount or the missing half.
    """
    mi, li = d.model_input_spans, d.loss_fn_input_spans
    if mi is None and li is None:
        return
    if mi is None or li is None:
        missing = "model_input_spans" if mi is None else "loss_fn_input_spans"
        raise UserError(f"data[{i}].{missing}", "provenance comes as a pair: send both span lists or neither")
    tt = d.loss_fn_inputs.get("target_tokens")
    n_targets = int(tt.shape[0]) if tt is not None and tt.ndim >= 1 else len(d.tokens)
    for name, spans, want, what in (("model_input_spans", mi, len(d.tokens), "model_input tokens"),
                                    ("loss_fn_input_spans", li, n_targets, "target_tokens rows")):
        total = sum(s.length for s in spans)
        if total != want:
            raise UserError(f"data[{i}].{name}", f"the spans cover {total} positions but there are {want} "
                                                 f"{what}; the runs must tile them exactly")


def encode_spans(repeated: Any, spans: Sequence[Span] | None) -> None:
    """Append ``spans`` to a repeated ``ProvenanceSpan`` field (the SDK's ``_write_provenance_span``)."""
    for s in spans or ():
        arm = getattr(repeated.add(), _KIND_ARM[s.kind])
        arm.sequence_id, arm.offset, arm.length = s.sequence_id, s.offset, s.length
