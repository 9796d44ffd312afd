"""Session timelines: ``RestClient.export_session_trace``.

``GET /api/v1/sessions/{id}/trace_export`` answers ``{"status": "ready", "url": ...}`` at once
(the SDK polls until ``ready``): a signed, expiring URL (HMAC like the checkpoint download
URLs of :mod:`functions.gateway.routes_download`; no API key needed) of
``/download-trace/{id}.json``, which builds the trace when it is fetched, so it is always up
to date and nothing is stored.

The file is a Chrome trace-event JSON document (``{"traceEvents": [...]}``), which
https://ui.perfetto.dev opens like a ``.pftrace``. One process per training run and per
sampling session of the session; one slice per request from the futures bucket, named by
its operation: ``queued`` from when the gateway accepted it (``t0``) until a worker took it
up (``ts``), then the operation until its answer landed (``t1``); a pending request ends at
the export time. Overlapping requests (a sampling session's concurrent samples, pipelined
training calls waiting in the queue) go to separate thread lanes. Timestamps are unix
microseconds; ``args`` carry the request id, seq_id and outcome (and the error category).
"""

from __future__ import annotations

import hmac
import json
import time

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from functions.gateway.deps import API_PREFIX, CallerDep, GatewayDep
from functions.gateway.routes_download import _forbidden, _public_base, _secret, sign, url_ttl_s
from openrl.transport.bus import FUTURES_BUCKET, Bus, FutureRecord, kv_key_decode
from openrl.errors import NotFound

router = APIRouter(prefix=API_PREFIX)  # behind the API key
public = APIRouter()  # the signed URL carries no key


@router.get("/sessions/{session_id}/trace_export")
async def export_session_trace(session_id: str, request: Request, g: GatewayDep, caller: CallerDep) -> dict:
    """The signed URL of the session's trace (404 for an unknown or another key's session)."""
    await g.session(session_id, caller.owner)
    expires = int(time.time()) + url_ttl_s(request)
    sig = sign(await _secret(request), f"trace/{session_id}", expires)
    url = f"{_public_base(request)}/download-trace/{session_id}.json?expires={expires}&sig={sig}"
    return {"status": "ready", "url": url}


@public.get("/download-trace/{session_id}.json")
async def download_trace(session_id: str, request: Request, g: GatewayDep, expires: int = 0, sig: str = ""):
    """The trace document; 403 for a bad or expired signature."""
    good = sign(await _secret(request), f"trace/{session_id}", expires)
    if not hmac.compare_digest(good, sig) or expires < time.time():
        return _forbidden("bad or expired trace URL: ask export_session_trace for a new one")
    bus = g.bus
    rec = await g.session_record(session_id)
    if rec is None:
        raise NotFound("session_id", f"unknown session {session_id!r}")
    futures = await session_futures(bus, session_id)
    return JSONResponse({"traceEvents": trace_events(futures, now=time.time()), "displayTimeUnit": "ms",
                         "otherData": {"session_id": session_id, "project_id": rec.project_id or "default"}})


async def session_futures(bus: Bus, session_id: str) -> list[tuple[str, FutureRecord]]:
    """Every future of the session still in ``OPENRL_FUTURES`` (its TTL bounds how far back).

    Request ids start with ``<session_id>:`` (runs are ``<session>:train:<n>``, sampling
    sessions ``<session>:sample:<n>``). Reads every key of the bucket: an export, not a hot path.
    """
    out = []
    for key in await bus.kv_keys(FUTURES_BUCKET):
        try:
            (rid,) = kv_key_decode(key)
        except Exception:  # noqa: BLE001 - not one of ours
            continue
        if rid.startswith(session_id + ":"):
            rec = await bus.future_get(rid)
            if rec is not None:
                out.append((rid, rec))
    return out


def _track(request_id: str) -> tuple[str, str]:
    """(track id, seq_id part): ``s:train:0:7`` → (``s:train:0``, ``7``); suffixes like
    ``:skip`` / ``:unload`` stay in the seq part."""
    parts = request_id.split(":")
    return ":".join(parts[:3]), ":".join(parts[3:])


def trace_events(futures: list[tuple[str, FutureRecord]], *, now: float) -> list[dict]:
    """Chrome trace events (``ph`` ``M`` names, ``X`` complete slices; ``ts``/``dur`` in µs).

    Args:
        futures: (request id, record) pairs; records without ``meta.t0`` (stored before
            timings were kept) are left out.
        now: unix seconds; the end of a pending request's slice.
    """
    tracks: dict[str, list[tuple[float, float, float | None, str, FutureRecord]]] = {}
    for rid, rec in futures:
        meta = rec.info
        if meta.t0 is None:
            continue
        t0 = float(meta.t0)
        t1 = float(meta.t1 or now) if rec.state != "pending" else now
        ts = meta.ts
        track, _ = _track(rid)
        tracks.setdefault(track, []).append((t0, max(t1, t0), float(ts) if ts else None, rid, rec))
    out: list[dict] = []
    for pid, (track, reqs) in enumerate(sorted(tracks.items()), start=1):
        kind = "training run" if ":train:" in track else "sampling session" if ":sample:" in track else "requests"
        out.append({"ph": "M", "name": "process_name", "pid": pid, "args": {"name": f"{kind} {track}"}})
        lanes: list[float] = []  # end time of each lane's last slice
        for t0, t1, ts, rid, rec in sorted(reqs, key=lambda r: (r[0], r[3])):
            lane = next((i for i, end in enumerate(lanes) if end <= t0), None)
            if lane is None:
                lanes.append(t1)
                lane = len(lanes) - 1
            else:
                lanes[lane] = t1
            args = {"request_id": rid, "seq_id": _track(rid)[1], "state": rec.state}
            if rec.state == "error":
                try:
                    args["category"] = json.loads(rec.body).get("category")
                except Exception:  # noqa: BLE001
                    pass
            op = rec.op or "request"
            start = t0
            if ts is not None and t0 <= ts <= t1:
                out.append({"ph": "X", "name": "queued", "cat": "queue", "pid": pid, "tid": lane + 1,
                            "ts": round(t0 * 1e6), "dur": round((ts - t0) * 1e6), "args": args})
                start = ts
            out.append({"ph": "X", "name": op, "cat": "run" if rec.state != "pending" else "pending", "pid": pid,
                        "tid": lane + 1, "ts": round(start * 1e6), "dur": round((t1 - start) * 1e6), "args": args})
    return out
