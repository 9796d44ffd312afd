"""Skipping the seq_ids of training requests the gateway rejects (invariant 2).

The SDK numbers every training call of a run (``seq_id`` 1, 2, ...) and never resends a call
answered with a 4xx, while the trainer applies a run's requests strictly in seq_id order. So
when the gateway rejects a sequenced training request at the edge, it publishes a ``skip``
event for that seq_id (:class:`openrl.contract.payloads.Skip`); otherwise the run's later
requests would wait for the missing one until the gap timeout.

The rule lives here, in one place: :class:`SkipRejected` is the route class of the training
routes (:mod:`functions.gateway.routes_training`). When such a route answers with a
:class:`openrl.errors.UserError` (400 / 404 / 413, a body that failed validation included), the
request's ``(model_id, seq_id)`` is read back from the body as sent (JSON, or the first bytes
of a protobuf ``ForwardBackwardRequest``) and skipped, if the run is the caller's and the
seq_id is in ``[1, MAX_SEQ_ID]`` (an error whose ``skip`` attribute is False is not:
:class:`functions.gateway.numbering.NumberingError`). A request without ``seq_id`` has none to
skip; the number the gateway gave it, if any, is skipped by
:func:`functions.gateway.numbering.numbered`. A 429 (:class:`openrl.errors.Overloaded`) or a
5xx is not skipped: the SDK resends that seq_id. The dead-letter sink skips a dead request's seq_id with
:func:`publish_skip` too.
"""

from __future__ import annotations

import json
import re
from typing import Any, Callable

from fastapi import Request, Response
from fastapi.exceptions import RequestValidationError

from functions.gateway.context import Gateway
from functions.gateway.deps import WireRoute
from openrl.contract import payloads
from openrl.edge import proto
from openrl.errors import UserError

MAX_SEQ_ID = 2**31 - 1  # seq_id is an int32 on the SDK's protobuf wire


def request_id_for(model_id: str, seq_id: int) -> str:
    """The future id of a training request: ``<model_id>:<seq_id>`` (0 is the creation)."""
    return f"{model_id}:{seq_id}"


async def publish_skip(g: Gateway, model_id: str, shard: int, seq_id: int, owner: str | None = None) -> None:
    """Publish the ``skip`` of ``seq_id`` of run ``model_id`` (on trainer shard ``shard``; ``owner``:
    the run's owner id, when known); request id ``<model_id>:<seq_id>:skip``, so a repeat is a no-op."""
    await g.submit("skip", f"{request_id_for(model_id, seq_id)}:skip", model_id,
                   payloads.Skip(model_id=model_id, seq_id=seq_id).to_data(), shard=shard, owner=owner)


async def skip_owned(g: Gateway, owner: str, model_id: Any, seq_id: Any) -> bool:
    """Skip ``seq_id`` of run ``model_id`` if it is ``owner``'s run and ``seq_id`` an int in
    ``[1, MAX_SEQ_ID]``; best effort, never raises a lookup error. True when a skip was published."""
    if not isinstance(seq_id, int) or isinstance(seq_id, bool) or not 1 <= seq_id <= MAX_SEQ_ID:
        return False
    try:
        run = await g.model(str(model_id), owner)
    except Exception:  # noqa: BLE001 - not the caller's run (or none, or no answer): nothing to skip
        return False
    await publish_skip(g, run.model_id, run.shard, seq_id, run.owner)
    return True


async def sent_run_and_seq(request: Request) -> tuple[Any, Any]:
    """``(model_id, seq_id)`` as the client sent them, read back from the (cached) body: a
    protobuf ``ForwardBackwardRequest`` (only its head is needed; zstd as the request says) or
    a JSON object (for the head of an oversize JSON body, its ``"model_id"`` / ``"seq_id"`` keys).
    ``(None, None)`` when the body names neither."""
    body = await request.body()
    if "protobuf" in (request.headers.get("content-type") or ""):
        return proto.peek_run_and_seq(body[:proto.HEAD_BYTES], request.headers.get("content-encoding"))
    try:
        raw = json.loads(body)
        return raw.get("model_id"), int(raw["seq_id"])
    except Exception:  # noqa: BLE001 - not JSON, not an object, no usable seq_id
        pass
    # the head of an oversize JSON body (functions.gateway.app.HEAD_PATHS): its top-level keys
    head = body[:proto.HEAD_BYTES].decode("utf-8", "replace")
    m, s = re.search(r'"model_id"\s*:\s*"([^"\\]+)"', head), re.search(r'"seq_id"\s*:\s*(\d+)', head)
    return (m.group(1), int(s.group(1))) if m and s else (None, None)


class SkipRejected(WireRoute):
    """Route class of the sequenced training routes: a request rejected with a
    :class:`UserError` (or a body that failed validation) gets its seq_id skipped (see the
    module doc), then the error goes on to the app's handlers unchanged."""

    def get_route_handler(self) -> Callable[[Request], Any]:
        handler = super().get_route_handler()

        async def skip_rejected(request: Request) -> Response:
            try:
                return await handler(request)
            except (UserError, RequestValidationError) as exc:
                if not getattr(exc, "skip", True):  # e.g. numbering.NumberingError: not this request's number
                    raise
                model_id, seq_id = await sent_run_and_seq(request)
                caller = getattr(request.state, "caller", None)  # set by deps.authenticate
                if model_id is not None and caller is not None:
                    await skip_owned(request.app.state.gw, caller.owner, model_id, seq_id)
                raise

        return skip_rejected
