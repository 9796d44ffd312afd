"""The plain-Python values the codecs take and give: a decoded training example and request,
and a sampled sequence to encode. One :class:`FwdBwdDatum` type serves the gateway (edge
validation), the trainer function and the trainer engine."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass(frozen=True)
class Span:
    """One provenance run of a datum (the SDK's ``PromptProvenanceSpan`` /
    ``SampledProvenanceSpan``): positions ``[offset, offset + length)`` of the named sequence's
    request prompt (``kind == "prompt"``) or of its sampled tokens (``kind == "sampled"``).
    Runs tile the field they annotate in order (see :func:`openrl.edge.proto.check_spans`).

    Attributes:
        kind: ``"prompt"`` or ``"sampled"``.
        sequence_id: a ``SampledSequence.sequence_id`` (non-empty).
        offset: >= 0. length: >= 0 (a count of token positions).
    """

    kind: str
    sequence_id: str
    offset: int
    length: int


@dataclass
class FwdBwdDatum:
    """One decoded training example.

    Attributes:
        tokens: the model input, all ``encoded_text`` chunks concatenated (token ids ≥ 0).
        loss_fn_inputs: name → dense, writable numpy array. ``int64`` for integer
            wire dtypes (``target_tokens`` always), ``float32`` otherwise. Shape is
            the tensor's ``shape`` (``[len(data)]`` when the SDK sent none); for
            ``target_tokens``/``weights``/``advantages``/``logprobs`` the leading
            dimension equals ``len(tokens)``. CSR tensors are densified with 0.
            E.g. ``target_tokens`` int64 [T] (or [T, K] for cross_entropy over K
            targets), ``weights`` / ``advantages`` / ``logprobs`` float32 [T].
    """

    tokens: list[int]
    loss_fn_inputs: dict[str, np.ndarray] = field(default_factory=dict)
    #: provenance of ``tokens`` / of the ``target_tokens`` rows (``Datum.with_provenance``), or
    #: None when the SDK sent none; each list tiles its field (checked at the edge).
    model_input_spans: list[Span] | None = None
    loss_fn_input_spans: list[Span] | None = None


@dataclass
class FwdBwdRequest:
    """A decoded ``ForwardBackwardRequest`` (``/forward_backward`` and ``forward``).

    Attributes:
        model_id: the training run id (non-empty).
        seq_id: the per-model sequence number (≥ 1; 0 when the body has none and the decoder was
            told not to require one: the gateway numbers such a request).
        loss_fn: loss function name as sent (e.g. ``"cross_entropy"``); not checked here.
        loss_fn_config: the legacy numeric map merged with ``loss_fn_config_v2``
            (v2 wins); values are ``float`` or ``str``.
        forward_only: True for ``forward()`` (no gradients wanted).
        data: the examples, in request order.
    """

    model_id: str
    seq_id: int
    loss_fn: str
    loss_fn_config: dict[str, float | str]
    forward_only: bool
    data: list[FwdBwdDatum]


@dataclass
class SampledSeq:
    """One sampled completion, as handed to :func:`encode_sample_response`.

    Attributes:
        tokens: generated token ids (int32 on the wire), stop token included if emitted.
        logprobs: per generated token logprob (float32), same length as ``tokens``, or None.
        stop_reason: ``"stop"`` (stop sequence / EOS) or ``"length"`` (max_tokens).
        topk: ``(ids [N, K] int, logprobs [N, K] float)`` top-k per generated token, or
            None. Empty cells: id 0 with logprob -99999.0.
    """

    tokens: Sequence[int]
    logprobs: Sequence[float] | None = None
    stop_reason: Literal["stop", "length"] = "stop"
    topk: tuple[Any, Any] | None = None
