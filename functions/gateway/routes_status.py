"""What the service is doing: ``GET /metrics`` (Prometheus) and ``GET /api/v1/status``.

``/metrics`` is open (like ``healthz``: scrapers carry no API key; per-key series are
labelled by owner id, never by key). It reads the JetStream queue depths at scrape time.

``/api/v1/status`` (any valid API key) answers::

    {"gateway": {"time", "futures_in_flight"},
     "queues":  [{"stream", "messages", "bytes"}],
     "workers": [{"function", "shard", "stream", "consumer", "state", "num_pending",
                  "num_ack_pending", "num_waiting", "num_redelivered", "last_active", "idle_s",
                  "device", "dtype", "backend", "models_failed", "details", "sleep"}]}

A worker kind is a durable JetStream consumer (``trainer-<shard>``, ``sampler``); its
``state`` says whether someone is pulling (``polling``), requests run (``busy``), work
waits with nobody pulling (``backlog``: no live worker) or nothing happens (``idle``).
See :func:`openrl.observe.metrics.queue_status`. ``device`` / ``dtype`` / ``backend`` (e.g.
``cuda`` / ``bfloat16`` / ``vllm``; ``backend`` is ``pending`` until the first model load)
come from the newest live record a JetStream worker of that function and shard keeps in
the meta bucket (:class:`openrl.transport.worker.WorkerPresence`); None when no live worker wrote one.
``models_failed`` (``"Bad/Model: SafetensorError: ...; ..."``) names the base models that failed to
load there, whose requests fail with that error (:mod:`openrl.model.loadfailures`); None when none did.
``details`` (``{"kernels": ..., "unembed": ..., "routed": ...}``, see
:data:`openrl.transport.worker.DETAIL_KEYS`): what else the worker's ``describe()`` says; None when nothing.
``sleep`` (``{"state": "awake" | "falling asleep" | "asleep" | "waking", "since_unix", "sleeps", "wakes",
"last_wake_s", "error"}``, :mod:`openrl.transport.bindings.idle_sleep`): whether the worker has given its
GPU memory back while idle; None when it does not sleep (``OPENRL_SLEEP_AFTER`` 0).

:data:`public` holds ``/metrics``, :data:`router` ``/status`` (under ``/api/v1``, behind the
key); :func:`install` adds the request metrics / trace middleware to the app.
"""

from __future__ import annotations

import json
import logging
import time

from fastapi import APIRouter, FastAPI
from fastapi.responses import Response

from functions.gateway.deps import API_PREFIX, GatewayDep
from openrl.contract.records import WorkerRecord
from openrl.observe import metrics
from openrl.transport.bus import now_iso

router = APIRouter(prefix=API_PREFIX)  # behind the API key
public = APIRouter()
log = logging.getLogger("openrl.gateway.status")


@public.get("/metrics")
async def prometheus_metrics(g: GatewayDep) -> Response:
    """Prometheus text exposition; queue gauges are refreshed from JetStream first."""
    try:
        await metrics.refresh_queue_gauges(g.bus)
    except Exception:  # noqa: BLE001 - NATS down: still serve the process metrics
        pass
    try:
        from functions.gateway.routes_usage import refresh_gauges

        await refresh_gauges(g)  # openrl_key_usage{owner, measure}: per-key usage from the KV bucket
    except Exception:  # noqa: BLE001 - NATS or storage down: still serve the rest
        log.warning("per-key usage gauges not refreshed", exc_info=True)
    body, ctype = metrics.exposition()
    return Response(content=body, media_type=ctype)


