"""Request helpers shared by the route modules: body parsing, caller identity."""

from __future__ import annotations

import json
from typing import TypeVar

import pydantic
from fastapi import Request

from functions.gateway.context import Gateway
from openrl.errors import UserError

M = TypeVar("M", bound=pydantic.BaseModel)


def gw(request: Request) -> Gateway:
    """The Gateway of the running app."""
    return request.app.state.gw


def owner(request: Request) -> str:
    """Owner id of the caller's API key (``X-API-Key`` header, any case)."""
    return Gateway.owner_of(request.headers.get("x-api-key"))


async def parse(request: Request, model: type[M]) -> M:
    """Read the JSON body and validate it as ``model``.

    Raises:
        UserError: body too large, not JSON, or a field fails validation (named).
    """
    raw = await request.body()
    if len(raw) > gw(request).settings.max_body_bytes:
        raise UserError("body", f"request body of {len(raw)} bytes exceeds the limit")
    try:
        data = json.loads(raw or b"{}")
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise UserError("body", f"malformed JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise UserError("body", "expected a JSON object")
    try:
        return model.model_validate(data)
    except pydantic.ValidationError as exc:
        from openrl.wire import validation_error_to_user_error

        raise validation_error_to_user_error(exc) from exc
