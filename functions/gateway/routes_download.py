"""Download URLs for checkpoint files: ``RestClient.get_external_weights_urls``.

``GET /api/v1/training_runs/{run}/checkpoints/{kind}/{name}/external_weights_urls`` (in
:mod:`functions.gateway.routes_rest`) answers ``{urls: {file: url}, expires}`` with one URL per
file of the checkpoint (``adapter_model.safetensors``, ``adapter_config.json``, ...). Anyone
holding a URL can GET the file until ``expires``, with no API key (like a cloud signed URL):

* ``gs://`` storage whose credentials can sign: a GCS V4 signed URL straight to the object.
* otherwise (``file://`` storage, or GCS credentials that cannot sign, e.g. the emulator):
  ``<gateway>/download/<run>/<kind>/<name>/<file>?expires=<unix s>&sig=<hex>``, answered by
  :func:`download` below, which streams the file from storage.

The signature is ``HMAC-SHA256(secret, "<run>/<kind>/<name>/<file>\\n<expires>")`` in hex
(``<file>`` = ``*archive*`` for the ``.tar`` of a whole checkpoint that older SDKs ask for).
The secret is ``$OPENRL_DOWNLOAD_SECRET``, or else a random 32-byte secret created once in the
metadata KV bucket (key ``config.download_secret``), so every gateway replica signs and checks
with the same one and none keeps private state. The route lives outside ``/api/v1`` because
the URLs carry no API key; a bad, expired or tampered signature answers 403 (field ``sig``, or
``expires`` once past it). A URL may be used any number of times until it expires (retries,
parallel or resumed downloads, as with a cloud signed URL); it is not single-use.

Encrypted exports: ``save_weights_external(..., age_encryption_recipients=[...])`` stores
only age ciphertext, each file as ``<file>.age`` (:func:`request_age_encryption`, then the
store's ``put_dir``; see :mod:`openrl.storage.sealing`). The URLs above then name and serve the
``.age`` files unchanged; the server never holds an identity that decrypts them. A deleted or
expired export answers 404 both here and at ``external_weights_urls``.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import os
import secrets
import time
from datetime import datetime, timedelta, timezone
from urllib.parse import quote

from fastapi import APIRouter, Request
from fastapi.responses import FileResponse, JSONResponse

from functions.gateway.deps import get_gateway
from openrl.contract.records import CheckpointManifest, DownloadSecret
from openrl.errors import NotFound, UserError
from openrl.storage import TinkerPath, check_name
from openrl.storage.sealing import parse_recipients

router = APIRouter()

#: lifetime of a download URL (seconds) [OPENRL_DOWNLOAD_TTL_S]
DEFAULT_TTL_S = 3600


def url_ttl_s(request: Request) -> int:
    """Seconds a download URL stays valid (the gateway's ``download_ttl_s``:
    ``$OPENRL_DOWNLOAD_TTL_S``, default 3600)."""
    return max(1, get_gateway(request).settings.download_ttl_s)


async def _secret(request: Request) -> bytes:
    """The shared HMAC key: the gateway's ``download_secret`` (``$OPENRL_DOWNLOAD_SECRET``) or one
    random key kept in the KV bucket."""
    env = get_gateway(request).settings.download_secret
    if env:
        return env.encode()
    cached = getattr(request.app.state, "download_secret", None)
    if cached:
        return cached
    bus = get_gateway(request).bus
    rec = DownloadSecret.load(await bus.meta_get("config", "download_secret"))
    if rec is None:
        await bus.meta_create(DownloadSecret.make(secret=secrets.token_hex(32)), "config", "download_secret")
        # the winner's, if another replica raced us
        rec = DownloadSecret.load(await bus.meta_get("config", "download_secret"))
    key = str(rec.secret).encode()
    request.app.state.download_secret = key
    return key


def sign(secret: bytes, what: str, expires: int) -> str:
    """Hex HMAC-SHA256 over ``"<what>\\n<expires>"``: a download URL's signature."""
    return hmac.new(secret, f"{what}\n{int(expires)}".encode(), hashlib.sha256).hexdigest()


