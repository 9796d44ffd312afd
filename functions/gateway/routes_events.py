"""Where pushed result CloudEvents land (Knative Eventing, or the local dispatcher).

Behind :func:`functions.gateway.deps.internal_token` (a router dependency set in
:func:`functions.gateway.app.create_app`).

``POST /events/result`` stores a ``dev.openrl.result.v1`` event in the futures bucket
(the JetStream binding writes there directly instead). ``POST /events/dead-letter``
receives a request that could not be delivered after all retries and fails its future
with category "server", so the SDK's poll gets an answer instead of hanging.
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response

from functions.gateway.deps import GatewayDep
from functions.gateway.errors import error_response
from functions.gateway.skips import publish_skip
from openrl.contract import events
from openrl.contract.topology import SOURCE_GATEWAY
from openrl.errors import UserError
from openrl.transport.bindings.deadletter import dead_seq, fail_undelivered, gave_up_message
from openrl.transport.bindings.results import store_result

router = APIRouter(prefix="/events")


async def _event(request: Request):
    return events.from_headers_body(dict(request.headers), await request.body())


@router.post("/result")
async def result(request: Request, g: GatewayDep):
    """Store a ``dev.openrl.result.v1`` event in the futures bucket (202); 400 for anything else."""
    try:
        ev = await _event(request)
    except Exception as exc:  # noqa: BLE001
        return error_response(UserError("body", f"not a CloudEvent: {exc}"))
    if ev.get_type() != events.RESULT_TYPE:
        return error_response(UserError("ce-type", f"expected type {events.RESULT_TYPE}"))
    await store_result(g.bus, ev)
    return Response(status_code=202)


@router.post("/dead-letter")
async def dead_letter(request: Request, g: GatewayDep):
    """Fail the future of a request that could not be delivered (and skip its seq_id); 202."""
    try:
        ev = await _event(request)
    except Exception as exc:  # noqa: BLE001
        return error_response(UserError("body", f"not a CloudEvent: {exc}"))
    if ev.get_type() == events.RESULT_TYPE:  # a result that could not reach /events/result
        await store_result(g.bus, ev)
        return Response(status_code=202)
    # a worker that finished the request after all (its result landed first) keeps its answer
    if await fail_undelivered(g.bus, ev, gave_up_message(ev, None), source=SOURCE_GATEWAY):
        seq = dead_seq(ev)
        if seq is not None:  # the run's later requests go on instead of waiting for the gap timeout
            model_id, seq_id, shard = seq
            await publish_skip(g, model_id, int(shard), seq_id)
    return Response(status_code=202)
