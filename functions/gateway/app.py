"""The gateway's FastAPI application: error mapping, lifecycle, and the route modules.

Routes follow the Tinker wire protocol (docs: ../shared/reference/tinker-wire-protocol.md)
under ``/api/v1``; ``/events/result`` receives result CloudEvents pushed by Knative
Eventing (the JetStream binding writes results to the KV bucket directly).
"""

from __future__ import annotations

import json
from contextlib import asynccontextmanager
from pathlib import Path

import pydantic
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from functions.gateway.context import BodyTooLarge, Gateway, GatewaySettings
from openrl.edge.proto import HEAD_BYTES
from openrl.transport.bus import Bus, FutureWaiter
from openrl.errors import OpenRLError, UserError
from openrl.model.registry import ModelRegistry
from openrl.storage import ExpirySweeper, open_storage


def error_response(exc: OpenRLError) -> JSONResponse:
    """A 4xx/5xx JSON body naming the field; never empty (the SDK treats an empty 400 as a proxy error).

    An error with a ``retry_after`` attribute (seconds; the 429 of :class:`openrl.errors.Overloaded`)
    also gets a ``Retry-After`` header, which the SDK honours.
    """
    body = {"detail": exc.message, "category": exc.category}
    if getattr(exc, "field", None):
        body["field"] = exc.field
    headers = None
    if getattr(exc, "retry_after", None) is not None:
        headers = {"Retry-After": str(max(1, int(round(exc.retry_after))))}
    return JSONResponse(status_code=exc.status, content=body, headers=headers)


OPEN_PATHS = frozenset({"/api/v1/healthz"})
# Training routes whose oversize body still names a seq_id the trainer must skip: the route
# gets the body's first HEAD_BYTES (request.state.oversize = the declared length).
HEAD_PATHS = frozenset({"/api/v1/forward_backward", "/api/v1/forward"})


def _head_only(receive, n: int):
    """An ASGI ``receive`` that returns the body's first ``n`` bytes (or fewer) as a whole body."""
    done = False

    async def head_receive():
        nonlocal done
        if done:
            return {"type": "http.disconnect"}
        buf = bytearray()
        while len(buf) < n:
            message = await receive()
            if message.get("type") != "http.request":
                return message
            buf += message.get("body", b"")
            if not message.get("more_body", False):
                break
        done = True
        return {"type": "http.request", "body": bytes(buf[:n]), "more_body": False}

    return head_receive


class EdgeMiddleware:
    """Pure ASGI middleware in front of every route: API keys and the body-size cap.

    * ``/api/v1/*`` except :data:`OPEN_PATHS`: the ``X-API-Key`` header must hold a configured
      key (:class:`openrl.edge.auth.KeyRing`); otherwise 401 with a JSON body naming the header. The
      :class:`openrl.edge.auth.Caller` is put in ``request.state.caller`` for the routes.
    * ``/events/*``: the internal token, when one is configured (``X-OpenRL-Internal-Token``
      header or ``?token=``).
    * Bodies: a ``Content-Length`` over ``max_body_bytes`` is answered 413 before anything is
      read (for :data:`HEAD_PATHS` the route answers it, after reading ``HEAD_BYTES`` to skip
      the seq_id); a chunked body raises :class:`BodyTooLarge` (413) once it passes the limit.
    """

    def __init__(self, app, keys, max_body_bytes: int):
        self.app, self.keys, self.max_body_bytes = app, keys, max_body_bytes

    @staticmethod
    def _header(scope, name: bytes) -> str | None:
        for k, v in scope.get("headers") or ():
            if k.lower() == name:
                return v.decode("latin-1")
        return None

    async def _reject(self, scope, receive, send, status: int, detail: str, field: str) -> None:
        resp = JSONResponse(status_code=status, content={"detail": detail, "category": "user", "field": field})
        await resp(scope, receive, send)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        from openrl.edge.auth import HEADER, INTERNAL_HEADER, AuthError

        path = scope.get("path", "")
        try:
            if path.startswith("/api/v1/") and path not in OPEN_PATHS:
                scope.setdefault("state", {})["caller"] = self.keys.check(self._header(scope, b"x-api-key"))
            elif path.startswith("/events/") and self.keys.has_internal_token:
                token = self._header(scope, INTERNAL_HEADER.lower().encode())
                if token is None:
                    from urllib.parse import parse_qs

                    token = (parse_qs(scope.get("query_string", b"").decode("latin-1")).get("token") or [None])[0]
                self.keys.check_internal(token)
        except AuthError as exc:
            field = HEADER if path.startswith("/api/v1/") else INTERNAL_HEADER
            return await self._reject(scope, receive, send, exc.status, exc.message, field)
        limit = self.max_body_bytes
        length = self._header(scope, b"content-length")
        if length is not None and length.isdigit() and int(length) > limit:
            if path in HEAD_PATHS:  # the route reads the head, skips the seq_id, then answers 413
                scope.setdefault("state", {})["oversize"] = int(length)
                return await self.app(scope, _head_only(receive, HEAD_BYTES), send)
            return await self._reject(scope, receive, send, 413,
                                      f"body: request body of {length} bytes exceeds the limit of {limit} bytes", "body")
        seen = 0

        async def capped_receive():
            nonlocal seen
            message = await receive()
            if message.get("type") == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit:
                    raise BodyTooLarge("body", f"request body exceeds the limit of {limit} bytes")
            return message

        return await self.app(scope, capped_receive, send)


