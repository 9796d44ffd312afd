"""REST routes of the SDK's RestClient: training runs, checkpoints, sessions, weights info.

Checkpoints are listed from storage manifests (the source of truth for saved weights);
training runs and sessions from the metadata bucket. Everything is scoped to the
caller's API key: another key's objects answer 404 and never appear in listings.
"""

from __future__ import annotations

import asyncio
import time

from fastapi import APIRouter, Request

from functions.gateway.deps import gw, owner, parse
from functions.gateway.routes_training import _owned_manifest
from openrl import wire
from openrl.errors import NotFound, UserError
from openrl.storage import TinkerPath

router = APIRouter(prefix="/api/v1")


def checkpoint_json(m: dict) -> dict:
    """A storage manifest as the SDK's ``Checkpoint`` type."""
    exp = m.get("expires_unix")
    return {
        "checkpoint_id": m["checkpoint_id"],
        "checkpoint_type": m["checkpoint_type"],
        "time": m["time"],
        "tinker_path": m["tinker_path"],
        "size_bytes": m.get("size_bytes"),
        "public": bool(m.get("public")),
        "user_metadata": m.get("user_metadata"),
        "expires_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(exp)) if exp else None,
    }


def _live(m: dict) -> bool:
    exp = m.get("expires_unix")
    return not exp or exp > time.time()


async def _run_checkpoints(g, run_id: str, who: str) -> list[dict]:
    ms = await asyncio.to_thread(g.storage.list_run, run_id)
    ms = [m for m in ms if m.get("owner") == who and _live(m)]
    ms.sort(key=lambda m: m.get("created_unix", 0), reverse=True)
    return ms


def training_run_json(rec: dict, ckpts: list[dict]) -> dict:
    """A training-run record as the SDK's ``TrainingRun`` type."""
    last = next((checkpoint_json(m) for m in ckpts if m["checkpoint_type"] == "training"), None)
    last_s = next((checkpoint_json(m) for m in ckpts if m["checkpoint_type"] == "sampler"), None)
    return {
        "training_run_id": rec["model_id"],
        "base_model": rec["base_model"],
        "model_owner": rec["owner"],
        "is_lora": True,
        "corrupted": False,
        "lora_rank": (rec.get("lora_config") or {}).get("rank"),
        "last_request_time": rec.get("last_request_time") or rec.get("created"),
        "last_checkpoint": last,
        "last_sampler_checkpoint": last_s,
        "user_metadata": rec.get("user_metadata") or None,
    }


@router.post("/weights_info")
async def weights_info(request: Request) -> dict:
    req = await parse(request, wire.WeightsInfoRequest)
    g = gw(request)
    m = await _owned_manifest(g, TinkerPath.parse(req.tinker_path, field="tinker_path"), owner(request))
    lora = m.get("lora_config") or {}
    return {
        "base_model": m.get("base_model"),
        "is_lora": True,
        "lora_rank": lora.get("rank"),
        "train_unembed": lora.get("train_unembed"),
        "train_mlp": lora.get("train_mlp"),
        "train_attn": lora.get("train_attn"),
        "optimizer_config": m.get("optimizer_config"),
    }


@router.get("/training_runs")
async def list_training_runs(request: Request, limit: int = 20, offset: int = 0) -> dict:
    g = gw(request)
    who = owner(request)
    recs = [r for r in await g.bus.meta_list("model") if r.get("owner") == who]
    recs.sort(key=lambda r: r.get("created", ""), reverse=True)
    page = recs[offset : offset + limit]
    runs = [training_run_json(r, await _run_checkpoints(g, r["model_id"], who)) for r in page]
    return {"training_runs": runs, "cursor": {"offset": offset, "limit": limit, "total_count": len(recs)}}


@router.get("/training_runs/{run_id}")
async def get_training_run(run_id: str, request: Request) -> dict:
    g = gw(request)
    who = owner(request)
    rec = await g.model(run_id, who, "training_run_id")
    return training_run_json(rec, await _run_checkpoints(g, run_id, who))


