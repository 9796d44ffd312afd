"""Bootstrap and session routes: client config, sessions, heartbeats, telemetry, health."""

from __future__ import annotations

import uuid

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from functions.gateway.deps import gw, owner, parse
from openrl import wire
from openrl.bus import now_iso

router = APIRouter(prefix="/api/v1")


@router.post("/client/config")
async def client_config(request: Request) -> dict:
    """ClientConfigResponse. Plain X-API-Key auth; chunk limits from the gateway settings."""
    s = gw(request).settings
    return {
        "pjwt_auth_enabled": False,
        "credential_default_source": "api_key",
        "fwdbwd_max_chunk_len": s.fwdbwd_max_chunk_len,
        "proto_compress_fwdbwd": False,
        "sample_use_retrieve_futures": False,
        "sample_join_sampling_session": False,
        "custom_loss_server_side": False,
    }


@router.post("/client/dynamic_config")
async def dynamic_config() -> dict:
    return {"refresh_interval_sec": 300, "sample_cancel_enabled": False, "sample_cancel_max_batch_size": 64}


@router.post("/create_session")
async def create_session(request: Request) -> dict:
    """Create a session; its id is URL-safe hex and never contains ':'."""
    req = await parse(request, wire.CreateSessionRequest)
    session_id = uuid.uuid4().hex[:20]
    rec = {
        "session_id": session_id,
        "owner": owner(request),
        "tags": list(req.tags or []),
        "user_metadata": req.user_metadata or {},
        "display_name": getattr(req, "display_name", None),
        "sdk_version": req.sdk_version,
        "created": now_iso(),
        "last_heartbeat": now_iso(),
        "status": "active",
        "training_run_ids": [],
        "sampler_ids": [],
    }
    await gw(request).bus.meta_put(rec, "session", session_id)
    return {"session_id": session_id}


@router.post("/session_heartbeat")
async def session_heartbeat(request: Request):
    req = await parse(request, wire.SessionHeartbeatRequest)
    g = gw(request)
    rec = await g.bus.meta_get("session", req.session_id)
    if rec is None or rec.get("owner") != owner(request) or rec.get("status") != "active":
        return JSONResponse(status_code=410, content={"detail": f"session {req.session_id!r} is over"})
    rec["last_heartbeat"] = now_iso()
    await g.bus.meta_put(rec, "session", req.session_id)
    return {"type": "session_heartbeat"}


@router.post("/sessions/{session_id}/finish")
async def finish_session(session_id: str, request: Request) -> dict:
    g = gw(request)
    rec = await g.session(session_id, owner(request))
    body = await request.json() if await request.body() else {}
    rec["status"] = "finished"
    rec["finish_reason"] = (body.get("reason") or {}).get("type")
    await g.bus.meta_put(rec, "session", session_id)
    return {"status": "finished"}


@router.post("/telemetry")
async def telemetry() -> dict:
    """Telemetry is accepted and dropped."""
    return {"status": "accepted"}


@router.get("/healthz")
async def healthz() -> dict:
    return {"status": "ok"}


@router.get("/get_server_capabilities")
async def get_server_capabilities(request: Request) -> dict:
    return {"supported_models": gw(request).registry.capabilities()}
