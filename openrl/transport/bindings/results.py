"""Storing result events: the futures bucket is where the SDK's poll finds them."""

from __future__ import annotations

import time

from openrl.contract import events

from openrl.observe import tracing
from openrl.contract.records import FutureRecord
from openrl.transport.bus import Bus


async def store_result(bus: Bus, result) -> None:
    """Write a result event into ``OPENRL_FUTURES`` under the request id (its subject).

    Traced as ``store result`` continuing the result event's ``traceparent`` (the worker's
    span), so a result pushed to the gateway's ``/events/result`` joins the request's trace.
    """
    with tracing.span("store result", kind="producer", parent=tracing.event_carrier(result),
                      attributes={"cloudevents.event_subject": result.get_subject() or "",
                                  "openrl.outcome": result.get_extension("outcome") or "ok"}):
        await _store_result(bus, result)


async def _store_result(bus: Bus, result) -> None:
    # keep the pending record's meta: its "owner" is what lets only the caller's key read the result
    old = await bus.future_get(result.get_subject())
    meta = dict(old.meta or {}) if old is not None else {}
    meta["t1"] = round(time.time(), 6)  # answered (unix s); "t0" accepted, "ts" taken up by the worker
    started = result.get_extension("handlestart")
    if started:
        meta["ts"] = float(started)
    rec = FutureRecord(
        state="ok" if result.get_extension("outcome") != "error" else "error",
        op=old.op if old is not None else "",
        content_type=result.get_datacontenttype() or events.JSON,
        body=events.data_bytes(result),
        meta=meta,
    )
    await bus.future_put(result.get_subject(), rec)
