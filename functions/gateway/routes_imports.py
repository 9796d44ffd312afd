"""Importing adapters trained elsewhere, and searching checkpoints: the SDK 0.39+ REST surface
(``RestClient.external_weights_upload_start`` / ``_finish``, ``RestClient.search_checkpoints``).

**Upload** (the shapes of tinker 0.39 / 0.40's ``types/external_weights_upload.py``, as its
reference docs give them):

1. ``POST /api/v1/external_weights_upload_start`` ``{base_model, lora_config,
   destination_project_id?}`` answers ``{upload_id, urls, expires}``: one signed URL per file of a
   PEFT adapter (``adapter_config.json``, ``adapter_model.safetensors``). ``urls`` maps each file
   to its URL string (SDK 0.39, and any client that does not say it is 0.40 or newer), or to
   ``{url, headers}`` for a client whose ``X-Stainless-Package-Version`` is 0.40 or newer (0.40's
   ``ExternalWeightsUploadURL``).
2. The client ``PUT`` s each file to its URL (no API key: the URL is the credential, as a
   cloud signed URL; :func:`upload_file`). The URLs are the gateway's own
   ``/upload/<upload_id>/<file>?expires=&sig=`` (HMAC-SHA256 with the download URLs' secret,
   :mod:`functions.gateway.routes_download`); a file may be put again until the upload is finished
   or the URL expires. Staged files live in storage under ``_runstate/uploads/<upload_id>/``, so
   any gateway replica takes any part. A file is at most ``OPENRL_MAX_BODY_BYTES``.
3. ``POST /api/v1/external_weights_upload_finish`` ``{upload_id}`` checks the adapter against
   the base model (:func:`openrl.model.adapter_check.check_peft_adapter`: LoRA variant, rank,
   target groups, every tensor's name, shape, dtype and finiteness; the declared ``lora_config``
   must match) and stores it as ``tinker://<run>/external_weights/imported``, owned by a new,
   untrainable training run (like a ``copy_weights`` copy) in a new session of
   ``destination_project_id``. It answers ``{tinker_path}``; a second finish answers the same
   path. ``ServiceClient.create_training_client_from_state(path)`` continues training from it
   (a fresh optimizer: the adapter carries none; the run keeps the adapter's ``lora_alpha``), and
   ``create_sampling_client(model_path=path)`` samples it.

**Search**: ``POST /api/v1/checkpoints/search`` (the SDK's ``CheckpointSearchRequest``): the
caller's live checkpoints (every owner's for an admin key with ``owner: {"type": "all"}``),
newest first, filtered by ``project_ids`` (the project of the run's session; ``"default"`` when
none), ``user_metadata`` (every pair, as strings), ``checkpoint_type`` and ``base_models`` (an
empty list matches nothing), paged by ``limit`` (1-200) and ``cursor``
(``{last_created_at, last_checkpoint_uuid}``; the uuid is the checkpoint's ``tinker_path``).
"""

from __future__ import annotations

import asyncio
import json
import tempfile
import time
import uuid
from datetime import datetime, timedelta, timezone
from pathlib import Path

from fastapi import APIRouter, Request

from functions.gateway.context import require
from functions.gateway.deps import API_PREFIX, CallerDep, GatewayDep, WireRoute
from functions.gateway.routes_download import _public_base, _secret, sign, url_ttl_s
from functions.gateway.runs import add_to_session, model_id_for
from openrl.contract.records import CheckpointManifest, Session, TrainingRun, Upload
from openrl.edge import wire
from openrl.errors import NotFound, NotSupported, UserError
from openrl.model.adapter_check import ADAPTER_CONFIG_NAME, ADAPTER_WEIGHTS_NAME, check_peft_adapter
from openrl.storage import RUNSTATE_DIR, TinkerPath
from openrl.storage.layout import build_manifest
from openrl.transport.bus import now_iso

router = APIRouter(prefix=API_PREFIX, route_class=WireRoute)  # behind the API key
public = APIRouter()  # the signed upload URLs (no key)

UPLOAD_FILES = (ADAPTER_CONFIG_NAME, ADAPTER_WEIGHTS_NAME)
#: the checkpoint name of an imported adapter: ``tinker://<new run>/external_weights/imported``
IMPORTED_NAME = "imported"


def _staged_key(upload_id: str, file: str) -> str:
    return f"{RUNSTATE_DIR}/uploads/{upload_id}/{file}"


def _wants_url_objects(request: Request) -> bool:
    """Whether the client is tinker 0.40 or newer (``urls`` values ``{url, headers}``), from the
    SDK's ``X-Stainless-Package-Version`` header."""
    v = request.headers.get("x-stainless-package-version") or ""
    try:
        major, minor = (int(x) for x in v.split(".")[:2])
    except ValueError:
        return False
    return (major, minor) >= (0, 40)


