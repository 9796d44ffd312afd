"""REST routes of the SDK's RestClient: training runs, checkpoints, sessions, weights info.

Checkpoints are listed from storage manifests (the source of truth for saved weights);
training runs and sessions from the metadata bucket. Everything is scoped to the
caller's API key: another key's objects answer 404 and never appear in listings. An admin
key (see :mod:`openrl.edge.auth`) with ``access_scope=all`` (or the SDK's ``accessible``) lists and
reads every key's training runs, checkpoints and sessions; it cannot change them.
"""

from __future__ import annotations

import asyncio
import json
import time

from fastapi import APIRouter, Request

from functions.gateway.context import Gateway, require
from functions.gateway.deps import API_PREFIX, CallerDep, GatewayDep, OwnedRunDep, ScopeDep, WireRoute
from functions.gateway.runs import readable_manifest
from openrl.contract.records import CheckpointManifest, LoraConfig, Session, TrainingRun
from openrl.edge import wire
from openrl.errors import NotFound, UserError
from openrl.storage import KINDS, TinkerPath

router = APIRouter(prefix=API_PREFIX, route_class=WireRoute)


def str_metadata(meta: dict | None) -> dict[str, str] | None:
    """``user_metadata`` as the SDK's response types declare it (``dict[str, str]``): requests
    may carry any JSON value (``CreateModelRequest.user_metadata: dict[str, Any]``), so a
    non-string value is answered as its JSON text (``{"n": 3}`` -> ``{"n": "3"}``); None when
    empty. Without this, one run created with a number in its metadata made every listing
    that held it unreadable to the SDK (a pydantic error in the client)."""
    if not meta:
        return None
    return {str(k): v if isinstance(v, str) else json.dumps(v, sort_keys=True) for k, v in meta.items()}


def checkpoint_json(m: CheckpointManifest) -> dict:
    """A storage manifest as the SDK's ``Checkpoint`` type."""
    exp = m.expires_unix
    return {
        "checkpoint_id": m.checkpoint_id,
        "checkpoint_type": m.checkpoint_type,
        "time": m.time,
        "tinker_path": m.tinker_path,
        "size_bytes": m.size_bytes,
        "public": bool(m.public),
        "user_metadata": str_metadata(m.user_metadata),
        "expires_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(exp)) if exp else None,
    }


def _live(m: CheckpointManifest) -> bool:
    exp = m.expires_unix
    return not exp or exp > time.time()


async def _run_checkpoints(g: Gateway, run_id: str, who: str | None) -> list[CheckpointManifest]:
    """Live checkpoints of a run owned by ``who`` (None: any owner; admin listings), newest first."""
    ms = [m for m in await g.run_manifests(run_id) if (who is None or m.owner == who) and _live(m)]
    ms.sort(key=lambda m: m.created_unix or 0, reverse=True)
    return ms


def training_run_json(rec: TrainingRun, ckpts: list[CheckpointManifest]) -> dict:
    """A training-run record as the SDK's ``TrainingRun`` type."""
    last = next((checkpoint_json(m) for m in ckpts if m.checkpoint_type == "training"), None)
    last_s = next((checkpoint_json(m) for m in ckpts if m.checkpoint_type == "sampler"), None)
    return {
        "training_run_id": rec.model_id,
        "base_model": rec.base_model,
        "model_owner": rec.owner,
        "is_lora": True,
        "corrupted": False,
        "lora_rank": rec.lora_config.rank,
        "last_request_time": rec.last_request_time or rec.created,
        "last_checkpoint": last,
        "last_sampler_checkpoint": last_s,
        "user_metadata": str_metadata(rec.user_metadata),
    }


