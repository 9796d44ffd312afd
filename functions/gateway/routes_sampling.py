"""Sampling routes: sampling sessions and ``asample``.

A sampling session is a record (base model + optional immutable ``tinker://`` snapshot
path); the sampler is stateless, so every sample event carries both. The checks and the
publishing are :mod:`functions.gateway.sampling`'s, shared with the OpenAI-compatible routes.
"""

from __future__ import annotations

import uuid

from fastapi import APIRouter, Response

from functions.gateway.context import require
from functions.gateway.deps import API_PREFIX, CallerDep, GatewayDep, WireRoute
from functions.gateway.runs import add_to_session
from functions.gateway.sampling import SampleTarget, resolve_target, submit_sample
from openrl.contract.records import SamplerSession
from openrl.edge import wire
from openrl.transport.bus import now_iso

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
    target = await resolve_target(g, who, None if req.model_path else req.base_model, req.model_path)
    rec = SamplerSession.make(sampler_id=sid, owner=who, base_model=target.base_model, model_path=target.model_path,
                              session_id=req.session_id, created=now_iso())
    await g.bus.meta_put(rec, "sampler", sid)
    await add_to_session(g, req.session_id, "sampler_ids", sid)
    return {"sampling_session_id": sid}


@router.get("/samplers/{sampler_id}", response_model=wire.SamplerInfo)
async def get_sampler(sampler_id: str, g: GatewayDep, caller: CallerDep) -> dict:
    """``RestClient.get_sampler``: base model and snapshot path of one of the caller's sampling sessions."""
    rec = await g.sampler(sampler_id, caller.owner)
    out = {"sampler_id": rec.sampler_id, "base_model": rec.base_model}
    if rec.model_path:
        out["model_path"] = rec.model_path
    return out


@router.post("/asample", response_model=wire.UntypedAPIFuture)
async def asample(req: wire.SampleRequest, g: GatewayDep, caller: CallerDep, response: Response) -> dict:
    """Validate a sample request and publish it; the future handle names one sequence id per
    requested sample.

    The SDK always names a sampling session (``sampling_session_id`` + ``seq_id``; the future
    id is ``<sampling_session_id>:<seq_id>``, so a resend gets the same future; without
    ``seq_id``, which the SDK's type declares optional, ``<sampling_session_id>:r<random hex>``,
    a new request each time: samples need no order). Without a session,
    the request names what to sample as ``SampleRequest`` documents it: ``model_path`` (a
    readable ``tinker://`` snapshot; ``base_model`` is inferred from it) or ``base_model``; each
    such request is new (future id ``<owner>:sample:<random hex>``), and ``record_stability_info``
    needs a session.

    An omitted ``sampling_params.max_tokens`` becomes ``min(max_tokens_limit, context -
    len(prompt))`` here (the context of the base model, capped by a ``:peft:<n>`` suffix):
    sequences run until a stop or that length, never a hidden short default. The value used and
    the cap are sent back in :data:`MAX_TOKENS_HEADER` / :data:`MAX_TOKENS_CAP_HEADER`."""
    s = g.settings
    sid = req.sampling_session_id
    if sid is not None:
        rec = await g.sampler(sid, caller.owner)
        require(req.seq_id is None or 0 <= req.seq_id < 2**63, "seq_id", "between 0 and 2^63-1, or left out")
        target = SampleTarget(rec.base_model, rec.model_path)
        # without seq_id (the SDK always sends one) each request is new: no resend gets its future back
        rid = f"{sid}:{req.seq_id}" if req.seq_id is not None else f"{sid}:r{uuid.uuid4().hex}"
        subject = sid
    else:
        require(req.base_model is not None or req.model_path is not None, "sampling_session_id",
                "required, unless the request names base_model or model_path")
        require(not req.record_stability_info, "record_stability_info",
                "needs a sampling session (create_sampling_session): its records belong to the session")
        target = await resolve_target(g, caller.owner, req.base_model, req.model_path)
        rid = f"{caller.owner}:sample:{uuid.uuid4().hex}"
        subject = target.model_path or target.base_model
    data = req.model_dump(mode="json", exclude_none=True)
    data["prompt_tokens"] = req.prompt.to_tokens("prompt")
    data.pop("prompt", None)
    mt = await submit_sample(g, target, caller.owner, rid, subject, data)
    response.headers[MAX_TOKENS_HEADER] = str(mt)
    response.headers[MAX_TOKENS_CAP_HEADER] = str(s.max_tokens_limit)
    return {"request_id": rid, "sample_sequence_ids": [f"{rid}:{i}" for i in range(req.num_samples)]}
