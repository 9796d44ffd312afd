"""Base model, field-naming errors and the ValidationError → UserError bridge."""

from __future__ import annotations

import json
import types
import typing
from typing import Any, Annotated, TypeVar, Union, get_args, get_origin

import pydantic
from pydantic import BaseModel, ConfigDict, Tag

from openrl.errors import UserError

__all__ = [
    "WireModel",
    "ResponseModel",
    "FieldError",
    "validation_error_to_user_error",
    "parse_request",
    "dump",
]

_MODELS: dict[str, type[BaseModel]] = {}


class WireModel(BaseModel):
    """Base of every request body: an unknown field is refused, naming it (invariant 12: an
    input the service cannot honour is never dropped). Each model declares every key the SDK
    sends (its request types forbid extra fields too), ``type`` included where the SDK sends
    one; ``type`` is never required."""

    model_config = ConfigDict(extra="forbid", protected_namespaces=())

    @classmethod
    def __pydantic_init_subclass__(cls, **kwargs: Any) -> None:
        super().__pydantic_init_subclass__(**kwargs)
        _MODELS.setdefault(cls.__name__, cls)


class ResponseModel(BaseModel):
    """Base of every response body the server sends; serialize with :func:`dump`."""

    model_config = ConfigDict(extra="ignore", protected_namespaces=())