async def build_status(bus) -> dict:
    """The answer of ``GET /api/v1/status`` (see the module doc for the shape), read from
    JetStream (consumers, streams) and the worker records of the meta bucket."""
    from openrl.transport.worker import function_of_consumer, worker_records

    streams = await metrics.refresh_queue_gauges(bus)
    try:
        records = {k: WorkerRecord.load(v) for k, v in (await worker_records(bus)).items()}
    except Exception:  # noqa: BLE001 - the records are extra information: never fail the status for them
        log.warning("could not read the worker records", exc_info=True)
        records = {}
    workers = []
    for s in streams:
        for c in s["consumers"]:
            fn, shard = function_of_consumer(c["consumer"])
            rec = records.get((fn, shard)) or WorkerRecord.model_construct()
            workers.append({"function": fn, "shard": shard, "stream": s["stream"], **c,
                            "device": rec.device, "dtype": rec.dtype, "backend": rec.backend,
                            "models_failed": rec.models_failed, "details": rec.details, "sleep": rec.sleep})
    return {
        "gateway": {"time": now_iso(), "futures_in_flight": len(metrics.FUTURES)},
        "queues": [{"stream": s["stream"], "messages": s["messages"], "bytes": s["bytes"]} for s in streams],
        "workers": workers,
    }


@router.get("/status")
async def status(g: GatewayDep) -> dict:
    """Workers (JetStream consumers, with what they run on) and queues; see the module doc."""
    return await build_status(g.bus)


access_log = logging.getLogger("openrl.gateway.access")
_ERROR_BODY_BYTES = 4096  # how much of a refusal's body the access log reads (the JSON of docs/errors.md)


def log_refusal(scope, route: str, status: int, body: bytes) -> None:
    """One access-log line for an answer >= 400, in the workers' JSON log format
    (:mod:`openrl.observe.logs`): ``msg`` "refused" (4xx, level info) or "failed" (5xx, level
    error) with ``http_status``, ``route`` (the route template, or ``unmatched``), ``key_id``
    (the caller's owner id, never the key; None before authentication), ``field``, ``category``
    and ``detail`` (cut at 300 characters) from the JSON body of docs/errors.md. The method and
    path are on every record of the request already (``http_method``, ``http_path``)."""
    caller = (scope.get("state") or {}).get("caller")
    try:
        err = json.loads(body.decode("utf-8")) if body else {}
    except (UnicodeDecodeError, ValueError):
        err = {}
    err = err if isinstance(err, dict) else {}
    detail = err.get("detail", err.get("error"))
    extra = {"http_status": status, "route": route, "key_id": getattr(caller, "owner", None),
             "field": err.get("field"), "category": err.get("category"),
             "detail": str(detail)[:300] if detail is not None else None}
    if status >= 500:
        access_log.error("failed", extra=extra)
    else:
        access_log.info("refused", extra=extra)


class ObserveMiddleware:
    """Pure ASGI middleware: per-request metrics (route template, or ``unmatched`` for no route
    and for a 401; method, status), the method / path on every log record of the request, and
    an access-log line for every answer >= 400 (:func:`log_refusal`). (The HTTP server trace span
    comes from FastAPI's built-in OpenTelemetry support, which uses the provider
    :mod:`openrl.observe.tracing` installs.)"""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        from openrl.observe import logs

        method = scope.get("method", "GET")
        status = {"code": 500}
        body = bytearray()

        async def send_wrapped(message):
            if message.get("type") == "http.response.start":
                status["code"] = message.get("status", 500)
            elif message.get("type") == "http.response.body" and status["code"] >= 400:
                body.extend(message.get("body", b"")[: _ERROR_BODY_BYTES - len(body)])
            await send(message)

        t0 = time.perf_counter()
        with logs.context(http_method=method, http_path=scope.get("path", "")):
            try:
                await self.app(scope, receive, send_wrapped)
            finally:
                # a request without a valid key (401) never reached its route: "unmatched", as one
                # that matched no route
                route = (getattr(scope.get("route"), "path", None) if status["code"] != 401 else None) or "unmatched"
                metrics.GATEWAY_REQUESTS.labels(route, method, str(status["code"])).inc()
                metrics.GATEWAY_REQUEST_SECONDS.labels(route, method).observe(time.perf_counter() - t0)
                if status["code"] >= 400:
                    log_refusal(scope, route, status["code"], bytes(body))


def install(app: FastAPI) -> None:
    """Add the observe middleware (outermost: call after the other middlewares)."""
    app.add_middleware(ObserveMiddleware)
