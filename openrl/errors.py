"""Errors shared by the gateway and the functions.

Each error carries the Tinker failure ``category`` the SDK understands
(``RequestFailedError.category``): "user" for bad input, "server" for our faults.
"""

from __future__ import annotations


class OpenRLError(Exception):
    """Base class. ``category`` is the Tinker RequestErrorCategory; ``status`` the HTTP status."""

    category = "server"
    status = 500

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message


class UserError(OpenRLError):
    """Bad input from the client; the message names the offending field.

    Args:
        field: dotted name of the request field at fault (e.g. ``data[0].loss_fn_inputs.weights``).
        message: what is wrong with it.
    """

    category = "user"
    status = 400

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field


class NotFound(UserError):
    """An id (training run, session, sampler, checkpoint) that does not exist for this caller (HTTP 404)."""

    status = 404


class RegistryError(ValueError):
    """The model registry file is missing, not TOML, or has an invalid entry (message names file
    and key). Raised by :mod:`openrl.model.registry` (which re-exports it) and, as the base of
    :class:`openrl.model.modelcheck.ModelDirError`, by the model-directory check; kept here so
    that the two modules do not import each other."""


class CLIError(OpenRLError):
    """Something the person running ``openrl`` can fix (a busy port, an unusable state directory,
    a stack that still runs): the CLI prints the message, which names the cause and what to do,
    as one line and exits 1."""


class Gone(UserError):
    """An id that existed and is over: a finished session (HTTP 410, which stops the SDK's
    session heartbeat). Also answered for an unknown or another key's session, like :class:`NotFound`."""

    status = 410


class ServerError(OpenRLError):
    """A fault on our side (category "server")."""

    category = "server"
    status = 500


class Overloaded(OpenRLError):
    """The work queue the request would join is full (HTTP 429 with ``Retry-After``).

    The SDK backs off and resends the same request (same ``seq_id``), which the gateway
    deduplicates, so nothing is lost or applied twice.

    Args:
        message: what is full.
        retry_after: suggested wait before the retry (seconds).
    """

    category = "server"
    status = 429

    def __init__(self, message: str, retry_after: float = 1.0):
        super().__init__(message)
        self.retry_after = retry_after


class NotSupported(UserError):
    """A Tinker feature this server does not implement (HTTP 400, category "user").

    The message says what is unsupported and what to use instead. 400 rather than 501 on
    purpose: the SDK retries every status >= 500 (and 408/409/429) for up to 5 minutes
    (``InternalClientHolder.execute_with_retries``), so a 501 would look like a hang; a 400
    raises ``tinker.BadRequestError`` at once.

    Args:
        feature: the SDK method or option, e.g. ``"RestClient.export_session_trace"``.
        message: why, and the alternative.
    """

    def __init__(self, feature: str, message: str):
        super().__init__(feature, f"not supported by this server: {message}")
        self.feature = feature


def first_line(exc: BaseException) -> str:
    """``"<ExceptionType>: <first non-empty line of its message>"`` (``"<ExceptionType>"`` for an
    empty message): the one line of an error that a failed future or ``openrl status`` carries."""
    lines = [s.strip() for s in str(exc).splitlines() if s.strip()]
    name = type(exc).__name__
    return f"{name}: {lines[0]}" if lines else name
