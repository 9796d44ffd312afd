"""Usage per API key: ``GET /api/v1/usage`` and the gateway's ``openrl_key_usage`` gauges.

``GET /api/v1/usage`` answers the caller's usage (an admin key with ``access_scope=all``: every
key's)::

    {"owners": [{"owner", "tokens_trained", "tokens_prefilled", "tokens_sampled",
                 "gpu_seconds": {"trainer", "sampler"}, "stored_bytes", "processes"}],
     "as_of": ISO-8601}

``tokens_trained``: tokens of the key's ``forward_backward`` datums; ``tokens_prefilled``: prompt
tokens of its sample requests (each request's prompt once); ``tokens_sampled``: tokens its
sample requests generated (every sequence); ``gpu_seconds``: accelerator seconds (CPU seconds
on a CPU stack) the trainer and the sampler spent on its requests; ``stored_bytes``: bytes of
its live checkpoints now; ``processes``: worker processes whose records were summed. The
counts come from the workers' records in the KV bucket (:mod:`openrl.observe.usage`), so they
survive worker restarts and scale to zero, and every gateway replica answers the same; they lag
the work by up to ``OPENRL_USAGE_FLUSH_S`` (10 s). docs/internals.md ("Usage and cost") says how
to turn them into a cost.

``/metrics`` (:func:`functions.gateway.routes_status.prometheus_metrics`) exports the same per
owner as ``openrl_key_usage{owner, measure}`` (measure: ``tokens_trained``,
``tokens_prefilled``, ``tokens_sampled``, ``gpu_seconds_trainer``, ``gpu_seconds_sampler``,
``stored_bytes``), refreshed at scrape time (:func:`refresh_gauges`; stored bytes at most every
``STORED_REFRESH_S``).
"""

from __future__ import annotations

import time

from fastapi import APIRouter
from prometheus_client import Gauge

from functions.gateway.deps import API_PREFIX, GatewayDep, ScopeDep
from openrl.observe.usage import owner_totals
from openrl.transport.bus import now_iso

router = APIRouter(prefix=API_PREFIX)  # behind the API key

KEY_USAGE = Gauge("openrl_key_usage", "Usage per API key (owner id) since it was created: tokens, accelerator "
                  "seconds, stored bytes (GET /api/v1/usage)", ["owner", "measure"])
STORED_REFRESH_S = 60.0  # how often /metrics re-reads every key's stored bytes (a storage listing)
_stored_cache: dict = {"t": 0.0, "by": {}}


async def usage_of(g, who: str | None) -> list[dict]:
    """Usage rows of owner ``who`` (None: every owner with usage or runs), as the route answers them."""
    totals = await owner_totals(g.bus, who)
    owners = set(totals)
    if who is not None:
        owners.add(who)
    else:
        owners |= {r.owner for r in await g.runs() if r.owner}
    rows = []
    for o in sorted(owners):
        t = totals.get(o) or {"tokens_trained": 0, "tokens_prefilled": 0, "tokens_sampled": 0,
                              "gpu_seconds": {"trainer": 0.0, "sampler": 0.0}, "processes": 0}
        rows.append({"owner": o, **t, "stored_bytes": await g.quotas.stored_bytes(g.bus, g.storage, o)})
    return rows


@router.get("/usage")
async def usage(g: GatewayDep, who: ScopeDep) -> dict:
    """The caller's usage (every key's for an admin with ``access_scope=all``); see the module doc."""
    return {"owners": await usage_of(g, who), "as_of": now_iso()}


async def refresh_gauges(g) -> None:
    """Set ``openrl_key_usage`` from the KV records (and, at most every :data:`STORED_REFRESH_S`
    seconds, the stored bytes of every owner)."""
    totals = await owner_totals(g.bus)
    for o, t in totals.items():
        for m in ("tokens_trained", "tokens_prefilled", "tokens_sampled"):
            KEY_USAGE.labels(o, m).set(t[m])
        for fn, s in t["gpu_seconds"].items():
            KEY_USAGE.labels(o, f"gpu_seconds_{fn}").set(s)
    if time.monotonic() - _stored_cache["t"] > STORED_REFRESH_S:
        _stored_cache["t"] = time.monotonic()
        owners = set(totals) | {r.owner for r in await g.runs() if r.owner}
        _stored_cache["by"] = {o: await g.quotas.stored_bytes(g.bus, g.storage, o) for o in owners}
    for o, n in _stored_cache["by"].items():
        KEY_USAGE.labels(o, "stored_bytes").set(n)
