"""Thin transports around a Function (see docs/internals.md): JetStream pull consumer and HTTP receiver."""

import importlib
import logging
import time

log = logging.getLogger("openrl.transport.bindings")


def load_function(module: str):
    """Import ``module`` (e.g. ``functions.trainer``) and return its ``new()`` Function instance."""
    return importlib.import_module(module).new()


async def handle_event(function, event, *, source: str, deliver=None):
    """Run ``function.handle(event)`` the way every binding does: failures become failed-future
    events (:func:`openrl.contract.events.run_handler`), inside a ``handle <op>`` trace span continuing
    the event's ``traceparent``, with the request's ids on every log record, and counted in
    the worker metrics.

    Args:
        function: the Function (``async handle(event)``).
        event: the request CloudEvent.
        source: CloudEvent ``source`` of result events, e.g. ``/openrl/trainer``.
        deliver: optional ``async (result_event) -> None`` run inside the span (the JetStream
            binding stores the result there).

    Returns:
        The result event, or None when the function answers nothing.

    Raises:
        whatever ``deliver`` raises (the handler's own exceptions are turned into results).
    """
    from openrl.contract import events
    from openrl.observe import logs
    from openrl.observe import metrics
    from openrl.observe import tracing

    name = source.rstrip("/").rsplit("/", 1)[-1]
    fields = logs.request_fields(event)
    op = fields["op"]
    attrs = {"cloudevents.event_id": event.get_id(), "cloudevents.event_type": event.get_type(),
             "cloudevents.event_subject": event.get_subject() or "", "cloudevents.event_source": event.get_source(),
             "messaging.system": "nats", "openrl.function": name}
    with logs.context(**fields), tracing.span(f"handle {op}", kind="consumer", attributes=attrs,
                                              parent=tracing.event_carrier(event)) as span:
        metrics.WORKER_IN_FLIGHT.labels(name).inc()
        started = time.time()
        t0 = time.perf_counter()
        try:
            result = await events.run_handler(function.handle, event, source=source)
        finally:
            metrics.WORKER_IN_FLIGHT.labels(name).dec()
        dt = time.perf_counter() - t0
        if result is not None:  # when the worker took the request up (unix s): the trace export's queue/run split
            result = events.with_extensions(result, handlestart=f"{started:.6f}")
        outcome = "none" if result is None else (result.get_extension("outcome") or "ok")
        metrics.WORKER_REQUESTS.labels(name, op, outcome).inc()
        metrics.WORKER_REQUEST_SECONDS.labels(name, op).observe(dt)
        if span is not None:
            span.set_attribute("openrl.outcome", outcome)
            if outcome == "error":
                err = events.data_json(result)
                tracing.mark_error(span, f"{err.get('category')}: {err.get('error')}")
        if outcome == "error":
            err = events.data_json(result)
            log.warning("request failed", extra={"outcome": outcome, "category": err.get("category"),
                                                 "error": str(err.get("error"))[:500],
                                                 "duration_ms": round(dt * 1000, 3)})
        else:
            log.info("handled", extra={"outcome": outcome, "duration_ms": round(dt * 1000, 3)})
        if deliver is not None and result is not None:
            await deliver(result)
    return result
