"""CloudEvents for the Tinker operations, and their NATS encoding.

Every Tinker request the gateway accepts becomes one CloudEvent (spec v1.0) of type
``dev.openrl.<op>.v1``; every answer a function gives is a CloudEvent of type
``dev.openrl.result.v1`` whose ``subject`` is the request's id (the future's id).

There is no official NATS protocol binding for CloudEvents, so events travel on NATS
in *binary content mode* exactly as the HTTP binding defines it: attributes as
``ce-*`` headers, ``datacontenttype`` as ``content-type``, the data as the message
body. The same header/body pair is what Knative Eventing POSTs to a function, so one
encoder serves both transports (the ``cloudevents`` library's HTTP binding).
"""

from __future__ import annotations

import json
import traceback
from typing import Any, Awaitable, Callable

from cloudevents.core.base import BaseCloudEvent
from cloudevents.core.bindings import http as ce_http
from cloudevents.core.v1.event import CloudEvent

from openrl.errors import OpenRLError

from openrl.contract.ops import SAMPLE_OPS, TRAIN_OPS, Op  # noqa: F401 - re-exported: the op names
from openrl.contract.topology import SOURCE_GATEWAY  # noqa: F401 - re-exported

JSON = "application/json"
PROTOBUF = "application/x-protobuf"
RESULT_TYPE = "dev.openrl.result.v1"


def event_type(op: str) -> str:
    """The CloudEvent ``type`` of a request for Tinker operation ``op`` (e.g. ``dev.openrl.sample.v1``)."""
    return f"dev.openrl.{op}.v1"


def op_of(event: BaseCloudEvent) -> str:
    """The Tinker operation of a request event (inverse of :func:`event_type`); an
    :class:`~openrl.contract.ops.Op` when it is one of ours, else the type's op part as a str.

    Raises:
        ValueError: the type is not ``dev.openrl.<op>.v1``.
    """
    parts = event.get_type().split(".")
    if len(parts) != 4 or parts[:2] != ["dev", "openrl"] or parts[3] != "v1":
        raise ValueError(f"not an openrl request type: {event.get_type()!r}")
    try:
        return Op(parts[2])
    except ValueError:
        return parts[2]


def request_event(
    op: str,
    request_id: str,
    subject: str,
    data: dict | bytes,
    *,
    source: str = SOURCE_GATEWAY,
    extensions: dict[str, str] | None = None,
) -> CloudEvent:
    """Build the request event for one Tinker call.

    Args:
        op: Tinker operation, one of TRAIN_OPS or SAMPLE_OPS.
        request_id: the future's id; becomes the event ``id`` (so JetStream de-duplicates
            a retried publish of the same request).
        subject: training-run id or sampling-session id.
        data: a JSON-able dict, or protobuf bytes (forward_backward).
        extensions: extra CloudEvent attributes (lower-case alphanumeric names), e.g.
            ``traceparent`` or ``trainershard``.
    """
    attrs: dict[str, Any] = {
        "type": event_type(op),
        "source": source,
        "id": request_id,
        "subject": subject,
        "datacontenttype": PROTOBUF if isinstance(data, bytes) else JSON,
    }
    attrs.update(extensions or {})
    return CloudEvent(attrs, data)


def result_event(request: BaseCloudEvent, data: dict | bytes, *, source: str) -> CloudEvent:
    """The successful answer to ``request``: JSON dict or protobuf bytes (ForwardBackwardOutput, SampleResponse)."""
    return CloudEvent(
        {
            "type": RESULT_TYPE,
            "source": source,
            "subject": request.get_id(),
            "datacontenttype": PROTOBUF if isinstance(data, bytes) else JSON,
            "outcome": "ok",
            **_trace_context(),
        },
        data,
    )


def error_event(request: BaseCloudEvent, message: str, category: str, *, source: str) -> CloudEvent:
    """A failed future for ``request``: data ``{"error": message, "category": category}``."""
    return CloudEvent(
        {
            "type": RESULT_TYPE,
            "source": source,
            "subject": request.get_id(),
            "datacontenttype": JSON,
            "outcome": "error",
            **_trace_context(),
        },
        {"error": message, "category": category},
    )


def with_extensions(event: BaseCloudEvent, **extensions: str) -> CloudEvent:
    """A copy of ``event`` with extension attributes added (lower-case alphanumeric names)."""
    return CloudEvent({**event.get_attributes(), **extensions}, event.get_data())


def _trace_context() -> dict[str, str]:
    """``traceparent`` / ``tracestate`` of the current span (the worker's ``handle`` span when a
    function builds its result), so a result event carries its trace back; ``{}`` when tracing is off."""
    from openrl.observe import tracing

    return tracing.carrier()


Handler = Callable[[BaseCloudEvent], Awaitable[BaseCloudEvent | None]]


async def run_handler(handler: Handler, event: BaseCloudEvent, *, source: str) -> BaseCloudEvent | None:
    """Call a function's ``handle`` and turn exceptions into failed-future events.

    ``OpenRLError`` keeps its category ("user" for bad input); any other exception
    becomes category "server" with the exception text. Bindings call this, so a bad
    request never kills a worker.
    """
    try:
        return await handler(event)
    except OpenRLError as exc:
        return error_event(event, exc.message, exc.category, source=source)
    except Exception as exc:  # noqa: BLE001 - a worker must survive any request
        traceback.print_exc()
        return error_event(event, f"{type(exc).__name__}: {exc}", "server", source=source)


def to_headers_body(event: BaseCloudEvent) -> tuple[dict[str, str], bytes]:
    """Binary content mode: (``ce-*`` headers + ``content-type``, body bytes)."""
    msg = ce_http.to_binary_event(event)
    return dict(msg.headers), msg.body


def from_headers_body(headers: dict[str, str] | None, body: bytes) -> BaseCloudEvent:
    """Parse an event in binary mode (``ce-*`` headers) or structured mode (JSON envelope).

    Raises:
        cloudevents.core.exceptions.BaseCloudEventException / ValueError: not a CloudEvent.
    """
    headers = {k.lower(): v for k, v in (headers or {}).items()}
    return ce_http.from_http_event(ce_http.HTTPMessage(headers=headers, body=body))


def data_bytes(event: BaseCloudEvent) -> bytes:
    """The event's data as bytes (JSON dicts are serialised)."""
    data = event.get_data()
    if data is None:
        return b""
    if isinstance(data, bytes):
        return data
    if isinstance(data, str):
        return data.encode()
    return json.dumps(data).encode()


def data_json(event: BaseCloudEvent) -> dict:
    """The event's JSON data as a dict (bytes/str bodies are parsed)."""
    data = event.get_data()
    if isinstance(data, dict):
        return data
    if data in (None, b"", ""):
        return {}
    return json.loads(data)
