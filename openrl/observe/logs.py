"""Structured logs: one JSON object per line, with the request's identifiers attached.

    from openrl.observe import logs
    logs.setup("trainer")                     # once per process (JSON unless OPENRL_LOG_FORMAT=text)
    with logs.context(run_id=..., request_id=..., seq_id=3, event_id=...):
        log.info("handled", extra={"op": "forward_backward", "duration_ms": 12.5})

Every record carries ``ts`` (ISO-8601 UTC), ``level``, ``logger``, ``msg``, ``service``,
the fields of the enclosing :func:`context` blocks (``run_id``, ``request_id``,
``seq_id``, ``event_id``, ``op``, ...), ``trace_id`` / ``span_id`` when a trace span is
current, any ``extra={...}`` fields, and ``exc`` for exceptions. The context lives in a
``contextvars.ContextVar``, so it follows asyncio tasks and ``asyncio.to_thread``.

Environment: ``OPENRL_LOG_FORMAT`` (``json`` default, ``text``), ``OPENRL_LOG_LEVEL``
(default ``INFO``).
"""

from __future__ import annotations

import contextlib
import contextvars
import json
import logging
import sys
import time
from typing import Iterator

from openrl.config import Settings

_CONTEXT: contextvars.ContextVar[dict] = contextvars.ContextVar("openrl_log_context", default={})

# attributes every LogRecord has; anything else on a record came from ``extra=``
_STANDARD = set(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {"message", "asctime", "taskName"}


@contextlib.contextmanager
def context(**fields) -> Iterator[dict]:
    """Attach ``fields`` (None values are skipped) to every log record inside the block."""
    new = {**_CONTEXT.get(), **{k: v for k, v in fields.items() if v is not None}}
    token = _CONTEXT.set(new)
    try:
        yield new
    finally:
        _CONTEXT.reset(token)


def bind(**fields) -> None:
    """Add fields to the current context until the enclosing :func:`context` block ends."""
    _CONTEXT.set({**_CONTEXT.get(), **{k: v for k, v in fields.items() if v is not None}})


def current() -> dict:
    """The fields of the current context."""
    return dict(_CONTEXT.get())


def request_fields(event) -> dict:
    """Log fields of a request CloudEvent: ``event_id``, ``request_id`` (the future id, which
    is the event id), ``run_id`` (the subject: training run or sampling session), ``op``,
    and ``seq_id`` (request ids end in ``:<seq_id>``)."""
    eid = event.get_id()
    tail = eid.rsplit(":", 1)[-1]
    op = event.get_type().split(".")
    return {
        "event_id": eid,
        "request_id": eid,
        "run_id": event.get_subject(),
        "op": op[2] if len(op) == 4 else event.get_type(),
        "seq_id": int(tail) if tail.isdigit() else None,
    }


class JsonFormatter(logging.Formatter):
    """Formats a record as one JSON line (see the module doc for the fields)."""

    def __init__(self, service: str = ""):
        super().__init__()
        self.service = service

    def format(self, record: logging.LogRecord) -> str:
        out = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        if self.service:
            out["service"] = self.service
        out.update(_CONTEXT.get())
        from openrl.observe import tracing

        ids = tracing.current_ids()
        if ids:
            out["trace_id"], out["span_id"] = ids
        for k, v in vars(record).items():
            if k not in _STANDARD and not k.startswith("_"):
                out[k] = v
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


class _TextContext(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        base = super().format(record)
        ctx = _CONTEXT.get()
        return base + ("  " + " ".join(f"{k}={v}" for k, v in ctx.items()) if ctx else "")


def setup(service: str, *, level: str | None = None, fmt: str | None = None, stream=None) -> logging.Handler:
    """Configure the root logger of this process (replacing its handlers).

    Args:
        service: the ``service`` field of every record (``gateway``, ``trainer``, ...).
        level: default ``$OPENRL_LOG_LEVEL`` or INFO.
        fmt: ``json`` or ``text``; default ``$OPENRL_LOG_FORMAT`` or json.
        stream: default stderr.

    Returns:
        The installed handler.
    """
    env = Settings() if not (fmt and level) else None
    fmt = (fmt or env.log_format or "json").lower()
    handler = logging.StreamHandler(stream or sys.stderr)
    if fmt == "text":
        handler.setFormatter(_TextContext("%(asctime)s %(name)s %(levelname)s %(message)s"))
    else:
        handler.setFormatter(JsonFormatter(service))
    root = logging.getLogger()
    for h in list(root.handlers):
        root.removeHandler(h)
    root.addHandler(handler)
    root.setLevel((level or env.log_level or "INFO").upper())
    return handler
