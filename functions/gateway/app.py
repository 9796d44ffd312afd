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

from functions.gateway.context import Gateway, GatewaySettings
from openrl.bus import Bus, FutureWaiter
from openrl.errors import OpenRLError, UserError
from openrl.registry import ModelRegistry
from openrl.storage import open_storage


def error_response(exc: OpenRLError) -> JSONResponse:
    """A 4xx/5xx JSON body naming the field; never empty (the SDK treats an empty 400 as a proxy error)."""
    body = {"detail": exc.message, "category": exc.category}
    if getattr(exc, "field", None):
        body["field"] = exc.field
    return JSONResponse(status_code=exc.status, content=body)


def create_app(
    *,
    nats_url: str | None = None,
    storage_url: str,
    registry: ModelRegistry,
    settings: GatewaySettings | None = None,
) -> FastAPI:
    """Build the gateway app. The bus connects in the app's lifespan.

    Args:
        nats_url: NATS server URL (default ``$OPENRL_NATS_URL``).
        storage_url: ``file:///dir`` or ``gs://bucket/prefix`` (read for REST listings).
        registry: base-model registry.
    """
    gw = Gateway(bus=Bus(nats_url), registry=registry, storage=open_storage(storage_url), settings=settings or GatewaySettings())

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await gw.bus.connect()
        gw.waiter = FutureWaiter(gw.bus)
        await gw.waiter.start()
        yield
        await gw.waiter.stop()
        await gw.bus.close()

    app = FastAPI(title="openrl gateway", lifespan=lifespan)
    app.state.gw = gw

    @app.exception_handler(OpenRLError)
    async def _openrl_error(request: Request, exc: OpenRLError):
        return error_response(exc)

    @app.exception_handler(pydantic.ValidationError)
    async def _validation_error(request: Request, exc: pydantic.ValidationError):
        from openrl.wire import validation_error_to_user_error

        return error_response(validation_error_to_user_error(exc))

    @app.exception_handler(json.JSONDecodeError)
    async def _json_error(request: Request, exc: json.JSONDecodeError):
        return error_response(UserError("body", f"malformed JSON: {exc}"))

    from functions.gateway import (
        routes_events, routes_futures, routes_rest, routes_sampling, routes_session, routes_training,
    )

    for mod in (routes_session, routes_training, routes_sampling, routes_futures, routes_rest, routes_events):
        app.include_router(mod.router)
    return app


def app_from_env() -> FastAPI:
    """The app as deployed: settings from OPENRL_* environment variables."""
    import os

    models_dir = Path(os.environ.get("OPENRL_HOME", str(Path.home() / ".openrl"))) / "models"
    reg_path = os.environ.get("OPENRL_MODEL_REGISTRY")
    registry = ModelRegistry.load(Path(reg_path) if reg_path else None, models_dir=models_dir)
    return create_app(storage_url=os.environ.get("OPENRL_STORAGE", "file:///tmp/openrl-storage"), registry=registry)
