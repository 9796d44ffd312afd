"""How the gateway answers errors: one JSON shape, ``{"detail", "category", "field"}``.

* :class:`openrl.errors.OpenRLError` (``UserError`` 400/404/413, ``NotSupported`` 400,
  ``Overloaded`` 429 with ``Retry-After``, ``ServerError`` 500): :func:`error_response`.
* :class:`openrl.edge.auth.AuthError`: 401 naming the key header.
* A JSON body that does not fit its route's :mod:`openrl.edge.wire` model (FastAPI's
  ``RequestValidationError``): 400 naming the first bad field, as
  :func:`openrl.edge.wire.parse_request` names it (an empty body counts as ``{}``).
* A body the middleware cut off while FastAPI read it (:class:`BodyTooLarge` in a chunked
  body): 413.
* No route for an ``/api/v1`` path or method (404 / 405): 401 first when the request has no
  valid key, as for every ``/api/v1`` route but ``healthz``.
"""

from __future__ import annotations

import json

import pydantic
from fastapi import FastAPI, Request
from fastapi.exception_handlers import http_exception_handler, request_validation_exception_handler
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic_core import PydanticUndefined
from starlette.exceptions import HTTPException

from openrl.edge import wire
from openrl.edge.auth import HEADER, AuthError
from openrl.errors import OpenRLError, UserError


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


def body_model(request: Request) -> type[pydantic.BaseModel] | None:
    """The :class:`openrl.edge.wire.WireModel` a route takes as its JSON body, if any."""
    field = getattr(request.scope.get("route"), "body_field", None)
    model = getattr(getattr(field, "field_info", None), "annotation", None)
    return model if isinstance(model, type) and issubclass(model, wire.WireModel) else None


def body_error(model: type[pydantic.BaseModel], body: object) -> UserError:
    """The :class:`UserError` of a JSON body that FastAPI found invalid for ``model``, named
    by :func:`openrl.edge.wire.parse_request` (``body``: the parsed JSON, the raw text of
    malformed JSON, or undefined for an empty body)."""
    if body is None or body is PydanticUndefined:
        body = b""
    try:
        wire.parse_request(model, body)
    except UserError as exc:
        return exc
    return UserError("body", f"does not fit {model.__name__}")  # pragma: no cover - FastAPI and pydantic agree


def install(app: FastAPI) -> None:
    """Register the gateway's exception handlers on ``app``."""

    @app.exception_handler(OpenRLError)
    async def _openrl_error(request: Request, exc: OpenRLError):
        return error_response(exc)

    @app.exception_handler(AuthError)
    async def _auth_error(request: Request, exc: AuthError):
        return JSONResponse(status_code=exc.status,
                            content={"detail": exc.message, "category": "user", "field": exc.field})

    @app.exception_handler(RequestValidationError)
    async def _invalid_request(request: Request, exc: RequestValidationError):
        model = body_model(request)
        if model is not None and any(tuple(e.get("loc", ()))[:1] == ("body",) for e in exc.errors()):
            return error_response(body_error(model, exc.body))
        return await request_validation_exception_handler(request, exc)

    @app.exception_handler(pydantic.ValidationError)
    async def _validation_error(request: Request, exc: pydantic.ValidationError):
        return error_response(wire.validation_error_to_user_error(exc))

    @app.exception_handler(json.JSONDecodeError)
    async def _json_error(request: Request, exc: json.JSONDecodeError):
        return error_response(UserError("body", f"malformed JSON: {exc}"))

    @app.exception_handler(HTTPException)
    async def _http_error(request: Request, exc: HTTPException):
        if isinstance(exc.__cause__, OpenRLError):  # e.g. BodyTooLarge raised while FastAPI read the body
            return error_response(exc.__cause__)
        if exc.status_code in (404, 405) and request.url.path.startswith("/api/v1/"):
            try:  # no route matched, so no router dependency ran: the key still comes first
                request.app.state.gw.keys.check(request.headers.get(HEADER))
            except AuthError as auth:
                return await _auth_error(request, auth)
        return await http_exception_handler(request, exc)
