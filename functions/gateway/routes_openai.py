"""An OpenAI-compatible endpoint on the gateway: ``/v1/models``, ``/v1/completions``,
``/v1/chat/completions``, for the evaluation tools that speak that API (the ``openai`` client,
lm-eval's ``local-completions``, inspect-ai, ...).

``model`` is a registered base-model name or a ``tinker://<run>/sampler_weights/<name>``
(or ``weights/<name>``) snapshot the caller may read: its own, or a published one. Every
request goes the SDK's way: the gateway tokenizes (the base model's own tokenizer and chat
template), checks and publishes one ``dev.openrl.sample.v1`` CloudEvent per prompt through
:mod:`functions.gateway.sampling` (same quotas, backpressure, per-key usage and sampler as
``SamplingClient.sample``), waits for the future and answers in OpenAI's shapes.

Auth: the same API keys, as ``Authorization: Bearer <key>`` (what the ``openai`` client sends)
or ``X-API-Key``. Errors: OpenAI's status and ``error`` object (``message``, ``type``, ``param`` =
the field, ``code``: ``model_not_found`` with a 404 for an unknown model, ``invalid_api_key``,
``unknown_parameter``, ``unsupported_parameter``, ...; see
:func:`functions.gateway.errors.openai_error`), plus the keys of docs/errors.md (``detail``,
``category``, ``field``), so both kinds of client read them.

Semantics (and where they differ from OpenAI's):

* ``temperature`` (default 1), ``top_p``, ``top_k`` (vLLM's extension), ``seed``, ``n``, ``stop``
  (strings; generation also stops at the model's EOS / end of turn) map onto Tinker's
  ``SamplingParams``. The returned text leaves the stop string out; ``finish_reason`` is
  ``stop`` or ``length``.
* ``max_tokens``: completions default to 16 (OpenAI's default); chat completions without
  ``max_tokens`` / ``max_completion_tokens`` generate until a stop or ``min(cap, context -
  prompt)`` tokens, as ``/asample`` does.
* ``logprobs`` are those the sampler reports: the raw model distribution's (temperature 1,
  before top-p/top-k), as in Tinker and vLLM's default. Completions: ``logprobs=k`` (0-20) gives
  ``tokens``, ``token_logprobs``, ``top_logprobs`` (k per token) and ``text_offset``; with
  ``echo`` the prompt's tokens come first (``null`` logprob for the first), and ``max_tokens=0``
  with ``echo`` scores the prompt alone. Chat: ``logprobs=true``, ``top_logprobs`` 0-20.
* ``prompt`` may be a string, a list of strings, a list of token ids or a list of such lists
  (one sample request each; choices are ordered prompt by prompt, ``n`` each).
* ``stream=true`` answers Server-Sent Events in OpenAI's chunk format (``data: [DONE]`` last;
  ``stream_options.include_usage`` adds the usage chunk). The sampler returns whole sequences,
  so the events come when the sequences are done: one content chunk per choice, then its
  finish chunk.
* Refused with a 400 naming the field (never silently ignored; code ``unsupported_parameter``):
  ``presence_penalty`` / ``frequency_penalty`` other than 0, a non-empty ``logit_bias``,
  ``best_of`` other than ``n``, ``suffix``, ``tools`` / ``functions`` / ``tool_choice``,
  ``response_format`` other than text, message content parts other than text; a key the request
  does not have: 400, code ``unknown_parameter``, as OpenAI answers it.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from functools import lru_cache
from typing import Annotated, Any, Literal

import pydantic
from fastapi import APIRouter, Depends, Request, Security
from fastapi.exceptions import RequestValidationError
from fastapi.responses import StreamingResponse
from fastapi.routing import APIRoute
from fastapi.security import APIKeyHeader, HTTPAuthorizationCredentials, HTTPBearer
from pydantic import Field

from functions.gateway import errors
from functions.gateway.context import Gateway, require
from functions.gateway.deps import GatewayDep
from functions.gateway.sampling import SampleResult, SampleTarget, resolve_target, submit_sample, wait_sample
from openrl.edge.auth import HEADER, AuthError, Caller
from openrl.edge.wire import WireModel, validation_error_to_user_error
from openrl.errors import NotFound, NotSupported, UserError

#: How long a request waits for its samples (seconds): a sampler scaling from zero on a GPU
#: takes about two minutes (docs/benchmarks.md); the ``openai`` client's own timeout is 600 s.
SAMPLE_TIMEOUT_S = 600.0
#: The widest top-K a request may ask (the sampler's ``max_topk``).
MAX_TOP_LOGPROBS = 20


# ------------------------------------------------------------------------- errors, auth


def _handler_for(request: Request, exc: Exception):
    """The app's exception handler for ``exc`` (by class, nearest first), or None."""
    handlers = request.app.exception_handlers
    return next((handlers[c] for c in type(exc).__mro__ if c in handlers), None)