def create_app(
    *,
    nats_url: str | None = None,
    storage_url: str,
    registry: ModelRegistry,
    settings: GatewaySettings | None = None,
    keys=None,
) -> FastAPI:
    """Build the gateway app. The bus connects in the app's lifespan.

    Args:
        nats_url: NATS server URL (default ``$OPENRL_NATS_URL``).
        storage_url: ``file:///dir`` or ``gs://bucket/prefix`` (read for REST listings).
        registry: base-model registry.
        keys: the accepted API keys (:class:`openrl.edge.auth.KeyRing`); default
            :func:`openrl.edge.auth.load_keys` from the environment.

    Raises:
        openrl.edge.auth.AuthConfigError: no keys configured (see :mod:`openrl.edge.auth`).
    """
    from openrl.edge.auth import load_keys

    keys = keys if keys is not None else load_keys()
    gw = Gateway(bus=Bus(nats_url), registry=registry, storage=open_storage(storage_url), settings=settings or GatewaySettings())
    gw.keys = keys

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await gw.bus.connect()
        gw.waiter = FutureWaiter(gw.bus)
        from openrl.observe import metrics

        gw.waiter.listeners.append(metrics.FUTURES.on_update)  # submit → result latency, trace spans
        await gw.waiter.start()
        sweeper = ExpirySweeper(gw.storage)  # deletes checkpoints whose TTL passed ($OPENRL_SWEEP_INTERVAL_S)
        sweeper.start()
        yield
        await sweeper.stop()
        await gw.waiter.stop()
        await gw.bus.close()

    app = FastAPI(title="openrl gateway", lifespan=lifespan)
    app.state.gw = gw

    @app.exception_handler(OpenRLError)
    async def _openrl_error(request: Request, exc: OpenRLError):
        return error_response(exc)

    @app.exception_handler(pydantic.ValidationError)
    async def _validation_error(request: Request, exc: pydantic.ValidationError):
        from openrl.edge.wire import validation_error_to_user_error

        return error_response(validation_error_to_user_error(exc))

    @app.exception_handler(json.JSONDecodeError)
    async def _json_error(request: Request, exc: json.JSONDecodeError):
        return error_response(UserError("body", f"malformed JSON: {exc}"))

    from functions.gateway import (
        routes_copy, routes_download, routes_events, routes_futures, routes_rest, routes_sampling, routes_session,
        routes_trace, routes_training,
    )

    for mod in (routes_session, routes_training, routes_sampling, routes_futures, routes_rest, routes_copy,
                routes_trace, routes_events, routes_download):
        app.include_router(mod.router)
    app.add_middleware(EdgeMiddleware, keys=keys, max_body_bytes=gw.settings.max_body_bytes)
    from functions.gateway import routes_status

    routes_status.install(app)  # GET /metrics, GET /api/v1/status, request metrics + traces (outermost)
    return app


def app_from_env() -> FastAPI:
    """The app as deployed: settings from OPENRL_* environment variables."""
    import os

    models_dir = Path(os.environ.get("OPENRL_HOME", str(Path.home() / ".openrl"))) / "models"
    reg_path = os.environ.get("OPENRL_MODEL_REGISTRY")
    registry = ModelRegistry.load(Path(reg_path) if reg_path else None, models_dir=models_dir)
    return create_app(storage_url=os.environ.get("OPENRL_STORAGE", "file:///tmp/openrl-storage"), registry=registry)
