"""The one sampling path of the gateway: what ``/asample`` and the OpenAI-compatible routes share.

A sample request names what to sample from (a :class:`SampleTarget`: a registered base model,
alone or with an immutable ``tinker://`` snapshot), is checked against that model (vocabulary,
context, token caps), charged to the caller's quotas, recorded as a pending future and
published as a ``dev.openrl.sample.v1`` CloudEvent to the sampler, exactly as the SDK's
``SamplingClient.sample`` is. :func:`wait_sample` then waits for the future and decodes the
sampler's protobuf ``SampleResponse`` for callers that answer synchronously (the OpenAI routes).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from functions.gateway.context import Gateway, require
from functions.gateway.runs import readable_manifest
from openrl.contract import payloads
from openrl.contract.sample_limits import check_sample_size
from openrl.errors import ServerError, UserError
from openrl.storage import TinkerPath
from openrl.transport.bus import SAMPLE_STREAM


@dataclass(frozen=True)
class SampleTarget:
    """What a sample request samples from.

    Attributes:
        base_model: a registered base-model name (checked against the registry).
        model_path: ``tinker://<run>/{sampler_weights|weights}/<name>`` the caller may read (its
            own or a published one), or None for the base model alone.
    """

    base_model: str
    model_path: str | None = None


async def resolve_target(g: Gateway, owner: str, base_model: str | None, model_path: str | None, *,
                         base_field: str = "base_model", path_field: str = "model_path") -> SampleTarget:
    """The :class:`SampleTarget` of a request naming ``model_path`` and/or ``base_model``: a
    snapshot's base model comes from its manifest (a ``base_model`` given with it must agree).

    Raises:
        UserError: neither given; a path that is not a ``sampler_weights`` / ``weights`` tinker://
            path; ``base_model`` unknown or not the snapshot's (400 naming the field).
        NotFound: no checkpoint at ``model_path`` that the caller may read (404 naming it).
    """
    if model_path:
        ckpt = TinkerPath.parse(model_path, field=path_field)
        manifest = await readable_manifest(g, ckpt, owner, path_field)
        # external_weights: an imported adapter, or an unencrypted save_weights_external export
        require(ckpt.kind in ("sampler_weights", "weights") or (
            ckpt.kind == "external_weights" and not manifest.encryption), path_field,
            "expected a tinker://<run>/sampler_weights/<name> path (or weights/<name>, or an unencrypted "
            "external_weights/<name>)")
        base = manifest.base_model
        require(not base_model or base_model == base, base_field,
                f"{base_model!r} is not the base model of {model_path} ({base!r}); leave it out")
        path = str(ckpt)
    else:
        require(bool(base_model), base_field, f"either {base_field} or {path_field} is required")
        base, path = base_model, None
    try:
        g.registry.resolve(base)
    except UserError as exc:
        if base_field == "base_model" or exc.field != "base_model":
            raise
        raise UserError(base_field, exc.message.removeprefix("base_model: ")) from None
    return SampleTarget(base, path)


async def submit_sample(g: Gateway, target: SampleTarget, owner: str, request_id: str, subject: str,
                        req: dict) -> int:
    """Check one sample request against its target, admit it and publish it.

    Args:
        target: what to sample from. owner: the owner id charged (the caller's).
        request_id: the future id (``<sampling_session_id>:<seq_id>`` for the SDK; a fresh id
            for session-less requests). subject: the event subject (the sampling session, or
            the snapshot / base model sampled).
        req: the wire ``SampleRequest`` fields (``prompt`` already turned into
            ``prompt_tokens``: list of int; ``num_samples``; ``sampling_params`` dict; the
            optional logprob fields).

    Returns:
        The ``max_tokens`` each sequence may generate: the given one, or for an omitted one
        ``min(max_tokens_limit, context - len(prompt))``.

    Raises:
        UserError: ``num_samples``, ``sampling_params.max_tokens``, ``prompt`` (empty, or no room
            left in the context) or ``prompt.chunks`` (an id outside the vocabulary) out of
            range for the model (400 naming the field; :func:`openrl.contract.sample_limits.check_sample_size`).
        Overloaded / QuotaExceeded: backpressure or the key's quota (429).
    """
    s = g.settings
    tokens = req["prompt_tokens"]
    n = req.get("num_samples", 1)
    params = dict(req.get("sampling_params") or {})
    # the sampler's engine runs the same check against the loaded model (openrl/contract/sample_limits.py)
    mt = check_sample_size(tokens, n, params.get("max_tokens"), vocab_size=g.vocab_size(target.base_model),
                           max_context=g.registry.resolve(target.base_model).max_context_length,
                           max_num_samples=s.max_num_samples, max_tokens_cap=s.max_tokens_limit)
    await g.admit(SAMPLE_STREAM, request_id, owner=owner, op="sample",
                  tokens=len(tokens) + n * mt)  # tokens_per_min: the most it can use
    data = {**req, "base_model": target.base_model, "model_path": target.model_path,
            "sampling_params": {**params, "max_tokens": mt}}
    data = payloads.Sample.parse(data).to_data()  # the fields the sampler reads (UserError: a field out of range)
    await g.submit("sample", request_id, subject, data, future_meta={"owner": owner})
    return mt


@dataclass
class SampledSequence:
    """One decoded sequence of a ``SampleResponse``.

    Attributes:
        tokens: int list, the generated token ids.
        logprobs: float list (one per token) or None when the sampler sent none.
        stop_reason: ``"stop"`` or ``"length"``.
        topk: per generated token, ``[(token_id, logprob), ...]`` (k pairs), or None.
    """

    tokens: list[int]
    logprobs: list[float] | None
    stop_reason: str
    topk: list[list[tuple[int, float]]] | None = None


@dataclass
class SampleResult:
    """A decoded ``SampleResponse``: the sequences, and the prompt's logprobs when asked
    (``prompt_logprobs``: float per prompt token, None at position 0 / unscored;
    ``prompt_topk``: per prompt token ``[(token_id, logprob), ...]`` or None)."""

    sequences: list[SampledSequence]
    prompt_logprobs: list[float | None] | None = None
    prompt_topk: list[list[tuple[int, float]] | None] | None = None


def _topk(msg) -> list[list[tuple[int, float]]]:
    """Rows of a ``TopkLogprobs``: int32 ids and float32 logprobs, N x k row-major; cells with
    the empty marker (id 0, logprob -99999) are dropped."""
    k, n = int(msg.k), int(msg.length)
    ids = np.frombuffer(msg.token_ids, dtype="<i4").reshape(n, k) if k else np.zeros((n, 0), np.int32)
    lps = np.frombuffer(msg.logprobs, dtype="<f4").reshape(n, k) if k else np.zeros((n, 0), np.float32)
    return [[(int(i), float(lp)) for i, lp in zip(ids[r], lps[r]) if lp > -99999.0] for r in range(n)]


def decode_sample_response(body: bytes) -> SampleResult:
    """Decode the sampler's protobuf ``SampleResponse`` (see the wire protocol, section 9).

    Raises:
        ServerError: the bytes are not a ``SampleResponse``.
    """
    from openrl.edge.proto.schema import SampleResponse

    msg = SampleResponse()
    try:
        msg.ParseFromString(body)
    except Exception as exc:  # noqa: BLE001 - a worker bug, not the caller's
        raise ServerError(f"the sampler's answer is not a SampleResponse: {exc}") from None
    seqs = []
    for sq in msg.sequences:
        lps = np.frombuffer(sq.logprobs, dtype="<f4").tolist() if sq.HasField("logprobs") else None
        topk = _topk(sq.topk_sampled_logprobs) if sq.HasField("topk_sampled_logprobs") else None
        seqs.append(SampledSequence(np.frombuffer(sq.tokens, dtype="<i4").tolist(), lps,
                                    "length" if sq.stop_reason == 1 else "stop", topk))
    out = SampleResult(seqs)
    if msg.HasField("prompt_logprobs"):
        out.prompt_logprobs = [None if np.isnan(v) else float(v)
                               for v in np.frombuffer(msg.prompt_logprobs, dtype="<f4")]
    if msg.HasField("topk_prompt_logprobs"):
        out.prompt_topk = [row or None for row in _topk(msg.topk_prompt_logprobs)]
    return out


async def wait_sample(g: Gateway, request_id: str, timeout_s: float) -> SampleResult:
    """Wait for sample future ``request_id`` and decode it.

    Raises:
        UserError: the sampler failed it with category ``user`` (its message, field ``sample``).
        ServerError: it failed otherwise, or did not finish within ``timeout_s`` seconds.
    """
    import json

    rec = await g.waiter.wait(request_id, timeout_s)
    if rec is None or rec.state == "pending":
        raise ServerError(f"sampling did not finish within {timeout_s:.0f} s (request {request_id})")
    if "protobuf" in rec.content_type:
        return decode_sample_response(rec.body)
    out = json.loads(rec.body or b"{}")
    if "error" in out:
        if out.get("category") == "user":  # "<field>: <message>" (openrl.errors.UserError)
            err = str(out["error"])
            fld, _, msg = err.partition(": ")
            if not msg or " " in fld:
                fld, msg = "sample", err
            raise UserError(fld, msg)
        raise ServerError(str(out["error"]))
    raise ServerError(f"unexpected sample result {str(out)[:200]}")