async def _upload(g, upload_id: str, owner: str | None) -> Upload:
    """The upload record ``upload_id`` (``owner``'s, when given).

    Raises:
        NotFound: unknown, or another key's (404 naming ``upload_id``).
    """
    rec = Upload.load(await g.bus.meta_get("upload", upload_id)) if upload_id.isalnum() else None
    if rec is None or (owner is not None and rec.owner != owner):
        raise NotFound("upload_id", f"unknown upload {upload_id!r}")
    return rec


@router.post("/external_weights_upload_start")
async def external_weights_upload_start(req: wire.ExternalWeightsUploadStartRequest, request: Request,
                                        g: GatewayDep, caller: CallerDep) -> dict:
    """Start an adapter upload: ``{upload_id, urls, expires}`` (see the module doc).

    Raises:
        UserError: unknown ``base_model``; ``lora_config.rank`` outside 1-512.
    """
    g.registry.resolve(req.base_model)
    lora = req.lora_config.model_dump()
    if not 1 <= lora["rank"] <= 512:
        raise UserError("lora_config.rank", "must be between 1 and 512")
    upload_id = uuid.uuid4().hex
    ttl = url_ttl_s(request)
    expires = int(time.time()) + ttl
    await g.bus.meta_put(Upload.make(upload_id=upload_id, owner=caller.owner, base_model=req.base_model,
                                     lora_config=lora, destination_project_id=req.destination_project_id,
                                     created=now_iso(), expires_unix=expires, tinker_path=None),
                         "upload", upload_id)
    secret = await _secret(request)
    base = _public_base(request)
    urls = {f: f"{base}/upload/{upload_id}/{f}?expires={expires}&sig={sign(secret, f'upload/{upload_id}/{f}', expires)}"
            for f in UPLOAD_FILES}
    if _wants_url_objects(request):
        urls = {f: {"url": u, "headers": {"Content-Type": "application/octet-stream"}} for f, u in urls.items()}
    return {"upload_id": upload_id, "urls": urls,
            "expires": datetime.fromtimestamp(expires, tz=timezone.utc).isoformat().replace("+00:00", "Z")}


@public.put("/upload/{upload_id}/{file}")
async def upload_file(upload_id: str, file: str, request: Request, expires: int = 0, sig: str = "") -> dict:
    """Receive one file of a started upload (signed URL, no API key).

    Raises:
        UserError: a bad or tampered signature (403 naming ``sig``), an expired URL (403 naming
            ``expires``), a file the upload does not take (400 naming ``file``).
        NotFound: unknown upload; one already finished (404 naming ``upload_id``).
    """
    import hmac

    from functions.gateway.deps import get_gateway

    g = get_gateway(request)
    secret = await _secret(request)
    if not hmac.compare_digest(sign(secret, f"upload/{upload_id}/{file}", expires), sig):
        err = UserError("sig", "bad signature")
        err.status = 403
        raise err
    if expires < time.time():
        err = UserError("expires", "this upload URL has expired; start a new upload")
        err.status = 403
        raise err
    if file not in UPLOAD_FILES:
        raise UserError("file", f"an upload takes {', '.join(UPLOAD_FILES)}")
    rec = await _upload(g, upload_id, None)
    if rec.tinker_path:
        raise NotFound("upload_id", f"upload {upload_id!r} is finished ({rec.tinker_path})")
    body = await request.body()
    await asyncio.to_thread(g.storage._put_internal, _staged_key(upload_id, file), body)
    return {"upload_id": upload_id, "file": file, "size_bytes": len(body)}