@router.post("/weights_info", response_model=wire.WeightsInfoResponse)
async def weights_info(req: wire.WeightsInfoRequest, g: GatewayDep, caller: CallerDep) -> dict:
    """``RestClient.get_weights_info_by_tinker_path``: base model and LoRA shape of a readable checkpoint."""
    m = await readable_manifest(g, TinkerPath.parse(req.tinker_path, field="tinker_path"), caller.owner, "tinker_path")
    lora = m.lora_config or LoraConfig()
    out = {
        "base_model": m.base_model,
        "is_lora": True,
        "lora_rank": lora.rank,
        "train_unembed": lora.train_unembed,
        "train_mlp": lora.train_mlp,
        "train_attn": lora.train_attn,
    }
    if m.optimizer_config is not None:  # else the model's default (adamw)
        out["optimizer_config"] = m.optimizer_config
    return out


@router.get("/training_runs", response_model=wire.TrainingRunsResponse)
async def list_training_runs(g: GatewayDep, who: ScopeDep, limit: int = 20, offset: int = 0,
                             project_id: str | None = None) -> dict:
    """Newest first; ``project_id`` keeps the runs of sessions in that project (see
    :func:`assign_session_project`)."""
    recs = await g.runs(who)
    if project_id is not None:
        in_project = {r.session_id for r in await g.sessions() if r.project_id == project_id}
        recs = [r for r in recs if r.session_id in in_project]
    recs.sort(key=lambda r: r.created, reverse=True)
    page = recs[offset : offset + limit]
    runs = [training_run_json(r, await _run_checkpoints(g, r.model_id, who)) for r in page]
    return {"training_runs": runs, "cursor": {"offset": offset, "limit": limit, "total_count": len(recs)}}


@router.get("/training_runs/{run_id}", response_model=wire.TrainingRun)
async def get_training_run(run_id: str, run: OwnedRunDep, g: GatewayDep, who: ScopeDep) -> dict:
    """One training run (the caller's; any for an admin with ``access_scope=all``) with its latest checkpoints."""
    return training_run_json(run, await _run_checkpoints(g, run_id, who))


@router.get("/training_runs/{run_id}/checkpoints", response_model=wire.CheckpointsListResponse)
async def list_checkpoints(run_id: str, run: OwnedRunDep, g: GatewayDep, who: ScopeDep) -> dict:
    """The live checkpoints of a training run the caller may read, newest first."""
    return {"checkpoints": [checkpoint_json(m) for m in await _run_checkpoints(g, run_id, who)], "cursor": None}


@router.get("/checkpoints", response_model=wire.CheckpointsListResponse)
async def list_user_checkpoints(g: GatewayDep, who: ScopeDep, limit: int = 100, offset: int = 0) -> dict:
    """The live checkpoints of all the caller's runs (every owner's for an admin listing all), newest first; paged."""
    allm: list[CheckpointManifest] = []
    for r in await g.runs(who):
        allm.extend(await _run_checkpoints(g, r.model_id, who))
    allm.sort(key=lambda m: m.created_unix or 0, reverse=True)
    page = allm[offset : offset + limit]
    return {"checkpoints": [checkpoint_json(m) for m in page],
            "cursor": {"offset": offset, "limit": limit, "total_count": len(allm)}}


def bare_checkpoint_id(checkpoint_id: str) -> UserError:
    """The 400 of a checkpoint named without its kind (``ckpt0`` where the REST routes take
    ``weights/ckpt0``): it names ``checkpoint_id`` and the path form, as an upstream-compatible
    server answers (not a 404 or 405 of a route that does not exist)."""
    kinds = ", ".join(f"{k}/{checkpoint_id.split('/')[0]}" for k in KINDS)
    return UserError("checkpoint_id", f"{checkpoint_id!r} is not a checkpoint id: checkpoint ids are <kind>/<name> "
                                      f"(one of {kinds}), the tail of tinker://<run>/<kind>/<name>")


