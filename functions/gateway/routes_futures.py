"""The future protocol: ``retrieve_future`` long-polls the results bucket.

A result stays in ``OPENRL_FUTURES`` after it is read (the SDK may poll again on a
retry). Content negotiation: the protobuf results (ForwardBackwardOutput, SampleResponse) are
answered as the worker stored them, ``Content-Type: application/x-protobuf``, when the request's
``Accept`` names ``application/x-protobuf`` (the SDK sends that header exactly for those two
result types, 0.25 to 0.38); to any other ``Accept`` (``application/json``, ``*/*``, none) they
are answered as JSON with the SDK's field names (:mod:`openrl.edge.proto.tojson`). Everything
else is JSON, failures ``{"error", "category"}``.
"""

from __future__ import annotations

import json

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from functions.gateway.deps import API_PREFIX, CallerDep, GatewayDep, WireRoute
from openrl.edge import wire
from openrl.edge.proto.tojson import result_json
from openrl.errors import NotFound

router = APIRouter(prefix=API_PREFIX, route_class=WireRoute)


@router.post("/retrieve_future", response_model=wire.TryAgainResponse)
async def retrieve_future(req: wire.RetrieveFutureRequest, g: GatewayDep, caller: CallerDep, request: Request):
    """Hold the poll up to ``long_poll_s``: ``try_again`` (the response model) while pending,
    else the stored result as sent by the worker (protobuf or JSON, or a failure body); a
    protobuf result goes out as JSON unless ``Accept`` asks for protobuf (see the module doc).

    Raises:
        NotFound: unknown future, or another key's.
    """
    who = caller.owner

    def check(rec) -> None:
        if rec is None or rec.info.owner != who:  # unknown, or another key's (or nobody's)
            raise NotFound("request_id", f"unknown future {req.request_id!r}")

    # one read of the bucket, after the waiter is registered; the result comes with the watcher
    rec = await g.waiter.wait(req.request_id, g.settings.long_poll_s, check=check)
    if rec is None or rec.state == "pending":
        return {"type": "try_again", "request_id": req.request_id, "queue_state": "active"}
    if "protobuf" in rec.content_type:
        if accepts_protobuf(request.headers.get("accept")):
            return Response(content=rec.body, media_type="application/x-protobuf")
        return JSONResponse(content=result_json(rec.op, rec.body, req.request_id))
    return JSONResponse(content=json.loads(rec.body or b"{}"))


def accepts_protobuf(accept: str | None) -> bool:
    """Whether an ``Accept`` header names ``application/x-protobuf`` (with a q-value above 0)."""
    for part in (accept or "").split(","):
        media, *params = (p.strip() for p in part.split(";"))
        if media.lower() == "application/x-protobuf":
            q = next((p[2:] for p in params if p.lower().startswith("q=")), "1")
            try:
                return float(q) > 0
            except ValueError:
                return True
    return False
