"""How the gateway answers errors: one JSON shape, ``{"detail", "category", "field"}``.

* :class:`openrl.errors.OpenRLError` (``UserError`` 400/404/413, ``NotSupported`` 400,
  ``Overloaded`` 429 with ``Retry-After``, ``ServerError`` 500): :func:`error_response`.
* :class:`openrl.edge.auth.AuthError`: 401 naming the key header.
* A JSON body that does not fit its route's :mod:`openrl.edge.wire` model (FastAPI's
  ``RequestValidationError``): 400 naming the first bad field, as
  :func:`openrl.edge.wire.parse_request` names it (an empty body counts as ``{}``); a body
  whose ``Content-Type`` is not JSON (``application/x-protobuf``, a form): 400 naming ``content-type``.
* A path, query or header parameter of the wrong type: 400 naming it.
* FastAPI's own 400 (a body it cannot parse, e.g. bytes that are not UTF-8), 404 (no route)
  and 405 (no such method): the same shape, naming ``body`` / ``path`` / ``method``.
* A body the middleware cut off while FastAPI read it (:class:`BodyTooLarge` in a chunked
  body): 413.
* No route for an ``/api/v1`` path or method (404 / 405): 401 first when the request has no
  valid key, as for every ``/api/v1`` route but ``healthz``.
"""

from __future__ import annotations

import json
import types
import typing

import pydantic
from fastapi import FastAPI, Request
from fastapi.exception_handlers import http_exception_handler, request_validation_exception_handler
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic_core import PydanticUndefined
from starlette.exceptions import HTTPException

from openrl.edge import wire
from openrl.edge.auth import HEADER, AuthError
from openrl.errors import NotSupported, OpenRLError, UserError


#: FastAPI / Starlette 4xx statuses answered in the JSON shape of docs/errors.md, and the field each names.
_HTTP_FIELDS = {400: "body", 404: "path", 405: "method"}


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
    if typing.get_origin(model) in (typing.Union, types.UnionType):  # an optional body: ``Model | None``
        model = next((a for a in typing.get_args(model) if a is not type(None)), None)
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


def request_user_error(request: Request, exc: RequestValidationError) -> UserError | None:
    """The :class:`UserError` (400) of a request FastAPI found invalid: its JSON body, named by
    :func:`body_error` (a body whose ``Content-Type`` is not JSON: ``content-type``), or a path,
    query or header parameter (not FastAPI's 422 list). None when it has no error to name."""
    model = body_model(request)
    if model is not None and any(tuple(e.get("loc", ()))[:1] == ("body",) for e in exc.errors()):
        if isinstance(exc.body, (bytes, bytearray)):  # FastAPI parses only a JSON content type
            ctype = request.headers.get("content-type", "")
            return UserError("content-type", f"{ctype!r}: this route takes a JSON body (Content-Type: application/json)")
        return body_error(model, exc.body)
    errs = exc.errors()
    if errs:
        loc = [str(p) for p in tuple(errs[0].get("loc", ()))[1:]] or ["request"]
        return UserError(".".join(loc), str(errs[0].get("msg", "invalid")))
    return None


#: :attr:`UserError.kind <openrl.edge.wire.validation_error_to_user_error>` -> OpenAI's error ``code``
_OPENAI_CODES = {"unknown": "unknown_parameter", "missing": "missing_required_parameter", "invalid": "invalid_value"}


def openai_error(status: int, body: dict, src: BaseException | None = None) -> dict:
    """OpenAI's error object (``{"message", "type", "param", "code"}``) of an answer of ``status``
    whose docs/errors.md body is ``body``, raised as ``src``. What client libraries branch on:

    * 401: ``invalid_request_error`` / ``invalid_api_key``;
    * 404 naming ``model`` (an unknown model, or a snapshot the key may not read):
      ``invalid_request_error`` / ``model_not_found``;
    * other 4xx: ``invalid_request_error``; ``code`` ``unknown_parameter`` (a key the request
      does not have), ``missing_required_parameter``, ``unsupported_parameter`` (an option this
      server does not implement), ``invalid_value`` (a value out of range), else null;
    * 429: ``requests`` / ``rate_limit_exceeded``; 5xx: ``server_error``.
    """
    param = body.get("field")
    code = None
    if status >= 500:
        kind = "server_error"
    elif status == 429:
        kind, code = "requests", "rate_limit_exceeded"
    else:
        kind = "invalid_request_error"
        if status == 401:
            code = "invalid_api_key"
        elif status == 404 and param == "model":
            code = "model_not_found"
        elif getattr(src, "unsupported", False) or isinstance(src, NotSupported):
            code = "unsupported_parameter"
        elif status == 400 and param:
            code = _OPENAI_CODES.get(getattr(src, "kind", None), "invalid_value")
    return {"message": body.get("detail", ""), "type": kind, "param": param, "code": code}


def with_openai_error(resp: JSONResponse, src: BaseException | None = None) -> JSONResponse:
    """``resp`` (a docs/errors.md JSON error) with OpenAI's ``error`` object added to its body,
    headers kept (``Retry-After``)."""
    try:
        body = json.loads(resp.body)
    except (AttributeError, ValueError):
        return resp
    if not isinstance(body, dict):
        return resp
    body["error"] = openai_error(resp.status_code, body, src)
    return JSONResponse(status_code=resp.status_code, content=body,
                        headers={k: v for k, v in resp.headers.items() if k.lower() not in ("content-length", "content-type")})


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
        err = request_user_error(request, exc)
        if err is not None:
            return error_response(err)
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
            if request.url.path.startswith("/v1/"):
                return with_openai_error(error_response(exc.__cause__), exc.__cause__)
            return error_response(exc.__cause__)
        if exc.status_code in (404, 405) and request.url.path.startswith("/api/v1/"):
            try:  # no route matched, so no router dependency ran: the key still comes first
                request.app.state.gw.keys.check(request.headers.get(HEADER))
            except AuthError as auth:
                return await _auth_error(request, auth)
        if 400 <= exc.status_code < 500 and exc.status_code in _HTTP_FIELDS:
            # FastAPI's own 4xx (a body it could not parse, e.g. bytes that are not UTF-8; no
            # route; a method the path lacks): the same JSON shape, naming what was wrong
            err = UserError(_HTTP_FIELDS[exc.status_code], str(exc.detail))
            err.status = exc.status_code
            if request.url.path.startswith("/v1/"):  # the OpenAI-compatible endpoint's shape too
                return with_openai_error(error_response(err), err)
            return error_response(err)
        return await http_exception_handler(request, exc)
