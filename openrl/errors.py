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

    def to_payload(self) -> dict:
        """The JSON body of a failed future: ``{"error": str, "category": str}``."""
        return {"error": self.message, "category": self.category}


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


class ServerError(OpenRLError):
    """A fault on our side (category "server")."""

    category = "server"
    status = 500
