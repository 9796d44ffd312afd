"""Where pushed result CloudEvents land (Knative Eventing, or the local dispatcher).

``POST /events/result`` stores a ``dev.openrl.result.v1`` event in the futures bucket
(the JetStream binding writes there directly instead). ``POST /events/dead-letter``
receives a request that could not be delivered after all retries and fails its future
with category "server", so the SDK's poll gets an answer instead of hanging.
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from functions.gateway.deps import gw
from openrl.contract import events, payloads
from openrl.contract.topology import SOURCE_GATEWAY
from openrl.transport.bindings.deadletter import dead_seq, fail_undelivered, gave_up_message
from openrl.transport.bindings.results import store_result

router = APIRouter(prefix="/events")


async def _event(request: Request):
    return events.from_headers_body(dict(request.headers), await request.body())


@router.post("/result")
async def result(request: Request):
    try:
        ev = await _event(request)
    except Exception as exc:  # noqa: BLE001
        return JSONResponse({"detail": f"not a CloudEvent: {exc}"}, status_code=400)
    if ev.get_type() != events.RESULT_TYPE:
        return JSONResponse({"detail": f"expected type {events.RESULT_TYPE}"}, status_code=400)
    await store_result(gw(request).bus, ev)
    return Response(status_code=202)


@router.post("/dead-letter")
async def dead_letter(request: Request):
    try:
        ev = await _event(request)
    except Exception as exc:  # noqa: BLE001
        return JSONResponse({"detail": f"not a CloudEvent: {exc}"}, status_code=400)
    if ev.get_type() == events.RESULT_TYPE:  # a result that could not reach /events/result
        await store_result(gw(request).bus, ev)
        return Response(status_code=202)
    # a worker that finished the request after all (its result landed first) keeps its answer
    g = gw(request)
    if await fail_undelivered(g.bus, ev, gave_up_message(ev, None), source=SOURCE_GATEWAY):
        seq = dead_seq(ev)
        if seq is not None:  # the run's later requests go on instead of waiting for the gap timeout
            model_id, seq_id, shard = seq
            await g.submit("skip", f"{model_id}:{seq_id}:skip", model_id,
                           payloads.Skip(model_id=model_id, seq_id=seq_id).to_data(),
                           model={"model_id": model_id, "shard": int(shard)})
    return Response(status_code=202)
