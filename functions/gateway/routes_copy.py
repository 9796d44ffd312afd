"""``POST /api/v1/copy_weights`` (``RestClient.copy_weights``, ``ServiceClient.copy_weights``).

A checkpoint the caller may read (its own, or a published one) is copied into a new
training run of the caller: in slot ``model_seq_id`` of one of its sessions, or in a new
session of project ``destination_project_id`` (what the SDK sends). The copy keeps the
source's kind (``weights`` / ``sampler_weights``) and name, gets its own expiry
(``ttl_seconds``; the source's is not inherited) and is private. Its bytes are shared with
the source inside the store (hard links, or a GCS server-side copy), never sent through the
gateway. The new run holds no trainer state and cannot be trained on: training calls on it
answer 400 naming ``model_id`` (:func:`functions.gateway.runs.refuse_frozen`); ``create_training_client_from_state`` of the copy trains a
new run from it. A retried call with the same ``X-Idempotency-Key`` gets the first copy.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Annotated

from fastapi import APIRouter, Header

from functions.gateway.deps import API_PREFIX, CallerDep, GatewayDep, WireRoute
from functions.gateway.runs import add_to_session, model_id_for, readable_manifest
from openrl.contract.records import CopiedWeights, Session, TrainingRun
from openrl.edge import wire
from openrl.transport.bus import now_iso
from openrl.errors import NotSupported, UserError
from openrl.storage import TinkerPath

router = APIRouter(prefix=API_PREFIX, route_class=WireRoute)


@router.post("/copy_weights")
async def copy_weights(req: wire.CopyWeightsRequest, g: GatewayDep, caller: CallerDep,
                       x_idempotency_key: Annotated[str | None, Header()] = None,
                       x_tinker_weights_access_token: Annotated[str | None, Header()] = None) -> dict:
    """Returns ``{"tinker_path": "tinker://<new run>/<kind>/<name>"}``.

    Raises:
        UserError: a field of :class:`openrl.edge.wire.CopyWeightsRequest`; the session slot is taken.
        NotFound: ``source_path`` is not readable by the caller; ``session_id`` is not theirs.
        NotSupported: ``X-Tinker-Weights-Access-Token`` or ``weights_access_token`` (this server
            issues no access tokens).
    """
    who = caller.owner
    if x_tinker_weights_access_token or req.weights_access_token:
        raise NotSupported("weights_access_token", "this server issues no weights access tokens; a checkpoint "
                           "your API key can read (your own, or a published one) needs none")
    src = TinkerPath.parse(req.source_path, field="source_path")
    m = await readable_manifest(g, src, who, "source_path")
    idem = x_idempotency_key
    if idem:
        done = CopiedWeights.load(await g.bus.meta_get("copy", who, idem))
        if done is not None:
            return {"tinker_path": done.tinker_path}

    if req.session_id is not None:
        session_id, slot = req.session_id, int(req.model_seq_id)
        await g.session(session_id, who)
    else:
        session_id, slot = uuid.uuid4().hex[:20], 0
        await g.bus.meta_put(Session.make(
            session_id=session_id, owner=who, tags=["copy_weights"], user_metadata={},
            display_name=None, project_id=req.destination_project_id, sdk_version=None,
            created=now_iso(), last_heartbeat=now_iso(), status="finished", finish_reason="success",
            training_run_ids=[], sampler_ids=[],
        ), "session", session_id)
    model_id = model_id_for(session_id, slot)
    rec = TrainingRun.make(
        model_id=model_id, session_id=session_id, owner=who, base_model=m.base_model,
        lora_config=m.lora_config or {}, optimizer_config=m.optimizer_config,
        tokenizer_id=_tokenizer_id(g, m.base_model), shard=g.shard_of(model_id),
        created=now_iso(), last_request_time=now_iso(), user_metadata={},
        frozen=True, copy_of=str(src),
    )
    if not await g.bus.meta_create(rec, "model", model_id):
        raise UserError("model_seq_id", f"training run {model_id!r} already exists; pick an unused model_seq_id")
    await add_to_session(g, session_id, "training_run_ids", model_id)
    dst = TinkerPath.parse(f"tinker://{model_id}/{src.kind}/{src.name}", field="source_path")
    now = time.time()
    manifest = m.model_copy(update=dict(
        tinker_path=str(dst), training_run_id=model_id, owner=who, public=False,
        created_unix=now, time=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(now)),
        ttl_seconds=req.ttl_seconds, expires_unix=(now + req.ttl_seconds) if req.ttl_seconds else None,
        copied_from=str(src),
    ))
    await asyncio.to_thread(g.storage.copy, src, dst, manifest.stored())
    if idem:
        await g.bus.meta_put(CopiedWeights.make(tinker_path=str(dst), created=now_iso()), "copy", who, idem)
    return {"tinker_path": str(dst)}


def _tokenizer_id(g, base_model: str | None) -> str | None:
    try:
        return g.registry.resolve(base_model).tokenizer_id
    except Exception:  # noqa: BLE001 - a base model no longer in the registry: the copy still stands
        return None
