"""Request helpers shared by the route modules: body parsing, caller identity."""

from __future__ import annotations

import json
from typing import TypeVar

import pydantic
from fastapi import Request

from functions.gateway.context import BodyTooLarge, Gateway
from openrl.errors import UserError

M = TypeVar("M", bound=pydantic.BaseModel)


def gw(request: Request) -> Gateway:
    """The Gateway of the running app."""
    return request.app.state.gw


def caller(request: Request):
    """The :class:`openrl.edge.auth.Caller` of a request, checked by the gateway's ``EdgeMiddleware``
    (every ``/api/v1`` route but ``healthz``; a request without a valid key never gets here)."""
    from openrl.edge.auth import Caller

    c = request.scope.get("state", {}).get("caller")
    return c if c is not None else Caller(Gateway.owner_of(request.headers.get("x-api-key")))


def owner(request: Request) -> str:
    """Owner id of the caller's API key (``X-API-Key`` header): sha256(key)[:16] hex."""
    return caller(request).owner


def sees_all(request: Request) -> bool:
    """True for an admin key asking for every owner's objects: query ``access_scope=all``
    (or the SDK's ``accessible``). Anyone else sees only their own objects."""
    return caller(request).admin and request.query_params.get("access_scope") in ("all", "accessible")


async def parse(request: Request, model: type[M]) -> M:
    """Read the JSON body and validate it as ``model``.

    Raises:
        BodyTooLarge: body over the limit (413).
        UserError: not JSON, or a field fails validation (named).
    """
    raw = await request.body()
    if len(raw) > gw(request).body_limit():
        raise BodyTooLarge("body", f"request body of {len(raw)} bytes exceeds the limit")
    try:
        data = json.loads(raw or b"{}")
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise UserError("body", f"malformed JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise UserError("body", "expected a JSON object")
    try:
        return model.model_validate(data)
    except pydantic.ValidationError as exc:
        from openrl.edge.wire import validation_error_to_user_error

        raise validation_error_to_user_error(exc) from exc
