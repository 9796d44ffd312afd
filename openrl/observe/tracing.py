"""OpenTelemetry traces: gateway → NATS → worker → results bucket, one trace per request.

The gateway opens a ``publish <op>`` span (kind PRODUCER) for every request it publishes;
its context travels in the request CloudEvent's ``traceparent`` / ``tracestate``
extensions (the CloudEvents distributed-tracing extension), so it crosses NATS JetStream
and Knative Eventing unchanged. The worker's ``handle <op>`` span (kind CONSUMER) is
its child, and the result event carries the worker's context back; the gateway ends the
``publish`` span when the result lands, so its duration is the future's latency.

The gateway's HTTP server spans come from FastAPI's built-in OpenTelemetry support, which
uses the tracer provider installed here.

Exporting is off unless configured (then every call here is a cheap no-op):

- ``OTEL_EXPORTER_OTLP_ENDPOINT`` / ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``: OTLP over
  HTTP/protobuf (``opentelemetry-exporter-otlp-proto-http``), batched; the standard
  ``OTEL_*`` variables (headers, ``OTEL_SERVICE_NAME``, ``OTEL_RESOURCE_ATTRIBUTES``) apply;
- ``OPENRL_TRACE_FILE=PATH``: every finished span appended to ``PATH`` as one JSON line
  (for tests and debugging; several processes may share the file);
- ``setup(service, exporter=...)`` in-process (tests: an ``InMemorySpanExporter``).

Without the ``opentelemetry-sdk`` package installed everything stays off.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
from typing import Iterator

from openrl.config import Settings

log = logging.getLogger("openrl.observe.tracing")

try:  # the API is light; the SDK and exporters are only needed when tracing is on
    from opentelemetry import trace
    from opentelemetry.trace import SpanKind, Status, StatusCode
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    _PROPAGATOR = TraceContextTextMapPropagator()
except ImportError:  # pragma: no cover - opentelemetry-api missing
    trace = None  # type: ignore[assignment]

_lock = threading.Lock()
_provider = None  # the SDK TracerProvider this module installed
_enabled = False

KINDS = {"internal": "INTERNAL", "server": "SERVER", "client": "CLIENT", "producer": "PRODUCER",
         "consumer": "CONSUMER"}


def enabled() -> bool:
    """True once :func:`setup` installed an exporter in this process."""
    return _enabled


def setup(service: str, *, exporter=None) -> bool:
    """Install a tracer provider for this process if tracing is configured.

    Args:
        service: ``service.name`` of the spans (``OTEL_SERVICE_NAME`` wins), e.g.
            ``openrl-gateway``, ``openrl-trainer``.
        exporter: an extra ``SpanExporter`` fed synchronously (tests); may be given in a
            second call to add it to an already installed provider.

    Returns:
        True if spans are now exported somewhere, False if tracing stays off.
    """
    global _provider, _enabled
    otlp = os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
    trace_file = Settings().trace_file
    if trace is None or not (otlp or trace_file or exporter is not None):
        return _enabled
    try:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
    except ImportError:
        log.warning("tracing is configured but opentelemetry-sdk is not installed; traces are off")
        return False
    with _lock:
        first = _provider is None
        if first:
            name = os.environ.get("OTEL_SERVICE_NAME") or service
            _provider = TracerProvider(resource=Resource.create({"service.name": name}))
        if exporter is not None:
            _provider.add_span_processor(SimpleSpanProcessor(exporter))
        if first:
            if trace_file:
                _provider.add_span_processor(SimpleSpanProcessor(JsonLinesExporter(trace_file)))
            if otlp:
                try:
                    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

                    _provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
                except ImportError:
                    log.warning("OTEL_EXPORTER_OTLP_ENDPOINT is set but opentelemetry-exporter-otlp-proto-http "
                                "is not installed; OTLP export is off")
            trace.set_tracer_provider(_provider)
        _enabled = True
    return True


def shutdown() -> None:
    """Flush and stop the exporters (at process exit; a batched OTLP exporter loses spans otherwise)."""
    if _provider is not None:
        try:
            _provider.shutdown()
        except Exception:  # noqa: BLE001
            pass


def tracer():
    """The ``openrl`` tracer (a no-op tracer while tracing is off)."""
    return trace.get_tracer("openrl")


@contextlib.contextmanager
def span(name: str, *, kind: str = "internal", attributes: dict | None = None, parent: dict | None = None,
         ) -> Iterator[object]:
    """A span around a block, current inside it; a no-op while tracing is off.

    Args:
        name: span name.
        kind: internal | server | client | producer | consumer.
        attributes: span attributes (str / int / float / bool values).
        parent: a W3C carrier (``{"traceparent": ..., "tracestate": ...}``) to continue
            instead of the current context (e.g. from a CloudEvent).

    An exception escaping the block is recorded and marks the span as an error.
    """
    if not _enabled:
        yield None
        return
    ctx = _PROPAGATOR.extract(parent) if parent else None
    with tracer().start_as_current_span(name, context=ctx, kind=getattr(SpanKind, KINDS[kind]),
                                        attributes=_clean(attributes)) as s:
        yield s


def start_span(name: str, *, kind: str = "internal", attributes: dict | None = None):
    """Start a span that outlives the current block (child of the current context); end it
    with ``span.end()`` (see :class:`openrl.observe.metrics.FutureTracker`). None while tracing is off."""
    if not _enabled:
        return None
    return tracer().start_span(name, kind=getattr(SpanKind, KINDS[kind]), attributes=_clean(attributes))


def carrier(of_span=None) -> dict[str, str]:
    """The W3C trace context of ``of_span`` (default: the current span) as CloudEvent
    extensions ``{"traceparent": ..., "tracestate": ...}``; ``{}`` when there is none."""
    if not _enabled:
        return {}
    ctx = trace.set_span_in_context(of_span) if of_span is not None else None
    out: dict[str, str] = {}
    _PROPAGATOR.inject(out, context=ctx)
    return {k: v for k, v in out.items() if k in ("traceparent", "tracestate") and v}


def event_carrier(event) -> dict[str, str]:
    """The ``traceparent`` / ``tracestate`` extensions of a CloudEvent (``{}`` when absent)."""
    out = {}
    for k in ("traceparent", "tracestate"):
        try:
            v = event.get_extension(k)
        except Exception:  # noqa: BLE001
            v = None
        if v:
            out[k] = str(v)
    return out


def mark_error(s, message: str) -> None:
    """Set an error status on span ``s`` (None is ignored)."""
    if s is not None:
        s.set_status(Status(StatusCode.ERROR, message[:200]))


def current_ids() -> tuple[str, str] | None:
    """(trace id, span id) in hex of the current span, or None (used by the JSON log formatter)."""
    if not _enabled:
        return None
    sc = trace.get_current_span().get_span_context()
    if not sc.is_valid:
        return None
    return f"{sc.trace_id:032x}", f"{sc.span_id:016x}"


def _clean(attributes: dict | None) -> dict | None:
    if not attributes:
        return None
    return {k: v for k, v in attributes.items() if isinstance(v, (str, bool, int, float))}


class JsonLinesExporter:
    """A SpanExporter appending one JSON object per finished span to a file.

    Fields: ``name``, ``service``, ``trace_id`` / ``span_id`` / ``parent_span_id`` (hex),
    ``kind``, ``start_ns`` / ``end_ns`` (epoch ns), ``status``, ``attributes``. Each line is
    one ``write`` on an ``O_APPEND`` descriptor, so several processes can share the file.
    """

    def __init__(self, path: str):
        self.path = path
        self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def export(self, spans) -> object:
        from opentelemetry.sdk.trace.export import SpanExportResult

        for s in spans:
            ctx, parent = s.get_span_context(), s.parent
            rec = {
                "name": s.name,
                "service": s.resource.attributes.get("service.name"),
                "trace_id": f"{ctx.trace_id:032x}",
                "span_id": f"{ctx.span_id:016x}",
                "parent_span_id": f"{parent.span_id:016x}" if parent is not None else None,
                "kind": s.kind.name,
                "start_ns": s.start_time,
                "end_ns": s.end_time,
                "status": s.status.status_code.name,
                "attributes": dict(s.attributes or {}),
            }
            os.write(self._fd, (json.dumps(rec, default=str) + "\n").encode())
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        try:
            os.close(self._fd)
        except OSError:
            pass

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True
