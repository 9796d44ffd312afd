"""Base models that failed to load: their requests fail at once with the cause; the rest go on.

A worker (trainer, sampler) loads a base model when a request first names it, or at start for
the ``--model`` / ``OPENRL_PRELOAD`` names. When that load raises (a truncated safetensors
file, a ``config.json`` transformers cannot read, out of memory, a vLLM engine that does not
start), :class:`LoadFailures` keeps the failure per model directory, and every request for
that model fails with :class:`ModelLoadError` (category ``"server"``: the request is valid,
the server's copy of the model is broken) whose message carries the load error's first line.
The worker keeps running and serving its other models; a failed preload no longer stops it.

When is the load tried again? Not on every request (a failing load can cost seconds to
minutes of disk and device time each): only when the model's directory changed since the
failure (a file added, removed, rewritten: the size and mtime of its files, see
:func:`dir_fingerprint`), or when ``retry_s`` seconds passed (``OPENRL_MODEL_RETRY_S``,
default 60; causes outside the directory, such as device memory, may go away by themselves).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass
from typing import Callable, TypeVar

from openrl.errors import ServerError, first_line

log = logging.getLogger("openrl.model.load")

T = TypeVar("T")


class ModelLoadError(ServerError):
    """A registered base model whose directory cannot be loaded (category ``"server"``).

    Args:
        name: the Tinker base-model name the request asked for.
        path: the model's directory.
        cause: the load error's first line (:func:`openrl.errors.first_line`).
        retry_s: seconds after the failure when a request tries the load again (0: each request).
    """

    def __init__(self, name: str, path: str | os.PathLike, cause: str, retry_s: float):
        when = "the next request tries again" if retry_s <= 0 else (
            f"kept: loaded again once its files change or {retry_s:g} s after the failure, OPENRL_MODEL_RETRY_S")
        super().__init__(f"base model {name!r} cannot be loaded from {path}: {cause} ({when})")
        self.name, self.path, self.cause = name, str(path), cause


def dir_fingerprint(path: str | os.PathLike) -> tuple:
    """``(name, size, mtime_ns)`` of each file directly in ``path`` (sorted), or ``("missing", reason)``:
    what a fix of the model's files changes."""
    try:
        with os.scandir(path) as it:
            out = []
            for e in it:
                try:
                    st = e.stat()
                except OSError:
                    continue
                out.append((e.name, st.st_size, st.st_mtime_ns))
            return tuple(sorted(out))
    except OSError as exc:
        return ("missing", f"{type(exc).__name__}: {exc}")


@dataclass
class _Failure:
    cause: str
    fingerprint: tuple
    at: float


class LoadFailures:
    """The load failures of one worker, by model directory (thread-safe).

    Args:
        retry_s: seconds a failure is kept unless the directory changes (``>= 0``; 0: none kept).
        clock: monotonic seconds (tests pass their own).

    Raises:
        ValueError: a negative ``retry_s``.
    """

    def __init__(self, retry_s: float = 60.0, clock: Callable[[], float] = time.monotonic):
        if retry_s < 0:
            raise ValueError(f"model_retry_s (OPENRL_MODEL_RETRY_S) must be >= 0 seconds, got {retry_s}")
        self.retry_s, self.clock = float(retry_s), clock
        self._failures: dict[str, _Failure] = {}
        self._names: dict[str, str] = {}  # directory -> the name of its last failed load (for failed())
        self._lock = threading.Lock()

    def check(self, name: str, path: str | os.PathLike) -> None:
        """Raise the kept failure of ``path``, if any that still holds; else return (load it).

        Raises:
            ModelLoadError: ``path`` failed to load less than ``retry_s`` seconds ago and its
                files did not change since.
        """
        key = str(path)
        with self._lock:
            f = self._failures.get(key)
            if f is None:
                return
            if self.clock() - f.at < self.retry_s and dir_fingerprint(key) == f.fingerprint:
                raise ModelLoadError(name, key, f.cause, self.retry_s)
            del self._failures[key]  # let this request try again
        log.info("base model %s (%s): trying to load it again after the failure %r", name, key, f.cause)

    def record(self, name: str, path: str | os.PathLike, exc: BaseException) -> ModelLoadError:
        """Keep ``exc`` as the failure of ``path`` (logged once per failed load) and return the
        error to raise (``raise failures.record(...) from exc``)."""
        key, cause = str(path), first_line(exc)
        with self._lock:
            self._failures[key] = _Failure(cause, dir_fingerprint(key), self.clock())
            self._names[key] = name
        log.error("base model %s cannot be loaded from %s: %s", name, key, cause, exc_info=exc)
        return ModelLoadError(name, key, cause, self.retry_s)

    def load(self, name: str, path: str | os.PathLike, loader: Callable[[], T]) -> T:
        """``loader()``, unless a kept failure of ``path`` holds (:meth:`check`); a failure of
        ``loader`` is kept (:meth:`record`).

        Raises:
            ModelLoadError: the kept failure, or the one ``loader`` raised just now.
        """
        self.check(name, path)
        try:
            return loader()
        except Exception as exc:  # noqa: BLE001 - any load error fails this model only
            raise self.record(name, path, exc) from exc

    def failed(self) -> dict[str, str]:
        """``{base-model name: cause}`` of the failures kept now (``openrl status``)."""
        with self._lock:
            return {self._names.get(k, k): f.cause for k, f in self._failures.items()}


def describe_failures(failures: LoadFailures) -> str | None:
    """``"Bad/Model: SafetensorError: ...; Other: ..."``, or None when no load failed (a worker's
    ``describe()`` value ``models_failed``)."""
    got = failures.failed()
    return "; ".join(f"{n}: {c}" for n, c in sorted(got.items())) or None

