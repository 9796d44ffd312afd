"""The future protocol: ``retrieve_future`` long-polls the results bucket.

A result stays in ``OPENRL_FUTURES`` after it is read (the SDK may poll again on a
retry); protobuf results (ForwardBackwardOutput, SampleResponse) are answered with
``Content-Type: application/x-protobuf``, everything else as JSON, failures as
``{"error", "category"}``.
"""

from __future__ import annotations

import json

from fastapi import APIRouter
from fastapi.responses import JSONResponse, Response

from functions.gateway.deps import API_PREFIX, CallerDep, GatewayDep, WireRoute
from openrl.edge import wire
from openrl.errors import NotFound

router = APIRouter(prefix=API_PREFIX, route_class=WireRoute)


@router.post("/retrieve_future", response_model=wire.TryAgainResponse)
async def retrieve_future(req: wire.RetrieveFutureRequest, g: GatewayDep, caller: CallerDep):
    """Hold the poll up to ``long_poll_s``: ``try_again`` (the response model) while pending,
    else the stored result as sent by the worker (protobuf or JSON, or a failure body).

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
        return Response(content=rec.body, media_type="application/x-protobuf")
    return JSONResponse(content=json.loads(rec.body or b"{}"))