class OpenAIRoute(APIRoute):
    """Route class of the ``/v1`` routes: an error is answered by the app's handler (the JSON of
    docs/errors.md), with OpenAI's ``error`` object added to the body
    (:func:`functions.gateway.errors.openai_error`: ``type``, ``param``, ``code`` as OpenAI sets
    them, e.g. 404 ``model_not_found`` for an unknown model)."""

    def get_route_handler(self):
        handler = super().get_route_handler()

        async def route(request: Request):
            try:
                return await handler(request)
            except Exception as exc:
                h = _handler_for(request, exc)
                if h is None:
                    raise
                src: BaseException | None = exc
                if isinstance(exc, RequestValidationError):
                    src = errors.request_user_error(request, exc)
                elif isinstance(exc, pydantic.ValidationError):
                    src = validation_error_to_user_error(exc)
                return errors.with_openai_error(await h(request, exc), src)

        return route


def unsupported_unless(cond: bool, field: str, what: str) -> None:
    """Refuse an option this server does not implement: 400 naming ``field``, message
    ``<field>: not supported by this server: <what>``, OpenAI code ``unsupported_parameter``.

    Raises:
        NotSupported: unless ``cond``.
    """
    if not cond:
        raise NotSupported(field, what)


_bearer = HTTPBearer(auto_error=False, description="A configured `tml-` API key as a bearer token")
_api_key = APIKeyHeader(name=HEADER, auto_error=False)


def openai_caller(request: Request, g: GatewayDep,
                  bearer: Annotated[HTTPAuthorizationCredentials | None, Security(_bearer)],
                  key: Annotated[str | None, Security(_api_key)]) -> Caller:
    """The caller behind ``Authorization: Bearer <key>`` (or ``X-API-Key``), kept in
    ``request.state.caller`` for the access log.

    Raises:
        AuthError: no key, or one that is not configured (401 naming ``Authorization``).
    """
    token = bearer.credentials if bearer is not None else key
    try:
        caller = g.keys.check(token)
    except AuthError as exc:
        raise AuthError(exc.message.replace(f"the {HEADER} header", "the Authorization header (Bearer)"),
                        field="Authorization") from None
    request.state.caller = caller
    return caller


OpenAICallerDep = Annotated[Caller, Depends(openai_caller)]
router = APIRouter(prefix="/v1", route_class=OpenAIRoute)


# ------------------------------------------------------------------------------ schemas


class StreamOptions(WireModel):
    """``stream_options``: ``include_usage`` adds a last chunk with the usage."""

    include_usage: bool = False


