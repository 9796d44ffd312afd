"""FastAPI dependencies of the gateway's routes (in the style of the FastAPI full-stack
template's ``api/deps.py``): the shared :class:`Gateway`, the caller behind the API key, and
the owner scope of listings.

* :data:`GatewayDep`: the :class:`functions.gateway.context.Gateway` of the running app.
* :data:`CallerDep`: the :class:`openrl.edge.auth.Caller` of the ``X-API-Key`` header. Every
  ``/api/v1`` route but ``healthz`` has :func:`authenticate` as a router dependency (see
  :func:`functions.gateway.app.create_app`), so a request without a configured key gets 401
  before its route runs; FastAPI caches the result, so a route that asks for the caller gets
  the same one.
* :data:`ScopeDep`: whose objects a listing shows (the caller's, or everyone's for an admin key).
* :data:`OwnedRunDep`: the training run of the path's ``{run_id}`` that the caller may read.
* :func:`internal_token`: the ``/events/*`` sinks' dependency.
* :class:`WireRoute`: the route class of every router (response models serialised as
  :func:`openrl.edge.wire.dump` does).
"""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request, Security
from fastapi.routing import APIRoute
from fastapi.security import APIKeyHeader, APIKeyQuery

from functions.gateway.context import Gateway
from openrl.contract.records import TrainingRun
from openrl.edge.auth import HEADER, INTERNAL_HEADER, Caller
from openrl.errors import NotFound

API_PREFIX = "/api/v1"  # the prefix of every Tinker route (each route module's router carries it)

_api_key = APIKeyHeader(name=HEADER, auto_error=False, description="A configured `tml-` API key")
_internal_header = APIKeyHeader(name=INTERNAL_HEADER, auto_error=False)
_internal_query = APIKeyQuery(name="token", auto_error=False)


def get_gateway(request: Request) -> Gateway:
    """The Gateway of the running app (``app.state.gw``, set by ``create_app``)."""
    return request.app.state.gw


GatewayDep = Annotated[Gateway, Depends(get_gateway)]


def authenticate(request: Request, g: GatewayDep, key: Annotated[str | None, Security(_api_key)]) -> Caller:
    """The caller behind the ``X-API-Key`` header (also kept in ``request.state.caller``).

    Raises:
        openrl.edge.auth.AuthError: no key, or one that is not configured (401 naming the header).
    """
    caller = g.keys.check(key)
    request.state.caller = caller
    return caller


CallerDep = Annotated[Caller, Depends(authenticate)]


def listing_scope(caller: CallerDep, access_scope: str | None = None) -> str | None:
    """The owner whose objects a listing or read shows: the caller's own, or None (every
    owner) for an admin key that asks with ``access_scope=all`` (or the SDK's ``accessible``)."""
    return None if caller.admin and access_scope in ("all", "accessible") else caller.owner


ScopeDep = Annotated[str | None, Depends(listing_scope)]


async def owned_run(run_id: str, g: GatewayDep, scope: ScopeDep) -> TrainingRun:
    """The training-run record of path parameter ``run_id`` that the caller may read: its own
    (any, for an admin listing all).

    Raises:
        NotFound: unknown, or another key's run (404 naming ``training_run_id``).
    """
    if scope is not None:
        return await g.model(run_id, scope, "training_run_id")
    rec = await g.model_record(run_id)
    if rec is None:
        raise NotFound("training_run_id", f"unknown training run {run_id!r}")
    return rec


OwnedRunDep = Annotated[TrainingRun, Depends(owned_run)]


def internal_token(g: GatewayDep, header: Annotated[str | None, Security(_internal_header)],
                   query: Annotated[str | None, Security(_internal_query)]) -> None:
    """Router dependency of ``/events/*``: when ``OPENRL_INTERNAL_TOKEN`` is configured, the
    ``X-OpenRL-Internal-Token`` header (or, for Trigger URIs that cannot carry headers, the
    ``?token=`` query parameter) must hold it.

    Raises:
        openrl.edge.auth.AuthError: missing or wrong token (401).
    """
    if g.keys.has_internal_token:
        g.keys.check_internal(header if header is not None else query)


class WireRoute(APIRoute):
    """A route whose ``response_model`` (an :mod:`openrl.edge.wire` response model) is
    serialised as :func:`openrl.edge.wire.dump` does: ``None`` fields are left out. Routes
    without a ``response_model`` send their dict as it is."""

    def __init__(self, path: str, endpoint, **kwargs):
        kwargs["response_model_exclude_none"] = True
        super().__init__(path, endpoint, **kwargs)