def signature(secret: bytes, path: TinkerPath, file: str, expires: int) -> str:
    """:func:`sign` over ``"<run>/<kind>/<name>/<file>"``: a checkpoint file's URL."""
    return sign(secret, f"{path.key}/{file}", expires)


def _public_base(request: Request) -> str:
    """Base URL clients reach the gateway at: the gateway's ``public_url`` (``$OPENRL_PUBLIC_URL``)
    or the request's own."""
    return (get_gateway(request).settings.public_url or str(request.base_url)).rstrip("/")


def _gcs_signed_urls(storage, path: TinkerPath, files: list[str], expires: datetime) -> dict[str, str] | None:
    """V4 signed URLs for a ``gs://`` checkpoint, or None when the credentials cannot sign
    (no private key / no IAM signBlob, anonymous emulator credentials, any other failure)."""
    try:
        prefix = storage._ckpt_prefix(path)
        return {f: storage.bucket.blob(prefix + f).generate_signed_url(
            version="v4", expiration=expires, method="GET") for f in files}
    except Exception:  # noqa: BLE001 - fall back to the gateway's signed route
        return None


async def external_weights_urls(request: Request, path: TinkerPath, manifest: CheckpointManifest) -> dict:
    """``ExternalWeightsUrlsResponse`` for a checkpoint the caller owns: ``{urls: {file: url},
    expires: ISO-8601}``.

    Raises:
        NotFound: the manifest lists no files.
    """
    files = sorted(f for f in (manifest.files or {}) if f != "manifest.json")
    if not files:
        raise NotFound("checkpoint_id", f"checkpoint {path} has no files")
    ttl = url_ttl_s(request)
    expires_unix = int(time.time()) + ttl
    expires = datetime.fromtimestamp(expires_unix, tz=timezone.utc)
    storage = get_gateway(request).storage
    urls = None
    if storage.url.startswith("gs://") or type(storage).__name__ == "GCSStorage":
        urls = await asyncio.to_thread(_gcs_signed_urls, storage, path, files, timedelta(seconds=ttl))
    if urls is None:
        key = await _secret(request)
        base = _public_base(request)
        urls = {f: f"{base}/download/{quote(path.run_id, safe=':')}/{path.kind}/{quote(path.name, safe=':')}/"
                   f"{quote(f)}?expires={expires_unix}&sig={signature(key, path, f, expires_unix)}"
                for f in files}
    return {"urls": urls, "expires": expires.isoformat().replace("+00:00", "Z")}


async def request_age_encryption(g, path: TinkerPath, seq_id: int | None, recipients: list[str] | None) -> None:
    """Validate ``age_encryption_recipients`` of a ``save_weights_external`` and, when given,
    record them for (``path``, ``seq_id``) in storage before the save is published, so the
    trainer's write stores only ciphertext (:meth:`openrl.storage.Storage.seal_export`).

    Raises:
        UserError: an empty list, more than 10 entries, or an entry that is not an ``age1...``
            X25519 key or an SSH public key (field ``age_encryption_recipients[i]``).
    """
    if recipients is None:
        return
    parse_recipients(recipients)  # 400 at the edge, before anything is written
    await asyncio.to_thread(g.storage.put_export_request, path, seq_id, recipients)


def _forbidden(detail: str, field: str = "sig") -> JSONResponse:
    return JSONResponse(status_code=403, content={"detail": f"{field}: {detail}", "category": "user", "field": field})