async def _checkpoint(g: Gateway, owner: str, run_id: str, checkpoint_id: str) -> tuple[TinkerPath, CheckpointManifest]:
    """``owner``'s live checkpoint ``<kind>/<name>`` of run ``run_id`` (path + manifest).

    Raises:
        UserError: not a ``<kind>/<name>`` id (400 naming ``checkpoint_id`` and the path form).
        NotFound: absent, expired, or another key's.
    """
    if checkpoint_id.split("/")[0] not in KINDS:
        raise bare_checkpoint_id(checkpoint_id)
    path = TinkerPath.parse(f"tinker://{run_id}/{checkpoint_id}", field="checkpoint_id")
    m = await g.manifest(path)
    if m is None or m.owner != owner or not _live(m):
        raise NotFound("checkpoint_id", f"no checkpoint {checkpoint_id!r} in training run {run_id!r}")
    return path, m


# Checkpoint ids are ``<kind>/<name>`` (exactly one "/", names never contain one), so the routes
# spell out both segments: a greedy ``{checkpoint_id:path}`` would let DELETE .../publish
# (unpublish) be taken for a delete of a checkpoint named "<name>/publish".
CKPT = "/training_runs/{run_id}/checkpoints/{kind}/{name}"


@router.delete(CKPT)
async def delete_checkpoint(run_id: str, kind: str, name: str, g: GatewayDep, caller: CallerDep) -> dict:
    """Delete one of the caller's checkpoints (404 for another key's)."""
    path, _ = await _checkpoint(g, caller.owner, run_id, f"{kind}/{name}")
    await asyncio.to_thread(g.storage.delete, path)
    return {"deleted": str(path)}


async def _set_public(g: Gateway, owner: str, run_id: str, checkpoint_id: str, public: bool) -> dict:
    """Publish / unpublish. Already in that state: 400 (hosted Tinker answers 409, which the SDK
    would retry for 5 minutes before failing)."""
    path, m = await _checkpoint(g, owner, run_id, checkpoint_id)
    if bool(m.public) == public:
        raise UserError("checkpoint_id", f"checkpoint is already {'public' if public else 'private'}")
    m.public = public
    await asyncio.to_thread(g.storage.write_manifest, path, m.stored())
    return {"public": public}


@router.post(CKPT + "/publish")
async def publish(run_id: str, kind: str, name: str, g: GatewayDep, caller: CallerDep) -> dict:
    """Make one of the caller's checkpoints readable by every key."""
    return await _set_public(g, caller.owner, run_id, f"{kind}/{name}", True)


@router.delete(CKPT + "/publish")
async def unpublish(run_id: str, kind: str, name: str, g: GatewayDep, caller: CallerDep) -> dict:
    """Make a published checkpoint of the caller private again."""
    return await _set_public(g, caller.owner, run_id, f"{kind}/{name}", False)


@router.put(CKPT + "/ttl")
async def set_ttl(run_id: str, kind: str, name: str, req: wire.TtlRequest, g: GatewayDep, caller: CallerDep) -> dict:
    """Set (``ttl_seconds``, counted from now) or clear (null) a checkpoint's expiry."""
    path, m = await _checkpoint(g, caller.owner, run_id, f"{kind}/{name}")
    m.ttl_seconds = req.ttl_seconds
    m.expires_unix = (time.time() + req.ttl_seconds) if req.ttl_seconds else None
    await asyncio.to_thread(g.storage.write_manifest, path, m.stored())
    return {"ttl_seconds": req.ttl_seconds}


@router.get(CKPT + "/external_weights_urls", response_model=wire.ExternalWeightsUrlsResponse)
async def get_external_weights_urls(run_id: str, kind: str, name: str, request: Request, g: GatewayDep,
                                    caller: CallerDep) -> dict:
    """Signed, expiring download URLs for every file of the checkpoint (see
    :mod:`functions.gateway.routes_download`)."""
    from functions.gateway.routes_download import external_weights_urls

    path, m = await _checkpoint(g, caller.owner, run_id, f"{kind}/{name}")
    return await external_weights_urls(request, path, m)


