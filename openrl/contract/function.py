"""The Function contract: what the trainer and the sampler offer the bindings.

The shape of the Knative Functions Python template (knative/func,
``templates/python/cloudevents/function/func.py``): a module-level ``new()`` returns an
instance with

- ``start(cfg)``: read configuration (a :class:`openrl.config.Settings`, or a dict of
  explicit values: :meth:`Settings.of`), open storage, load what must be loaded;
- ``handle(event)``: one request CloudEvent in, its result CloudEvent (or None) out;
- ``stop()``: drain and flush (the binding stopped taking new events first);
- ``alive()`` / ``ready()``: a :data:`Status`, ``(ok, reason)``, as the template's
  ``return True, "Alive"``;
- optionally ``describe()``: ``{"device", "dtype", "backend", ...}`` for ``openrl status``.

The bindings (:mod:`openrl.transport.worker`, :mod:`openrl.transport.bindings.http`) call
nothing else; they read probe answers with :func:`probe`, which also accepts the bare
bool of older Functions.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Mapping, Protocol, Union, runtime_checkable

if TYPE_CHECKING:
    from cloudevents.http import CloudEvent

    from openrl.config import Settings

#: A probe answer: (healthy, reason shown to the prober), e.g. ``(True, "Alive")``.
Status = tuple[bool, str]

ALIVE: Status = (True, "Alive")
READY: Status = (True, "Ready")


@runtime_checkable
class Function(Protocol):
    """A CloudEvent handler with a lifecycle (see the module doc)."""

    async def start(self, cfg: "Union[Settings, Mapping[str, Any]]") -> None:
        """Configure and load. Raises ValueError on a bad setting."""

    async def handle(self, event: "CloudEvent") -> "CloudEvent | None":
        """Answer one request event; None when the result is not sent back (already answered)."""

    async def stop(self) -> None:
        """Drain and release (flush state, close engines)."""

    def alive(self) -> Status:
        """Liveness: False only when the process should be restarted."""

    def ready(self) -> Status:
        """Readiness: True once ``start()`` finished and until ``stop()`` began."""


def probe(answer: Any, what: str = "ready") -> Status:
    """A probe answer as ``(ok, reason)``.

    Args:
        answer: ``(bool, str)`` (the contract) or a bare bool (older Functions).
        what: the probe's name, for the reason of a bare bool (``"ready"`` -> ``"Ready"`` /
            ``"not ready"``).
    """
    if isinstance(answer, tuple):
        ok, reason = (answer + ("",))[:2]
        return bool(ok), str(reason or (what.capitalize() if ok else f"not {what}"))
    ok = bool(answer)
    return ok, what.capitalize() if ok else f"not {what}"
