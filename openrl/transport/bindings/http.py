"""HTTP binding: a Function as a CloudEvent receiver, the way Knative Eventing pushes.

    python -m openrl.transport.bindings.http functions.trainer [--host 127.0.0.1] [--port 8080]

- ``POST /`` takes one request event in binary mode (``ce-*`` headers) or structured
  mode (``application/cloudevents+json``) and replies ``200`` with the result event in
  binary mode, which Knative Eventing sends back to the broker as the reply. A body that
  is not a CloudEvent gets ``400``.
- ``GET /metrics``: Prometheus metrics (:mod:`openrl.observe.metrics`), including
  ``openrl_function_info{function,device,dtype,backend}`` from the Function's
  ``describe()``, set after ``start()`` and refreshed at each scrape.
- ``GET /healthz/live`` and ``/healthz/ready`` are the liveness / readiness probes: the
  Function's ``alive()`` / ``ready()`` answer ``(ok, reason)`` (:mod:`openrl.contract.function`);
  the probe answers ``200`` (else ``503``) with the reason as plain text, as the Knative
  Functions template does (``ready`` is false until the Function's ``start()`` has loaded
  its model, and again once draining started).
- On SIGTERM uvicorn stops accepting, finishes requests in flight, then the lifespan
  calls the Function's ``stop()`` (drain and flush).
- A redelivered event joins its running handler. Knative's queue-proxy and activator answer
  ``504`` to a request that sent no response byte within the revision's
  ``responseStartTimeoutSeconds`` (this binding answers only when the handler is done), and
  the Trigger then delivers the same event again. The handler runs in a task of its own that
  the caller giving up does not cancel, and a delivery of the same event (CloudEvent
  ``source``, ``id`` and ``type``, same body) while it runs waits for that task instead of starting the
  work again, so a handler slower than the limit still answers once, on a retry
  (docs/knative-review.md, "Request limits"). The same id with another body runs on its own
  (the Function judges it: the trainer refuses a seq_id reused with other content).

The business handler is the same ``handle`` the JetStream binding calls.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import logging
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from openrl.config import Settings
from openrl.contract.function import probe

from openrl.contract import events, topology
from openrl.transport.bindings import handle_event, load_function

log = logging.getLogger("openrl.transport.bindings.http")


def create_app(function, cfg: "Settings | dict | None" = None, *, source: str = "/openrl/function") -> FastAPI:
    """Wrap ``function`` (the Function contract) in a FastAPI CloudEvent receiver.

    Args:
        function: the Function.
        cfg: its ``start()`` config (:class:`openrl.config.Settings`, or a dict of explicit
            values over the environment; None: the environment).
        source: CloudEvent ``source`` of result events; its last path segment names the
            function in metrics (``/openrl/trainer`` -> ``trainer``).
    """
    from openrl.observe import metrics
    from openrl.transport.worker import describe

    name = source.rstrip("/").rsplit("/", 1)[-1]

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await function.start(Settings.of(cfg))
        metrics.set_function_info(name, describe(function))
        yield
        await function.stop()

    app = FastAPI(lifespan=lifespan)
    running: dict[tuple[str, str, str, bytes], asyncio.Task] = {}  # (source, id, type, body digest) -> handler

    def _done(key, task: asyncio.Task) -> None:
        if running.get(key) is task:
            del running[key]
        if not task.cancelled() and task.exception() is not None:  # retrieved: every caller may be gone
            log.warning("handler of %s failed: %r", key[1], task.exception())

    @app.get("/healthz/live")
    async def live():
        ok, reason = probe(function.alive(), "alive")
        return PlainTextResponse(reason, status_code=200 if ok else 503)

    @app.get("/healthz/ready")
    async def ready():
        ok, reason = probe(function.ready(), "ready")
        return PlainTextResponse(reason, status_code=200 if ok else 503)

    @app.get("/metrics")
    async def metrics_route():
        """Prometheus metrics of this function (see :mod:`openrl.observe.metrics`)."""
        metrics.set_function_info(name, describe(function))  # backend / dtype change at the first model load
        body, ctype = metrics.exposition()
        return Response(content=body, media_type=ctype)

    @app.post("/")
    async def receive(request: Request):
        body = await request.body()
        try:
            event = events.from_headers_body(dict(request.headers), body)
        except Exception as exc:  # noqa: BLE001 - anything unparsable is the sender's fault
            return JSONResponse({"detail": f"not a CloudEvent: {exc}"}, status_code=400)
        key = (str(event.get_source()), str(event.get_id()), str(event.get_type()), hashlib.sha256(body).digest())
        task = running.get(key)
        if task is None:
            task = asyncio.create_task(handle_event(function, event, source=source))
            running[key] = task
            task.add_done_callback(lambda t, k=key: _done(k, t))
        else:
            log.info("event %s delivered again while its handler runs: waiting for that one", key[1])
        # shielded: a caller that gives up (a 504 from queue-proxy, a delivery timeout) leaves the
        # handler running for the retry that joins it
        result = await asyncio.shield(task)
        if result is None:
            return Response(status_code=202)
        headers, out = events.to_headers_body(result)
        return Response(content=out, headers=headers, status_code=200)

    return app


def main(argv: list[str] | None = None) -> None:
    """Command line: see the module doc."""
    import uvicorn

    ap = argparse.ArgumentParser(prog="python -m openrl.transport.bindings.http")
    ap.add_argument("module", help="function module, e.g. functions.trainer")
    ap.add_argument("--host", default=None, help="listen address (default $OPENRL_HOST or 0.0.0.0)")
    ap.add_argument("--port", type=int, default=None, help="port (default $PORT or 8080)")
    ap.add_argument("--config", default="{}",
                    help="JSON object of settings for the Function's start(), over the OPENRL_* environment "
                         "(field names of openrl.config.Settings)")
    args = ap.parse_args(argv)
    cfg = Settings.of(json.loads(args.config), host=args.host, port=args.port)  # the one settings object
    source = topology.source_of(topology.function_of_module(args.module))
    from openrl.observe import logs
    from openrl.observe import tracing

    logs.setup(args.module.split(".")[-1], level=cfg.log_level, fmt=cfg.log_format)
    tracing.setup(f"openrl-{args.module.split('.')[-1]}")
    app = create_app(load_function(args.module), cfg, source=source)
    try:
        uvicorn.run(app, host=cfg.host, port=cfg.port, log_level="warning", timeout_graceful_shutdown=60,
                    log_config=None)
    finally:
        tracing.shutdown()


if __name__ == "__main__":
    main()