@router.get(CKPT + "/archive")
async def get_checkpoint_archive_url(run_id: str, kind: str, name: str, request: Request, g: GatewayDep,
                                     caller: CallerDep) -> dict:
    """Older SDKs' ``RestClient.get_checkpoint_archive_url``: ``{url, expires}`` of a signed
    ``.tar`` of the checkpoint (see :func:`functions.gateway.routes_download.archive_url`)."""
    from functions.gateway.routes_download import archive_url

    path, m = await _checkpoint(g, caller.owner, run_id, f"{kind}/{name}")
    return await archive_url(request, path, m)


# A checkpoint named by its bare id (``.../checkpoints/ckpt0``, ``.../checkpoints/ckpt0/archive``):
# without these routes the first would answer 404 and the second 405 (the DELETE route above
# matches its path); both answer the 400 of :func:`bare_checkpoint_id`. (A DELETE of
# ``ckpt0/publish`` reaches :func:`delete_checkpoint`, whose kind check answers the same.)
@router.api_route("/training_runs/{run_id}/checkpoints/{checkpoint_id}", methods=["GET", "DELETE", "POST", "PUT"])
async def bare_checkpoint(run_id: str, checkpoint_id: str, run: OwnedRunDep) -> dict:
    """A checkpoint id without its ``<kind>/``: 400 naming ``checkpoint_id`` (404 for another key's run)."""
    raise bare_checkpoint_id(checkpoint_id)


@router.api_route("/training_runs/{run_id}/checkpoints/{checkpoint_id}/{action}", methods=["GET", "POST", "PUT"])
async def bare_checkpoint_action(run_id: str, checkpoint_id: str, action: str, run: OwnedRunDep) -> dict:
    """``archive``, ``publish``, ``ttl``, ``external_weights_urls`` of a bare checkpoint id: 400
    naming ``checkpoint_id``; a ``<kind>/<name>`` id never reaches here (its routes have three
    segments)."""
    raise bare_checkpoint_id(checkpoint_id)


@router.get("/sessions", response_model=wire.ListSessionsResponse)
async def list_sessions(g: GatewayDep, who: ScopeDep, limit: int = 20, offset: int = 0) -> dict:
    """Session ids of the caller (every owner's for an admin listing all), newest first; paged."""
    recs = await g.sessions(who)
    recs.sort(key=lambda r: r.created, reverse=True)
    return {"sessions": [r.session_id for r in recs[offset : offset + limit]]}


@router.get("/sessions/{session_id}", response_model=wire.GetSessionResponse)
async def get_session(session_id: str, g: GatewayDep, caller: CallerDep) -> dict:
    """A session of the caller: its training runs, sampling sessions and metadata."""
    rec = await g.session(session_id, caller.owner)
    return {
        "training_run_ids": rec.training_run_ids,
        "sampler_ids": rec.sampler_ids,
        "user_metadata": str_metadata(rec.user_metadata),
        "display_name": rec.display_name,
    }


# ----------------------------------------------------------------------- sessions, misc


@router.put("/sessions/{session_id}/project")
async def assign_session_project(session_id: str, req: wire.SetSessionProjectRequest, g: GatewayDep,
                                 caller: CallerDep) -> dict:
    """``RestClient.assign_session_project``: record the session's project id. Projects are plain
    labels here (no membership or access control): ``list_training_runs(project_id=...)`` and
    ``search_sessions(project_ids=...)`` filter by it."""
    await g.session(session_id, caller.owner)
    if not req.project_id:
        raise UserError("project_id", "required")

    def upd(rec: Session) -> None:
        rec.project_id = req.project_id

    await g.update_session(session_id, upd)
    return {"session_id": session_id, "project_id": req.project_id}


def _session_status(rec: Session) -> dict:
    """A session record's status as the SDK's ``SessionStatus`` union."""
    if rec.status == "finished":
        return {"type": "client_finished", "reason": {"type": rec.finish_reason or "success"}}
    return {"type": "active"}