@router.post("/external_weights_upload_finish")
async def external_weights_upload_finish(req: wire.ExternalWeightsUploadFinishRequest, g: GatewayDep,
                                         caller: CallerDep) -> dict:
    """Check the uploaded adapter and store it as an ``external_weights`` checkpoint:
    ``{tinker_path}`` (see the module doc).

    Raises:
        NotFound: unknown upload, or another key's.
        UserError: a file not uploaded, or an adapter that does not fit the declared
            ``lora_config`` / the base model (400 naming the file, tensor or field).
    """
    rec = await _upload(g, req.upload_id, caller.owner)
    if rec.tinker_path:
        return {"tinker_path": rec.tinker_path}
    who = caller.owner
    with tempfile.TemporaryDirectory(prefix="openrl-import-") as tmp:
        d = Path(tmp)
        for f in UPLOAD_FILES:
            data = await asyncio.to_thread(g.storage._get_internal, _staged_key(req.upload_id, f))
            if data is None:
                raise UserError(f, f"not uploaded: PUT it to its URL from external_weights_upload_start first")
            (d / f).write_bytes(data)
        entry = g.registry.resolve(rec.base_model)
        lora = await asyncio.to_thread(check_peft_adapter, Path(entry.path), d, rec.lora_config.stored())
        lora["seed"] = rec.lora_config.seed
        session_id = uuid.uuid4().hex[:20]
        await g.bus.meta_put(Session.make(
            session_id=session_id, owner=who, tags=["external_weights_upload"], user_metadata={},
            display_name=None, project_id=rec.destination_project_id, sdk_version=None,
            created=now_iso(), last_heartbeat=now_iso(), status="finished", finish_reason="success",
            training_run_ids=[], sampler_ids=[],
        ), "session", session_id)
        model_id = model_id_for(session_id, 0)
        run = TrainingRun.make(
            model_id=model_id, session_id=session_id, owner=who, base_model=rec.base_model, lora_config=lora,
            optimizer_config=None, tokenizer_id=entry.tokenizer_id, shard=g.shard_of(model_id),
            created=now_iso(), last_request_time=now_iso(), user_metadata={}, frozen=True,
            copy_of=f"upload:{req.upload_id}",
        )
        await g.bus.meta_create(run, "model", model_id)
        await add_to_session(g, session_id, "training_run_ids", model_id)
        path = TinkerPath(model_id, "external_weights", IMPORTED_NAME)
        manifest = build_manifest(d, path, owner=who, ttl_seconds=None, extra={
            "base_model": rec.base_model, "lora_config": lora, "imported_from": f"upload:{req.upload_id}"})
        await asyncio.to_thread(g.storage.put_dir, path, d, manifest)

    def done(old: dict | None) -> dict:
        cur = Upload.load(old) if old else rec.model_copy(deep=True)
        cur.tinker_path, cur.finished = str(path), now_iso()
        return cur.stored()

    await g.bus.meta_update(done, "upload", req.upload_id)
    for f in UPLOAD_FILES:
        await asyncio.to_thread(g.storage._delete_internal, _staged_key(req.upload_id, f))
    return {"tinker_path": str(path)}


# ------------------------------------------------------------------------- search


_EPOCH = datetime(1970, 1, 1, tzinfo=timezone.utc)


def _us(m: CheckpointManifest) -> int:
    """A manifest's creation time in whole microseconds (the cursor's resolution)."""
    return int(round(float(m.created_unix or 0) * 1_000_000))


def _iso(us: int) -> str:
    return (_EPOCH + timedelta(microseconds=us)).isoformat().replace("+00:00", "Z")


def _cursor_us(iso: str, field_name: str) -> int:
    try:
        dt = datetime.fromisoformat(iso.replace("Z", "+00:00"))
    except ValueError:
        raise UserError(field_name, f"{iso!r} is not an ISO-8601 time (pass next_cursor back unchanged)") from None
    if dt.tzinfo is None:
        dt = dt.replace(tzinfo=timezone.utc)
    return (dt - _EPOCH) // timedelta(microseconds=1)


@router.post("/checkpoints/search")
async def search_checkpoints(req: wire.CheckpointSearchRequest, g: GatewayDep, caller: CallerDep) -> dict:
    """``RestClient.search_checkpoints``: ``{checkpoints: [Checkpoint], next_cursor}`` (module doc).

    Raises:
        NotSupported: ``owner`` other than ``{"type": "own"}`` for a non-admin key.
        UserError: a ``cursor`` whose time is not ISO-8601.
    """
    from functions.gateway.routes_rest import _run_checkpoints, checkpoint_json

    own = (req.owner.type if req.owner is not None else "own")
    if own != "own" and not caller.admin:
        raise NotSupported("owner", "searching other owners' checkpoints needs an admin key")
    who = caller.owner if own == "own" else None
    runs = await g.runs(who)
    if own == "user":  # {"type": "user", "owner_urns": [...]}: those owners' checkpoints
        urns = set(req.owner.owner_urns or [])
        require(bool(urns), "owner.owner_urns", "required with owner type 'user'")
        runs = [r for r in runs if r.owner in urns]
    if req.base_models is not None:
        runs = [r for r in runs if r.base_model in set(req.base_models)]
    if req.project_ids is not None:
        projects = {s.session_id: s.project_id or "default" for s in await g.sessions()}
        runs = [r for r in runs if projects.get(r.session_id, "default") in set(req.project_ids)]
    found = []
    for r in runs:
        for m in await _run_checkpoints(g, r.model_id, who):
            if req.checkpoint_type is not None and m.checkpoint_type != req.checkpoint_type:
                continue
            meta = m.user_metadata or {}
            if any(str(meta.get(k)) != str(v) or k not in meta for k, v in (req.user_metadata or {}).items()):
                continue
            found.append(m)
    found.sort(key=lambda m: (_us(m), m.tinker_path), reverse=True)
    if req.cursor is not None:
        last = (_cursor_us(req.cursor.last_created_at, "cursor.last_created_at"), req.cursor.last_checkpoint_uuid)
        found = [m for m in found if (_us(m), m.tinker_path) < last]
    page = found[: req.limit]
    nxt = None
    if len(found) > req.limit:
        nxt = {"last_created_at": _iso(_us(page[-1])), "last_checkpoint_uuid": page[-1].tinker_path}
    return {"checkpoints": [checkpoint_json(m) for m in page], "next_cursor": nxt}