class FieldError(ValueError):
    """Raised inside a model validator to blame a named (relative, dotted) field."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field
        self.message = message


M = TypeVar("M", bound=BaseModel)


def dump(model: BaseModel) -> dict[str, Any]:
    """JSON-ready dict of a response model (``mode="json"``, ``None`` fields left out)."""
    return model.model_dump(mode="json", exclude_none=True)


def parse_request(model: type[M], body: bytes | str | dict[str, Any]) -> M:
    """Validate a JSON request body (an empty one counts as ``{}``). The gateway names the
    field of a body FastAPI found invalid with it (``functions/gateway/errors.py``).

    Args:
        model: the request model class.
        body: raw body bytes/str (parsed as JSON) or an already-parsed dict.

    Raises:
        UserError: ``body`` for invalid JSON or a non-object; otherwise the first failing
            field (see :func:`validation_error_to_user_error`).
    """
    if isinstance(body, (bytes, bytearray, str)):
        try:
            body = json.loads(body or b"{}")
        except ValueError as exc:
            raise UserError("body", f"malformed JSON: {exc}") from None
    if not isinstance(body, dict):
        raise UserError("body", "expected a JSON object")
    try:
        return model.model_validate(body)
    except pydantic.ValidationError as exc:
        raise validation_error_to_user_error(exc, model) from None


def _unwrap(tp: Any) -> tuple[Any, str | None]:
    """Strip Annotated (returning a Tag if present) and Optional[X]."""
    tag = None
    while get_origin(tp) is Annotated:
        args = get_args(tp)
        for meta in args[1:]:
            if isinstance(meta, Tag):
                tag = meta.tag
        tp = args[0]
    if _is_union(tp):
        members = [m for m in get_args(tp) if m is not type(None)]
        if len(members) == 1:
            return _unwrap(members[0])[0], tag
    return tp, tag


def _is_union(tp: Any) -> bool:
    return get_origin(tp) in (Union, types.UnionType)


def _pick_member(union: Any, comp: Any) -> Any:
    members = [m for m in get_args(union) if m is not type(None)]
    for m in members:
        inner, tag = _unwrap(m)
        if tag is not None and tag == comp:
            return inner
    for m in members:
        inner, _ = _unwrap(m)
        name = getattr(inner, "__name__", None) if get_origin(inner) is None else None
        if name == comp or repr(inner) == comp:
            return inner
        origin = get_origin(inner)
        if origin is not None and isinstance(comp, str) and comp.startswith(getattr(origin, "__name__", "?") + "["):
            return inner
    return Any


def _loc_to_path(model: Any, loc: tuple[Any, ...]) -> tuple[str, int | None, Any]:
    """Dotted path of ``loc``, the loc index of the first plain (untagged) union member, and
    the type ``loc`` leads to (``Any`` where it is not known)."""
    plain_union_at: int | None = None
    path = ""
    tp: Any = model
    i = 0
    while i < len(loc):
        comp = loc[i]
        tp, _ = _unwrap(tp)
        if _is_union(tp):  # pydantic put the union member's tag in the loc: skip it
            if plain_union_at is None and not any(_unwrap(m)[1] for m in get_args(tp)):
                plain_union_at = i
            tp = _pick_member(tp, comp)
            i += 1
            continue
        origin = get_origin(tp)
        if isinstance(comp, int):
            path += f"[{comp}]"
            args = get_args(tp)
            tp = args[0] if origin in (list, tuple, typing.Sequence) and args else Any
        elif isinstance(tp, type) and issubclass(tp, BaseModel):
            name, nxt = comp, Any
            for fname, finfo in tp.model_fields.items():
                if comp in (fname, finfo.alias, finfo.validation_alias):
                    name, nxt = fname, finfo.annotation
                    break
            path += f".{name}" if name != "" else '.""'  # an empty key, named so
            tp = nxt
        else:
            path += f".{comp}" if comp != "" else '.""'
            args = get_args(tp)
            tp = args[1] if origin is dict and len(args) == 2 else Any
        i += 1
    return path.lstrip("."), plain_union_at, tp


def validation_error_to_user_error(
    exc: pydantic.ValidationError, model: type[BaseModel] | None = None
) -> UserError:
    """Turn a pydantic error into a :class:`UserError` naming the first failing field.

    The error's ``kind`` attribute says what was wrong: ``"unknown"`` (a key the model does not
    have), ``"missing"`` (a required key) or ``"invalid"`` (a value); the OpenAI-compatible routes
    turn it into OpenAI's error ``code``.

    The field is a dotted path with list indices, e.g. ``sampling_params.temperature``
    or ``prompt.chunks[0].tokens[3]``; union-member tags pydantic inserts in its
    ``loc`` are dropped. An error raised as :class:`FieldError` in a model validator
    names its own field (relative to that model). A top-level error with no location
    names ``body``.

    Args:
        exc: the validation error.
        model: the model class validated (found by ``exc.title`` when omitted).
    """
    errors = exc.errors(include_url=False)
    if not errors:
        return UserError("body", str(exc))
    # an unknown key first: it is what the client got wrong, whatever else it left out
    err = next((e for e in errors if e.get("type") == "extra_forbidden"), errors[0])
    model = model or _MODELS.get(exc.title)
    loc = tuple(err.get("loc", ()))
    path, union_at, _ = _loc_to_path(model if model is not None else Any, loc)
    if err.get("type") == "extra_forbidden":
        out = UserError(path or "body", _unknown_field(model if model is not None else Any, loc))
        out.kind = "unknown"
        return out
    msg = err.get("msg", "invalid value")
    ctx = err.get("ctx") or {}
    cause = ctx.get("error")
    if union_at is not None:
        # A plain union (e.g. stop: str | list[str] | list[int]): every member failed.
        tried = []
        for e in errors:
            eloc = tuple(e.get("loc", ()))
            if eloc[:union_at] == loc[:union_at] and len(eloc) > union_at and eloc[union_at] not in tried:
                tried.append(eloc[union_at])
        path, _, _ = _loc_to_path(model if model is not None else Any, loc[:union_at])
        msg = "invalid value; expected one of: " + " | ".join(map(str, tried))
    elif err.get("type") == "union_tag_invalid":
        path = f"{path}.type" if path else "type"
        msg = f"unknown type {ctx.get('tag')!r}; expected one of {ctx.get('expected_tags')}"
    elif isinstance(cause, FieldError):
        path = f"{path}.{cause.field}" if path else cause.field
        msg = cause.message
    elif msg.startswith("Value error, "):
        msg = msg[len("Value error, "):]
    out = UserError(path or "body", "required" if err.get("type") == "missing" else msg)
    out.kind = "missing" if err.get("type") == "missing" else "invalid"
    return out


def _unknown_field(model: Any, loc: tuple[Any, ...]) -> str:
    """The message of an unknown key at ``loc``: which keys the object there takes."""
    _, _, parent = _loc_to_path(model, loc[:-1])
    parent, _ = _unwrap(parent)
    if isinstance(parent, type) and issubclass(parent, BaseModel):
        names = [f.alias or name for name, f in parent.model_fields.items()]
        return f"unknown field; {parent.__name__} takes {', '.join(names)}"
    return "unknown field"