@router.get("/training_runs/{run_id}/checkpoints")
async def list_checkpoints(run_id: str, request: Request) -> dict:
    g = gw(request)
    who = owner(request)
    await g.model(run_id, who, "training_run_id")
    return {"checkpoints": [checkpoint_json(m) for m in await _run_checkpoints(g, run_id, who)], "cursor": None}


@router.get("/checkpoints")
async def list_user_checkpoints(request: Request, limit: int = 100, offset: int = 0) -> dict:
    g = gw(request)
    who = owner(request)
    recs = [r for r in await g.bus.meta_list("model") if r.get("owner") == who]
    allm: list[dict] = []
    for r in recs:
        allm.extend(await _run_checkpoints(g, r["model_id"], who))
    allm.sort(key=lambda m: m.get("created_unix", 0), reverse=True)
    page = allm[offset : offset + limit]
    return {"checkpoints": [checkpoint_json(m) for m in page],
            "cursor": {"offset": offset, "limit": limit, "total_count": len(allm)}}


async def _checkpoint(request: Request, run_id: str, checkpoint_id: str) -> tuple[TinkerPath, dict]:
    g = gw(request)
    path = TinkerPath.parse(f"tinker://{run_id}/{checkpoint_id}", field="checkpoint_id")
    m = await asyncio.to_thread(g.storage.manifest, path)
    if m is None or m.get("owner") != owner(request):
        raise NotFound("checkpoint_id", f"no checkpoint {checkpoint_id!r} in training run {run_id!r}")
    return path, m


@router.delete("/training_runs/{run_id}/checkpoints/{checkpoint_id:path}")
async def delete_checkpoint(run_id: str, checkpoint_id: str, request: Request) -> dict:
    path, _ = await _checkpoint(request, run_id, checkpoint_id)
    await asyncio.to_thread(gw(request).storage.delete, path)
    return {"deleted": str(path)}


async def _set_public(request: Request, run_id: str, checkpoint_id: str, public: bool) -> dict:
    path, m = await _checkpoint(request, run_id, checkpoint_id)
    if bool(m.get("public")) == public:
        raise UserError("checkpoint_id", f"checkpoint is already {'public' if public else 'private'}")
    m["public"] = public
    await asyncio.to_thread(gw(request).storage.write_manifest, path, m)
    return {"public": public}


@router.post("/training_runs/{run_id}/checkpoints/{checkpoint_id:path}/publish")
async def publish(run_id: str, checkpoint_id: str, request: Request) -> dict:
    return await _set_public(request, run_id, checkpoint_id, True)


@router.delete("/training_runs/{run_id}/checkpoints/{checkpoint_id:path}/publish")
async def unpublish(run_id: str, checkpoint_id: str, request: Request) -> dict:
    return await _set_public(request, run_id, checkpoint_id, False)


@router.put("/training_runs/{run_id}/checkpoints/{checkpoint_id:path}/ttl")
async def set_ttl(run_id: str, checkpoint_id: str, request: Request) -> dict:
    req = await parse(request, wire.TtlRequest)
    path, m = await _checkpoint(request, run_id, checkpoint_id)
    m["ttl_seconds"] = req.ttl_seconds
    m["expires_unix"] = (time.time() + req.ttl_seconds) if req.ttl_seconds else None
    await asyncio.to_thread(gw(request).storage.write_manifest, path, m)
    return {"ttl_seconds": req.ttl_seconds}


@router.get("/sessions")
async def list_sessions(request: Request, limit: int = 20, offset: int = 0) -> dict:
    who = owner(request)
    recs = [r for r in await gw(request).bus.meta_list("session") if r.get("owner") == who]
    recs.sort(key=lambda r: r.get("created", ""), reverse=True)
    return {"sessions": [r["session_id"] for r in recs[offset : offset + limit]]}


@router.get("/sessions/{session_id}")
async def get_session(session_id: str, request: Request) -> dict:
    rec = await gw(request).session(session_id, owner(request))
    return {
        "training_run_ids": rec.get("training_run_ids", []),
        "sampler_ids": rec.get("sampler_ids", []),
        "user_metadata": rec.get("user_metadata") or None,
        "display_name": rec.get("display_name"),
    }