@router.get("/download/{run_id}/{kind}/{name}/{file}")
async def download(run_id: str, kind: str, name: str, file: str, request: Request, expires: int = 0, sig: str = ""):
    """Stream one checkpoint file to the holder of a signed URL (no API key).

    Answers 403 for a missing / wrong / expired signature, 404 when the checkpoint or file is
    gone (deleted or expired since the URL was made), else the file as
    ``application/octet-stream``.
    """
    try:
        path = TinkerPath.parse(f"tinker://{run_id}/{kind}/{name}", field="path")
        check_name(file, "file")
    except UserError as exc:
        return JSONResponse(status_code=404, content={"detail": exc.message, "category": "user", "field": "path"})
    if not sig or expires < time.time():
        return _forbidden("download URL expired or unsigned; ask get_external_weights_urls for a new one",
                          "sig" if not sig else "expires")
    want = signature(await _secret(request), path, file, expires)
    if not hmac.compare_digest(want, sig):
        return _forbidden("bad download URL signature")
    g = get_gateway(request)
    m = await g.manifest(path)
    exp = m.expires_unix if m is not None else None
    if m is None or file not in (m.files or {}) or (exp and exp <= time.time()):
        return JSONResponse(status_code=404, content={"detail": f"no file {file!r} in {path}", "category": "user",
                                                      "field": "path"})
    local = await asyncio.to_thread(g.storage.get_dir, path)
    return FileResponse(local / file, media_type="application/octet-stream", filename=file)


# --------------------------------------------------------------- archive (older SDKs)

ARCHIVE = "*archive*"  # the "file" an archive URL is signed for


async def archive_url(request: Request, path: TinkerPath, manifest: CheckpointManifest) -> dict:
    """``CheckpointArchiveUrlResponse`` ``{url, expires}`` (older SDKs'
    ``RestClient.get_checkpoint_archive_url``): a signed gateway URL of a ``.tar`` holding the
    checkpoint's files at its root. Answered as 200 JSON, which those SDKs accept besides a 302."""
    expires_unix = int(time.time()) + url_ttl_s(request)
    key = await _secret(request)
    url = (f"{_public_base(request)}/download-archive/{quote(path.run_id, safe=':')}/{path.kind}/"
           f"{quote(path.name, safe=':')}.tar?expires={expires_unix}&sig={signature(key, path, ARCHIVE, expires_unix)}")
    expires = datetime.fromtimestamp(expires_unix, tz=timezone.utc)
    return {"url": url, "expires": expires.isoformat().replace("+00:00", "Z")}


@router.get("/download-archive/{run_id}/{kind}/{name}.tar")
async def download_archive(run_id: str, kind: str, name: str, request: Request, expires: int = 0, sig: str = ""):
    """A ``.tar`` of one checkpoint's files for the holder of a signed archive URL (403 / 404
    as :func:`download`)."""
    import shutil
    import tarfile
    import tempfile

    from starlette.background import BackgroundTask

    try:
        path = TinkerPath.parse(f"tinker://{run_id}/{kind}/{name}", field="path")
    except UserError as exc:
        return JSONResponse(status_code=404, content={"detail": exc.message, "category": "user", "field": "path"})
    if not sig or expires < time.time():
        return _forbidden("archive URL expired or unsigned; ask for a new one", "sig" if not sig else "expires")
    if not hmac.compare_digest(signature(await _secret(request), path, ARCHIVE, expires), sig):
        return _forbidden("bad archive URL signature")
    g = get_gateway(request)
    m = await g.manifest(path)
    exp = m.expires_unix if m is not None else None
    if m is None or (exp and exp <= time.time()):
        return JSONResponse(status_code=404, content={"detail": f"no checkpoint {path}", "category": "user",
                                                      "field": "path"})
    local = await asyncio.to_thread(g.storage.get_dir, path)
    tmp = tempfile.mkdtemp(prefix="openrl-archive-")
    out = os.path.join(tmp, f"{name}.tar")

    def build():
        with tarfile.open(out, "w") as tar:
            for f in sorted(m.files or {}):
                tar.add(local / f, arcname=f)

    await asyncio.to_thread(build)
    return FileResponse(out, media_type="application/x-tar", filename=f"{name}.tar",
                        background=BackgroundTask(shutil.rmtree, tmp, True))
