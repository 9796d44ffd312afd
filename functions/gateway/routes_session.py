"""Bootstrap and session routes: client config, sessions, heartbeats, telemetry, health."""

from __future__ import annotations

import uuid

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from functions.gateway.deps import API_PREFIX, CallerDep, GatewayDep, WireRoute
from openrl.contract.records import Session
from openrl.edge import wire
from openrl.errors import Gone, UserError
from openrl.transport.bus import now_iso

router = APIRouter(prefix=API_PREFIX, route_class=WireRoute)  # behind the API key (functions/gateway/app.py)
public = APIRouter(prefix=API_PREFIX, route_class=WireRoute)  # no key


@router.post("/client/config", response_model=wire.ClientConfigResponse)
async def client_config(g: GatewayDep) -> dict:
    """ClientConfigResponse. Plain X-API-Key auth; chunk limits from the gateway settings."""
    s = g.settings
    return {
        "pjwt_auth_enabled": False,
        "credential_default_source": "api_key",
        "fwdbwd_max_chunk_len": s.fwdbwd_max_chunk_len,
        # the SDK's size estimate is approximate: keep its chunks well under the body limit
        "fwdbwd_max_chunk_bytes_count": min(5_000_000, g.body_limit() // 2),
        # OPENRL_PROTO_COMPRESS=1: the SDK zstd-compresses forward_backward bodies
        # (Content-Encoding: zstd; the gateway decompresses them, capped at the body limit)
        "proto_compress_fwdbwd": s.proto_compress,
        "sample_use_retrieve_futures": False,
        "sample_join_sampling_session": False,
        "custom_loss_server_side": False,
    }


@router.post("/client/dynamic_config", response_model=wire.ClientDynamicConfigResponse)
async def dynamic_config() -> dict:
    """ClientDynamicConfigResponse: sample cancelling is off."""
    return {"refresh_interval_sec": 300, "sample_cancel_enabled": False, "sample_cancel_max_batch_size": 64}


@router.post("/create_session", response_model=wire.CreateSessionResponse)
async def create_session(req: wire.CreateSessionRequest, g: GatewayDep, caller: CallerDep) -> dict:
    """Create a session; its id is URL-safe hex and never contains ':'."""
    session_id = uuid.uuid4().hex[:20]
    rec = Session.make(
        session_id=session_id,
        owner=caller.owner,
        tags=list(req.tags or []),
        user_metadata=req.user_metadata or {},
        display_name=req.display_name,
        project_id=req.project_id,
        sdk_version=req.sdk_version,
        created=now_iso(),
        last_heartbeat=now_iso(),
        status="active",
        training_run_ids=[],
        sampler_ids=[],
    )
    await g.bus.meta_put(rec, "session", session_id)
    out = {"session_id": session_id}
    if getattr(g.keys, "allow_any", False):  # logged by the SDK
        out["warning_message"] = ("this openrl gateway accepts ANY tml- API key (OPENRL_INSECURE_ANY_KEY=1); "
                                  "do not use it for anything that matters")
    return out


@router.post("/session_heartbeat", response_model=wire.SessionHeartbeatResponse)
async def session_heartbeat(req: wire.SessionHeartbeatRequest, g: GatewayDep, caller: CallerDep):
    """Keep a session alive; 410 once it is over (or not the caller's), which stops the SDK's heartbeat."""
    rec = await g.session_record(req.session_id)
    if rec is None or rec.owner != caller.owner or rec.status != "active":
        raise Gone("session_id", f"session {req.session_id!r} is over or unknown; create a new session")

    def beat(rec: Session) -> None:  # compare-and-set: never undo a concurrent finish or training_run_ids append
        rec.last_heartbeat = now_iso()

    await g.update_session(req.session_id, beat)
    return {"type": "session_heartbeat"}


@router.post("/sessions/{session_id}/finish")
async def finish_session(session_id: str, request: Request, g: GatewayDep, caller: CallerDep) -> dict:
    """Mark a session finished. The body (``{reason: {type}, detail}``, optional) is read
    leniently: any reason type is recorded as sent; an unknown key is refused, naming it."""
    rec = await g.session(session_id, caller.owner)
    import json

    try:
        body = json.loads(await request.body() or b"{}")
    except ValueError as exc:  # not JSON, or not UTF-8
        raise UserError("body", f"malformed JSON: {exc}") from None
    reason = body.get("reason") if isinstance(body, dict) else None
    # a falsy type other than a string (0, false, []) is refused too: it would be stored as the
    # record's finish_reason, which must be a string
    if not isinstance(body, dict) or not isinstance(reason if reason is not None else {}, dict) \
            or not isinstance((reason or {}).get("type", ""), (str, type(None))):
        raise UserError("reason", 'expected {"reason": {"type": "<string>"}} or no body')
    for key in [k or '""' for k in body if k not in ("reason", "detail")] + \
            [f"reason.{k or chr(34) * 2}" for k in reason or {} if k != "type"]:
        raise UserError(key, 'unknown field; the body is {"reason": {"type": "<string>"}, "detail": "<string>"}')

    def finish(cur: Session) -> None:  # compare-and-set, like the heartbeat
        cur.status = "finished"
        cur.finish_reason = (body.get("reason") or {}).get("type")

    await g.update_session(session_id, finish, missing=rec)
    return {"status": "finished"}


@router.post("/telemetry", response_model=wire.TelemetryResponse)
async def telemetry() -> dict:
    """Telemetry is accepted and dropped."""
    return {"status": "accepted"}


@public.get("/healthz", response_model=wire.HealthResponse)
async def healthz() -> dict:
    """Liveness/readiness probe; the only /api/v1 route that needs no API key."""
    return {"status": "ok"}


@router.get("/admin/stats")
async def admin_stats(g: GatewayDep, caller: CallerDep):
    """Backpressure counters of this replica (admin keys only; 403 for others):
    ``{"rejected_429": {stream: n}, "stream_depth": {stream: messages at last reading},
    "limits": {...}}``."""
    if not caller.admin:
        return JSONResponse(status_code=403, content={"detail": "admin key required", "category": "user",
                                                      "field": "X-API-Key"})
    return {"rejected_429": dict(g.rejected), "stream_depth": {k: v[0] for k, v in g._depth.items()},
            "limits": {"max_pending_samples": g.settings.max_pending_samples,
                       "max_pending_train": g.settings.max_pending_train}}


@router.get("/get_server_capabilities", response_model=wire.GetServerCapabilitiesResponse)
async def get_server_capabilities(g: GatewayDep) -> dict:
    """The registered base models (context length, trainable, sampleable) and the sampling cap
    ``max_tokens_cap`` (an extra field; the SDK's typed response drops it, raw JSON shows it)."""
    return {"supported_models": g.registry.capabilities(), "max_tokens_cap": g.settings.max_tokens_limit}
