"""Sampling routes: sampling sessions and ``asample``.

A sampling session is a record (base model + optional immutable ``tinker://`` snapshot
path); the sampler is stateless, so every sample event carries both.
"""

from __future__ import annotations

from fastapi import APIRouter, Response

from functions.gateway.context import require
from functions.gateway.deps import API_PREFIX, CallerDep, GatewayDep, WireRoute
from functions.gateway.runs import add_to_session, readable_manifest
from openrl.contract import payloads
from openrl.contract.records import SamplerSession
from openrl.edge import wire
from openrl.transport.bus import SAMPLE_STREAM, now_iso
from openrl.storage import TinkerPath

router = APIRouter(prefix=API_PREFIX, route_class=WireRoute)

#: Response headers of ``/asample`` (the SDK's ``SampleResponse`` has no field for them): the
#: ``max_tokens`` each sequence of the request may generate (the given one, or for an omitted
#: one ``min(cap, context - prompt)``), and the server's cap ``OPENRL_SAMPLER_MAX_TOKENS_CAP``.
MAX_TOKENS_HEADER = "X-OpenRL-Max-Tokens"
MAX_TOKENS_CAP_HEADER = "X-OpenRL-Max-Tokens-Cap"


@router.post("/create_sampling_session", response_model=wire.CreateSamplingSessionResponse)
async def create_sampling_session(req: wire.CreateSamplingSessionRequest, g: GatewayDep, caller: CallerDep) -> dict:
    """A sampling session of the caller: a base model, or a readable ``tinker://`` snapshot (``model_path``)."""
    who = caller.owner
    await g.session(req.session_id, who)
    sid = f"{req.session_id}:sample:{req.sampling_session_seq_id}"
    if req.model_path:
        ckpt = TinkerPath.parse(req.model_path, field="model_path")
        require(ckpt.kind in ("sampler_weights", "weights"), "model_path", "expected a sampler_weights or weights path")
        manifest = await readable_manifest(g, ckpt, who, "model_path")
        base = manifest.get("base_model")
        path = str(ckpt)
    else:
        require(bool(req.base_model), "base_model", "either base_model or model_path is required")
        base, path = req.base_model, None
    g.registry.resolve(base)
    rec = SamplerSession.make(sampler_id=sid, owner=who, base_model=base, model_path=path,
                              session_id=req.session_id, created=now_iso())
    await g.bus.meta_put(rec, "sampler", sid)
    await add_to_session(g, req.session_id, "sampler_ids", sid)
    return {"sampling_session_id": sid}


@router.get("/samplers/{sampler_id}", response_model=wire.SamplerInfo)
async def get_sampler(sampler_id: str, g: GatewayDep, caller: CallerDep) -> dict:
    """``RestClient.get_sampler``: base model and snapshot path of one of the caller's sampling sessions."""
    rec = await g.sampler(sampler_id, caller.owner)
    out = {"sampler_id": rec["sampler_id"], "base_model": rec["base_model"]}
    if rec.get("model_path"):
        out["model_path"] = rec["model_path"]
    return out


@router.post("/asample", response_model=wire.UntypedAPIFuture)
async def asample(req: wire.SampleRequest, g: GatewayDep, caller: CallerDep, response: Response) -> dict:
    """Validate a sample request of the caller's sampling session and publish it; the future
    handle names one sequence id per requested sample.

    An omitted ``sampling_params.max_tokens`` becomes ``min(max_tokens_limit, context -
    len(prompt))`` here (the context of the session's base model, capped by a ``:peft:<n>``
    suffix): sequences run until a stop or that length, never a hidden short default. The
    value used and the cap are sent back in :data:`MAX_TOKENS_HEADER` /
    :data:`MAX_TOKENS_CAP_HEADER`."""
    s = g.settings
    sid = req.sampling_session_id
    require(sid is not None, "sampling_session_id", "required")
    rec = await g.sampler(sid, caller.owner)
    require(1 <= req.num_samples <= s.max_num_samples, "num_samples", f"must be between 1 and {s.max_num_samples}")
    mt = req.sampling_params.max_tokens
    require(mt is None or 1 <= mt <= s.max_tokens_limit, "sampling_params.max_tokens",
            f"must be between 1 and {s.max_tokens_limit}")
    require(req.seq_id is not None and 0 <= req.seq_id < 2**63, "seq_id", "required, between 0 and 2^63-1")
    tokens = req.prompt.to_tokens("prompt")
    require(len(tokens) > 0, "prompt", "the prompt has no tokens")
    vocab = g.vocab_size(rec["base_model"])
    bad = [t for t in tokens if t < 0 or t >= vocab]
    require(not bad, "prompt.chunks", f"token id {bad[:1]} outside the vocabulary [0, {vocab})")
    ctx = g.registry.resolve(rec["base_model"]).max_context_length
    require(len(tokens) < ctx, "prompt",
            f"prompt ({len(tokens)} tokens) leaves no room to generate in the model's context of {ctx}")
    require(len(tokens) + (mt or 0) <= ctx, "sampling_params.max_tokens",
            f"prompt ({len(tokens)} tokens) + max_tokens ({mt}) exceed the model's context of {ctx}")
    if mt is None:
        mt = min(s.max_tokens_limit, ctx - len(tokens))
    rid = f"{sid}:{req.seq_id}"
    await g.admit(SAMPLE_STREAM, rid, owner=rec["owner"], op="sample",
                  tokens=len(tokens) + req.num_samples * mt)  # tokens_per_min: the most it can use
    data = req.model_dump(mode="json", exclude_none=True)
    data.update(prompt_tokens=tokens, base_model=rec["base_model"], model_path=rec.get("model_path"))
    data.setdefault("sampling_params", {})["max_tokens"] = mt
    data = payloads.Sample.model_validate(data).to_data()  # the wire request's fields the sampler reads
    await g.submit("sample", rid, sid, data, future_meta={"owner": rec["owner"]})
    response.headers[MAX_TOKENS_HEADER] = str(mt)
    response.headers[MAX_TOKENS_CAP_HEADER] = str(s.max_tokens_limit)
    return {"request_id": rid, "sample_sequence_ids": [f"{rid}:{i}" for i in range(req.num_samples)]}