@router.post("/sessions/search")
async def search_sessions(g: GatewayDep, caller: CallerDep, req: wire.SessionSearchRequest | None = None) -> dict:
    """``RestClient.search_sessions`` (experimental in the SDK): the caller's sessions, newest
    first, filtered by ``session_id`` / ``display_name`` (either matches), ``project_ids``,
    ``user_metadata`` (every pair) and ``statuses`` (``client_finished`` with ``reasons``: those
    finish reasons); ``owner`` ``user`` + ``owner_urns`` (admin): those owners' sessions;
    ``limit`` + ``cursor`` paging.

    Raises:
        NotSupported: ``owner`` other than ``{"type": "own"}`` for a non-admin key.
    """
    from openrl.errors import NotSupported

    body = req.model_dump(exclude_none=True) if req is not None else {}  # 400 naming the field if it does not fit
    who = caller.owner
    own = (body.get("owner") or {}).get("type", "own")
    if own != "own" and not caller.admin:
        raise NotSupported("owner", "searching other owners' sessions needs an admin key")
    recs = await g.sessions(who if own == "own" else None)
    urns = (body.get("owner") or {}).get("owner_urns")
    if own == "user":  # {"type": "user", "owner_urns": [...]}: those owners' sessions
        require(bool(urns), "owner.owner_urns", "required with owner type 'user'")
        recs = [r for r in recs if r.owner in set(urns)]
    sid, name = body.get("session_id"), body.get("display_name")
    if sid is not None or name:
        words = (name or "").lower().split()
        recs = [r for r in recs if (sid is not None and r.session_id == sid)
                or (words and all(w in (r.display_name or "").lower() for w in words))]
    if body.get("project_ids") is not None:
        recs = [r for r in recs if (r.project_id or "default") in body["project_ids"]]
    for k, v in (str_metadata(body.get("user_metadata")) or {}).items():
        recs = [r for r in recs if (str_metadata(r.user_metadata) or {}).get(k) == v]
    if body.get("statuses"):
        def matches(status: dict, q: dict) -> bool:  # client_finished may name the finish reasons
            return status["type"] == q.get("type") and (
                q.get("reasons") is None or status.get("reason", {}).get("type") in q["reasons"])

        recs = [r for r in recs if any(matches(_session_status(r), q) for q in body["statuses"])]
    recs.sort(key=lambda r: (r.created, r.session_id), reverse=True)
    cur = body.get("cursor")
    if cur:
        last = (str(cur.get("last_created_at", "")).replace("+00:00", "Z"), cur.get("last_session_id", ""))
        recs = [r for r in recs if (r.created, r.session_id) < last]
    limit = max(1, min(200, int(body.get("limit") or 50)))
    page = recs[:limit]
    out = []
    for r in page:
        n = 0
        for run_id in r.training_run_ids:
            n += len(await _run_checkpoints(g, run_id, r.owner))
        out.append({"session_id": r.session_id, "created_at": r.created, "owner": r.owner,
                    "project_id": r.project_id or "default", "status": _session_status(r),
                    "checkpoints_count": n, "display_name": r.display_name,
                    "user_metadata": str_metadata(r.user_metadata)})
    nxt = None
    if len(recs) > limit:
        nxt = {"last_created_at": page[-1].created, "last_session_id": page[-1].session_id}
    return {"sessions": out, "next_cursor": nxt}


@router.get("/audit")
@router.get("/billing/usage/events")
@router.get("/billing/usage/checkpoints/current")
async def admin_unsupported(request: Request) -> dict:
    """``AdminClient`` audit log and billing routes: not supported (no billing)."""
    from openrl.errors import NotSupported

    raise NotSupported(request.url.path.removeprefix("/api/v1/"), "audit logs and billing are not kept by this server")