class _SamplingFields(WireModel):
    """The fields both generation routes share (OpenAI names; ``top_k`` is vLLM's extension)."""

    model: str = Field(min_length=1)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=-1)
    n: int = Field(default=1, ge=1)
    seed: int | None = Field(default=None, ge=0, lt=2**63)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None

    def refuse_unsupported(self) -> None:
        """Options the sampler cannot honour are refused, never dropped.

        Raises:
            UserError: naming the option.
        """
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            unsupported_unless(v in (None, 0), name, "only 0 (no penalty)")
        unsupported_unless(not self.logit_bias, "logit_bias", "no logit biases")
        if isinstance(self.stop, list):
            require(all(s for s in self.stop), "stop", "stop strings must be non-empty")

    def stops(self) -> list[str] | None:
        """``stop`` as a list (None: stop at EOS only)."""
        if self.stop is None or self.stop == []:
            return None
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


class CompletionRequest(_SamplingFields):
    """``POST /v1/completions``."""

    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = Field(default=16, ge=0)
    logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None


class ChatMessage(WireModel):
    """One message: ``content`` a string or a list of ``{"type": "text", "text"}`` parts. The keys
    of an assistant message as the API returns it (``refusal``, ``tool_calls``, ...) are accepted
    empty, so a client can send a previous answer back; set, they are refused (no tool calling)."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    refusal: str | None = None
    tool_calls: list[Any] | None = None
    function_call: Any = None
    audio: Any = None
    annotations: list[Any] | None = None
    tool_call_id: str | None = None


class ChatCompletionRequest(_SamplingFields):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[Any] | None = None
    functions: list[Any] | None = None
    tool_choice: Any = None
    response_format: dict[str, Any] | None = None


# ---------------------------------------------------------------------------- tokenizer


@lru_cache(maxsize=16)
def _tokenizer(path: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


async def tokenizer_of(g: Gateway, base_model: str):
    """The Hugging Face tokenizer of a registered base model (its ``tokenizer_id``, a local
    directory), loaded once per gateway process (in a thread: the first load reads files)."""
    return await asyncio.to_thread(_tokenizer, g.registry.resolve(base_model).tokenizer_id)


# ------------------------------------------------------------------------------ helpers


async def _target(g: Gateway, caller: Caller, model: str) -> SampleTarget:
    """``model`` as a :class:`SampleTarget`: a ``tinker://`` snapshot or a base-model name.

    Raises:
        NotFound: naming ``model``: no such base model, or no snapshot at that path the caller may read.
        UserError: naming ``model``: a malformed name or path.
    """
    if model.startswith("tinker://"):
        return await resolve_target(g, caller.owner, None, model, base_field="model", path_field="model")
    from openrl.model.registry import PEFT_SUFFIX

    if g.registry.get(model) is None and g.registry.get(model.rsplit(PEFT_SUFFIX, 1)[0]) is None:
        # OpenAI answers an unknown model 404 (code model_not_found), which client libraries branch on
        raise NotFound("model", f"the model {model!r} does not exist; GET /v1/models lists the models "
                                f"(base models: {', '.join(g.registry.names())})")
    return await resolve_target(g, caller.owner, model, None, base_field="model", path_field="model")


def _params(req: _SamplingFields, max_tokens: int | None) -> dict:
    p: dict[str, Any] = {"temperature": 1.0 if req.temperature is None else req.temperature}
    if req.top_p is not None:
        p["top_p"] = req.top_p
    if req.top_k is not None:
        p["top_k"] = req.top_k
    if req.seed is not None:
        p["seed"] = req.seed
    if max_tokens is not None:
        p["max_tokens"] = max_tokens
    stops = req.stops()
    if stops is not None:
        p["stop"] = stops
    return p


#: Tinker field names (of :mod:`functions.gateway.sampling` and the sampler) -> the OpenAI
#: request's, so that a refusal names what the caller sent
_FIELDS = {"num_samples": "n", "sampling_params.max_tokens": "max_tokens", "sampling_params.temperature": "temperature",
           "sampling_params.top_p": "top_p", "sampling_params.top_k": "top_k", "sampling_params.seed": "seed",
           "sampling_params.stop": "stop", "prompt.chunks": "prompt", "topk_prompt_logprobs": "logprobs"}


async def _sample(g: Gateway, caller: Caller, target: SampleTarget, model: str, prompts: list[list[int]],
                  n: int, params: dict, extra: dict, topk_field: str = "logprobs") -> list[SampleResult]:
    """Publish one sample request per prompt (``n`` sequences each), then wait for all.

    Raises:
        UserError: as :func:`functions.gateway.sampling.submit_sample` / the sampler refuse, with
            the field renamed to the OpenAI request's (``n``, ``max_tokens``, ``temperature``, ...;
            ``topk_field`` for the top-K width).
    """
    try:
        rids = []
        for tokens in prompts:
            rid = f"{caller.owner}:openai:{uuid.uuid4().hex}"
            await submit_sample(g, target, caller.owner, rid, model,
                                {"prompt_tokens": tokens, "num_samples": n, "sampling_params": params, **extra})
            rids.append(rid)
        return list(await asyncio.gather(*(wait_sample(g, rid, SAMPLE_TIMEOUT_S) for rid in rids)))
    except UserError as exc:
        fld = {**_FIELDS, "topk_sample_logprobs": topk_field}.get(exc.field)
        if fld is None:
            raise
        err = UserError(fld, exc.message.split(": ", 1)[-1])
        err.status = exc.status
        raise err from None


def _cut_at_stop(text: str, stops: list[str] | None) -> tuple[str, bool]:
    """``text`` up to the first stop string (left out), and whether one was found."""
    cut = min((i for i in (text.find(s) for s in stops or ()) if i >= 0), default=-1)
    return (text[:cut], True) if cut >= 0 else (text, False)


def _piece(tok, token_id: int) -> str:
    return tok.decode([token_id], skip_special_tokens=False)


def _usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def _sse(chunks: list[dict]):
    async def gen():
        for c in chunks:
            yield f"data: {json.dumps(c)}\n\n"
        yield "data: [DONE]\n\n"

    return StreamingResponse(gen(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


# ------------------------------------------------------------------------------- routes


@router.get("/models")
async def list_models(g: GatewayDep, caller: OpenAICallerDep) -> dict:
    """The sampleable base models, then the caller's live sampler snapshots (newest first), as
    OpenAI ``model`` objects (``max_model_len``: the context, as vLLM reports it)."""
    from functions.gateway.routes_rest import _run_checkpoints

    now = int(time.time())
    data = [{"id": e.name, "object": "model", "created": now, "owned_by": "openrl", "root": e.name,
             "max_model_len": e.max_context_length} for e in g.registry.entries() if e.sampleable]
    snaps = []
    for r in await g.runs(caller.owner):
        for m in await _run_checkpoints(g, r.model_id, caller.owner):
            if m.checkpoint_type == "sampler":
                snaps.append((m.created_unix or 0, m, r))
    snaps.sort(key=lambda x: x[0], reverse=True)
    for created, m, r in snaps:
        data.append({"id": m.tinker_path, "object": "model", "created": int(created or now),
                     "owned_by": caller.owner, "root": r.base_model, "parent": r.base_model})
    return {"object": "list", "data": data}


@router.get("/models/{model:path}")
async def get_model(model: str, g: GatewayDep, caller: OpenAICallerDep) -> dict:
    """One model: a base-model name, or a ``tinker://`` snapshot the caller may read.

    Raises:
        NotFound: naming ``model``.
    """
    if model.startswith("tinker:/") and not model.startswith("tinker://"):
        model = "tinker://" + model[len("tinker:/"):]  # a proxy may merge the "//" of the path
    try:
        t = await _target(g, caller, model)
    except NotFound:
        raise
    except UserError as exc:  # a malformed name or path: no such model either
        raise NotFound("model", f"no model {model!r}: {exc.message}") from None
    return {"id": model, "object": "model", "created": int(time.time()),
            "owned_by": caller.owner if t.model_path else "openrl", "root": t.base_model,
            "max_model_len": g.registry.resolve(t.base_model).max_context_length}


@router.post("/completions")
async def completions(req: CompletionRequest, g: GatewayDep, caller: OpenAICallerDep):
    """Text completion of one prompt or several (see the module doc)."""
    req.refuse_unsupported()
    unsupported_unless(req.best_of in (None, req.n), "best_of", "only best_of == n")
    unsupported_unless(req.suffix is None, "suffix", "no suffix (insertion)")
    require(req.max_tokens != 0 or req.echo, "max_tokens", "0 is allowed only with echo (scoring the prompt)")
    target = await _target(g, caller, req.model)
    tok = await tokenizer_of(g, target.base_model)
    p = req.prompt
    if isinstance(p, str):
        prompts = [tok.encode(p, add_special_tokens=False)]
    elif p and isinstance(p[0], int):
        prompts = [list(p)]
    elif p and isinstance(p[0], str):
        prompts = [tok.encode(s, add_special_tokens=False) for s in p]
    else:
        prompts = [list(x) for x in p]
    require(len(prompts) > 0 and all(len(x) > 0 for x in prompts), "prompt", "every prompt needs at least one token")
    k = req.logprobs
    extra: dict[str, Any] = {}
    if k:
        extra["topk_sample_logprobs"] = k
    if req.echo and k is not None:
        extra["prompt_logprobs"] = True
        if k:
            extra["topk_prompt_logprobs"] = k
    mt = 1 if req.max_tokens == 0 else req.max_tokens  # 0 (with echo): score the prompt, drop the token
    results = await _sample(g, caller, target, req.model, prompts, req.n, _params(req, mt), extra)
    stops = req.stops()
    choices, n_out = [], 0
    for pi, (prompt, res) in enumerate(zip(prompts, results)):
        for si, seq in enumerate(res.sequences):
            tokens = [] if req.max_tokens == 0 else seq.tokens
            text, hit = _cut_at_stop(tok.decode(tokens, skip_special_tokens=True), stops)
            n_out += len(tokens)
            lp = None
            if k is not None:
                ids, lps, tops = [], [], []
                if req.echo:
                    ids += prompt
                    lps += list(res.prompt_logprobs or [None] * len(prompt))
                    tops += [{_piece(tok, i): v for i, v in row} if k and row else None
                             for row in (res.prompt_topk or [None] * len(prompt))]
                ids += tokens
                lps += list(seq.logprobs or [None] * len(seq.tokens))[: len(tokens)]
                tops += [{_piece(tok, i): v for i, v in row} if k else None
                         for row in (seq.topk or [[]] * len(seq.tokens))][: len(tokens)]
                pieces = [_piece(tok, i) for i in ids]
                offsets, at = [], 0
                for s in pieces:
                    offsets.append(at)
                    at += len(s)
                lp = {"tokens": pieces, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}
            if req.echo:
                text = tok.decode(prompt, skip_special_tokens=False) + text
            finish = "stop" if hit or seq.stop_reason == "stop" else "length"
            choices.append({"index": pi * req.n + si, "text": text, "logprobs": lp, "finish_reason": finish})
    usage = _usage(sum(len(x) for x in prompts), n_out)
    cid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
    if not req.stream:
        return {"id": cid, "object": "text_completion", "created": created, "model": req.model,
                "choices": choices, "usage": usage}
    head = {"id": cid, "object": "text_completion", "created": created, "model": req.model}
    chunks = [{**head, "choices": [{**c, "finish_reason": None}]} for c in choices]
    chunks += [{**head, "choices": [{"index": c["index"], "text": "", "logprobs": None,
                                     "finish_reason": c["finish_reason"]}]} for c in choices]
    if req.stream_options is not None and req.stream_options.include_usage:
        chunks.append({**head, "choices": [], "usage": usage})
    return _sse(chunks)


def _chat_text(m: ChatMessage, i: int) -> str:
    for name in ("refusal", "tool_calls", "function_call", "audio", "annotations", "tool_call_id"):
        unsupported_unless(not getattr(m, name), f"messages[{i}].{name}", "text messages only")
    if m.content is None or isinstance(m.content, str):
        return m.content or ""
    out = []
    for j, part in enumerate(m.content):
        unsupported_unless(part.get("type") == "text" and isinstance(part.get("text"), str),
                           f"messages[{i}].content[{j}]", "only text parts")
        out.append(part["text"])
    return "".join(out)


@router.post("/chat/completions")
async def chat_completions(req: ChatCompletionRequest, g: GatewayDep, caller: OpenAICallerDep):
    """Chat completion: the messages through the base model's chat template (see the module doc)."""
    req.refuse_unsupported()
    for name in ("tools", "functions"):
        unsupported_unless(not getattr(req, name), name, "no tool calling")
    unsupported_unless(req.tool_choice in (None, "none"), "tool_choice", "no tool calling")
    unsupported_unless(req.response_format is None or req.response_format.get("type") == "text", "response_format",
                       "only {\"type\": \"text\"}")
    require(req.top_logprobs is None or req.logprobs, "top_logprobs", "requires logprobs: true")
    target = await _target(g, caller, req.model)
    tok = await tokenizer_of(g, target.base_model)
    msgs = [{"role": m.role, "content": _chat_text(m, i)} for i, m in enumerate(req.messages)]
    require(getattr(tok, "chat_template", None) is not None, "messages",
            f"the tokenizer of {target.base_model!r} has no chat template; use /v1/completions")
    text = await asyncio.to_thread(tok.apply_chat_template, msgs, tokenize=False, add_generation_prompt=True)
    prompt = tok.encode(text, add_special_tokens=False)
    k = req.top_logprobs or 0
    extra = {"topk_sample_logprobs": k} if req.logprobs and k else {}
    mt = req.max_completion_tokens or req.max_tokens
    [res] = await _sample(g, caller, target, req.model, [prompt], req.n, _params(req, mt), extra, "top_logprobs")
    stops = req.stops()
    choices, n_out = [], 0
    for si, seq in enumerate(res.sequences):
        content, hit = _cut_at_stop(tok.decode(seq.tokens, skip_special_tokens=True), stops)
        n_out += len(seq.tokens)
        lp = None
        if req.logprobs:
            rows = seq.topk or [[]] * len(seq.tokens)
            lp = {"content": [
                {"token": (s := _piece(tok, t)), "logprob": v, "bytes": list(s.encode()),
                 "top_logprobs": [{"token": (ts := _piece(tok, i)), "logprob": tv, "bytes": list(ts.encode())}
                                  for i, tv in row][:k]}
                for t, v, row in zip(seq.tokens, seq.logprobs or [None] * len(seq.tokens), rows)]}
        finish = "stop" if hit or seq.stop_reason == "stop" else "length"
        choices.append({"index": si, "message": {"role": "assistant", "content": content}, "logprobs": lp,
                        "finish_reason": finish})
    usage = _usage(len(prompt), n_out)
    cid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
    if not req.stream:
        return {"id": cid, "object": "chat.completion", "created": created, "model": req.model,
                "choices": choices, "usage": usage}
    head = {"id": cid, "object": "chat.completion.chunk", "created": created, "model": req.model}
    chunks = []
    for c in choices:
        chunks.append({**head, "choices": [{"index": c["index"], "delta": {"role": "assistant", "content": ""},
                                            "logprobs": None, "finish_reason": None}]})
        chunks.append({**head, "choices": [{"index": c["index"], "delta": {"content": c["message"]["content"]},
                                            "logprobs": c["logprobs"], "finish_reason": None}]})
        chunks.append({**head, "choices": [{"index": c["index"], "delta": {}, "logprobs": None,
                                            "finish_reason": c["finish_reason"]}]})
    if req.stream_options is not None and req.stream_options.include_usage:
        chunks.append({**head, "choices": [], "usage": usage})
    return _sse(chunks)
