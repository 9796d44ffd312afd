"""The gateway's FastAPI application: the body-size cap, the routers, errors and lifecycle.

Routes follow the Tinker wire protocol (docs: ../shared/reference/tinker-wire-protocol.md)
under ``/api/v1``, every one of them but ``healthz`` behind the API key
(:func:`functions.gateway.deps.authenticate` as a router dependency; an unknown ``/api/v1``
path or method also answers 401 without a key, see :mod:`functions.gateway.errors`). The
OpenAI-compatible ``/v1`` routes (:mod:`functions.gateway.routes_openai`) take the same keys as a
bearer token. Open: ``healthz``,
``/metrics`` and the signed download URLs. ``/events/result`` receives result CloudEvents
pushed by Knative Eventing (the JetStream binding writes results to the KV bucket directly),
behind the internal token when one is configured.
"""

from __future__ import annotations

from contextlib import asynccontextmanager
from typing import Callable

from fastapi import APIRouter, Depends, FastAPI
from fastapi.responses import JSONResponse

from functions.gateway import errors
from functions.gateway.context import BodyTooLarge, Gateway, GatewaySettings
from functions.gateway.deps import authenticate, internal_token
from openrl.edge.proto import HEAD_BYTES
from openrl.model.registry import ModelRegistry
from openrl.storage import ExpirySweeper, open_storage
from openrl.transport.bus import Bus, FutureWaiter

error_response = errors.error_response  # kept importable from here

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


class BodyCapMiddleware:
    """Pure ASGI middleware: the body-size cap, which must act before a body is read.

    ``limit(path)`` is the largest body accepted on ``path`` (bytes). A ``Content-Length`` over
    it is answered 413 before anything is read (for :data:`HEAD_PATHS` the route answers it,
    after reading ``HEAD_BYTES`` to skip the seq_id); a chunked body raises
    :class:`BodyTooLarge` (413) once it passes the limit.
    """

    def __init__(self, app, limit: Callable[[str], int]):
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope.get("path", "")
        limit = self.limit(path)
        length = next((v.decode("latin-1") for k, v in scope.get("headers") or () if k.lower() == b"content-length"),
                      None)
        if length is not None and length.isdigit() and int(length) > limit:
            if path in HEAD_PATHS:  # the route reads the head, skips the seq_id, then answers 413
                scope.setdefault("state", {})["oversize"] = int(length)
                return await self.app(scope, _head_only(receive, HEAD_BYTES), send)
            resp = JSONResponse(status_code=413, content={
                "detail": f"body: request body of {length} bytes exceeds the limit of {limit} bytes",
                "category": "user", "field": "body"})
            if path.startswith("/v1/"):  # the OpenAI-compatible endpoint: OpenAI's error object too
                resp = errors.with_openai_error(resp)
            return await resp(scope, receive, send)
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


def api_router() -> APIRouter:
    """Every ``/api/v1`` route that needs an API key, under one router with
    :func:`functions.gateway.deps.authenticate` as its dependency."""
    from functions.gateway import (
        routes_copy, routes_futures, routes_imports, routes_rest, routes_sampling, routes_session, routes_status,
        routes_trace, routes_training, routes_usage,
    )

    api = APIRouter(dependencies=[Depends(authenticate)])
    for mod in (routes_session, routes_training, routes_sampling, routes_futures, routes_imports, routes_rest,
                routes_copy, routes_trace, routes_status, routes_usage):
        api.include_router(mod.router)
    return api


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
    from openrl.config import Settings
    from openrl.storage.handoff import SnapshotHandoff

    gw.handoff = SnapshotHandoff.from_settings(Settings())  # snapshots whose durable write is under way

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
    errors.install(app)

    from functions.gateway import (
        routes_download, routes_events, routes_imports, routes_session, routes_status, routes_trace,
    )

    for public in (routes_session.public, routes_status.public, routes_download.router, routes_trace.public,
                   routes_imports.public):
        app.include_router(public)  # no key: healthz, /metrics, signed download and upload URLs
    app.include_router(api_router())
    from functions.gateway import routes_openai

    app.include_router(routes_openai.router)  # /v1: the OpenAI-compatible endpoint (its own key check)
    app.include_router(routes_events.router, dependencies=[Depends(internal_token)])
    # JSON and protobuf API bodies must also fit one NATS message (Gateway.body_limit)
    app.add_middleware(BodyCapMiddleware, limit=lambda path: gw.body_limit() if path.startswith("/api/")
                       else gw.settings.max_body_bytes)
    routes_status.install(app)  # request metrics + traces (outermost)
    return app


def app_from_env(cfg: "Settings | dict | None" = None) -> FastAPI:
    """The app as deployed: settings from :class:`openrl.config.Settings` (the OPENRL_*
    environment; ``cfg`` values win). Storage defaults to ``file://$OPENRL_HOME/storage``,
    the workers' default.

    Raises:
        openrl.edge.auth.AuthConfigError: no keys configured.
        pydantic.ValidationError: a setting of the wrong type or out of range.
    """
    from openrl.config import Settings

    cfg = Settings.of(cfg)
    registry = ModelRegistry.load(cfg.registry_path, models_dir=cfg.models_path)
    from openrl.edge.auth import load_keys

    return create_app(nats_url=cfg.nats_url, storage_url=cfg.storage_url, registry=registry,
                      settings=GatewaySettings.of(cfg), keys=load_keys(cfg))
