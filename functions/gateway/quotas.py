"""Per-key quotas at the gateway (issue 17 item 5): concurrent training runs, tokens per minute,
stored checkpoint bytes.

Each API key's :class:`openrl.edge.auth.Quota` comes from its key entry or the
``OPENRL_QUOTA_*`` defaults (unlimited unless set). A request over one answers HTTP 429 with a
``Retry-After`` header and ``{"detail", "category": "user", "field": "quota.<name>"}``
(:class:`QuotaExceeded`). A resend of a request that was already admitted (its future exists)
is always admitted and never counted twice.

* ``runs``: a new training run (``create_model``, create-via-load) is refused while the key
  holds that many runs whose session is alive (a heartbeat within ``heartbeat_expiry_s``);
  ``copy_weights`` copies (frozen, never trained) do not count. Read from the ``OPENRL_META``
  records, so every replica sees the same count.
* ``tokens_per_min``: the tokens admitted for the key in the last 60 s (forward /
  forward_backward: the datums' tokens; sample: prompt + num_samples x max_tokens, the most it
  can generate) plus the request's may not exceed it; ``Retry-After`` is when enough of the
  window has passed. Counted per gateway replica: with N replicas a key may get up to N times
  its quota (the window is kept in this process's memory, not in NATS).
* ``stored_bytes``: a save (``save_weights``, ``save_weights_for_sampler``,
  ``save_weights_external``) is refused while the ``size_bytes`` of the key's live checkpoint
  manifests sum to the quota or more (read at each admitted save; a refused key's reading is
  reused for :data:`STORED_CACHE_S` seconds, so SDK retries cost nothing); deleting checkpoints (or their TTL) frees it.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from datetime import datetime, timezone

from openrl.contract.records import CheckpointManifest, Session, TrainingRun
from openrl.edge.auth import Quota
from openrl.errors import Overloaded, UserError

WINDOW_S = 60.0  # the tokens_per_min window (seconds)
STORED_CACHE_S = 5.0  # how long a key's stored-bytes reading is reused (seconds)
RUNS_RETRY_S = 30.0  # Retry-After of the runs quota (seconds; a session expires or a run ends)
STORED_RETRY_S = 60.0  # Retry-After of the stored_bytes quota (seconds; checkpoints must be deleted)
SAVE_OPS = ("save_weights", "save_weights_for_sampler", "save_weights_external")
TOKEN_OPS = ("forward", "forward_backward", "sample")


class QuotaExceeded(Overloaded):
    """A per-key quota is exhausted: HTTP 429 with ``Retry-After``, category "user", field
    ``quota.<name>`` (``runs`` / ``tokens_per_min`` / ``stored_bytes``)."""

    category = "user"

    def __init__(self, quota: str, message: str, retry_after: float):
        super().__init__(message, retry_after=retry_after)
        self.field = f"quota.{quota}"
        self.message = f"quota.{quota}: {message}"


def _unix(iso: str | None) -> float:
    if not iso:
        return 0.0
    try:
        return datetime.fromisoformat(iso.replace("Z", "+00:00")).replace(tzinfo=timezone.utc).timestamp()
    except ValueError:
        return 0.0


class Quotas:
    """The per-key accounting of one gateway replica (see the module doc).

    Args:
        heartbeat_expiry_s: a session without a heartbeat for this long no longer holds runs (seconds).
    """

    def __init__(self, heartbeat_expiry_s: float = 600.0):
        self.heartbeat_expiry_s = heartbeat_expiry_s
        self._tokens: dict[str, deque[tuple[float, int]]] = {}  # owner -> (monotonic time, tokens) admitted
        self._stored: dict[str, tuple[float, int]] = {}  # owner -> (monotonic time read, bytes)
        self.rejected: dict[str, int] = {}  # quota name -> 429s answered (this replica)

    def _reject(self, quota: str, message: str, retry_after: float) -> QuotaExceeded:
        self.rejected[quota] = self.rejected.get(quota, 0) + 1
        return QuotaExceeded(quota, message, retry_after)

    # ----- tokens per minute ------------------------------------------------------------
    def used_tokens(self, owner: str, now: float | None = None) -> int:
        """Tokens admitted for ``owner`` in the last :data:`WINDOW_S` seconds (this replica)."""
        now = time.monotonic() if now is None else now
        q = self._tokens.get(owner)
        if not q:
            return 0
        while q and q[0][0] <= now - WINDOW_S:
            q.popleft()
        return sum(n for _, n in q)

    def charge_tokens(self, owner: str, quota: Quota, tokens: int, now: float | None = None) -> None:
        """Admit ``tokens`` for ``owner`` under ``quota.tokens_per_min`` (no-op when unlimited).

        Raises:
            UserError: one request of more tokens than the whole quota (it could never pass; 400
                naming ``quota.tokens_per_min``).
            QuotaExceeded: the window has no room; ``retry_after`` is when it will (<= 60 s).
        """
        limit = quota.tokens_per_min
        if limit is None or tokens <= 0:
            return
        now = time.monotonic() if now is None else now
        if tokens > limit:
            raise UserError("quota.tokens_per_min", f"this request needs {tokens} tokens, more than the key's whole "
                            f"quota of {limit} tokens per minute; send smaller batches")
        used = self.used_tokens(owner, now)
        q = self._tokens.setdefault(owner, deque())
        if used + tokens > limit:
            free, wait = used, WINDOW_S  # when do enough of the admitted tokens leave the window?
            for t, n in q:
                free -= n
                if free + tokens <= limit:
                    wait = t + WINDOW_S - now
                    break
            raise self._reject("tokens_per_min", f"the key admitted {used} tokens in the last {WINDOW_S:.0f} s; "
                               f"this request needs {tokens} more and the quota is {limit} per minute", max(1.0, wait))
        q.append((now, tokens))

    # ----- concurrent runs ------------------------------------------------------------------
    async def check_runs(self, bus, owner: str, quota: Quota, model_id: str) -> None:
        """Refuse a new training run ``model_id`` of ``owner`` over ``quota.runs`` (no-op when
        unlimited or when the run already exists: a retried create).

        Raises:
            QuotaExceeded: the key holds ``quota.runs`` live runs.
        """
        if quota.runs is None or await bus.meta_get("model", model_id) is not None:
            return
        runs = [r for r in map(TrainingRun.load, await bus.meta_list("model")) if r.owner == owner and not r.frozen]
        live_sessions: dict[str, bool] = {}
        now = time.time()
        n = 0
        for r in runs:
            sid = r.session_id
            if sid not in live_sessions:
                s = Session.load(await bus.meta_get("session", sid))
                live_sessions[sid] = s is not None and now - _unix(s.last_heartbeat) <= self.heartbeat_expiry_s
            n += live_sessions[sid]
        if n >= quota.runs:
            raise self._reject("runs", f"the key holds {n} training runs in live sessions; the quota is {quota.runs}",
                               RUNS_RETRY_S)

    # ----- stored bytes -------------------------------------------------------------------
    async def stored_bytes(self, bus, storage, owner: str) -> int:
        """Bytes of ``owner``'s live checkpoints (sum of their manifests' ``size_bytes``), read at
        most every :data:`STORED_CACHE_S` seconds."""
        hit = self._stored.get(owner)
        if hit is not None and time.monotonic() - hit[0] < STORED_CACHE_S:
            return hit[1]
        runs = [r.model_id for r in map(TrainingRun.load, await bus.meta_list("model")) if r.owner == owner]

        def total() -> int:
            now, n = time.time(), 0
            for rid in runs:
                for m in map(CheckpointManifest.load, storage.list_run(rid)):
                    exp = m.expires_unix
                    if m.owner == owner and (not exp or exp > now):
                        n += int(m.size_bytes or 0)
            return n

        n = await asyncio.to_thread(total)
        self._stored[owner] = (time.monotonic(), n)
        return n

    async def check_stored(self, bus, storage, owner: str, quota: Quota) -> None:
        """Refuse a save of ``owner`` at or over ``quota.stored_bytes`` (no-op when unlimited).

        Raises:
            QuotaExceeded: the key's checkpoints hold the quota or more.
        """
        if quota.stored_bytes is None:
            return
        n = await self.stored_bytes(bus, storage, owner)
        if n < quota.stored_bytes:
            self._stored.pop(owner, None)  # admitted: the next save reads the listing again
            return
        raise self._reject("stored_bytes", f"the key's checkpoints hold {n} bytes; the quota is "
                           f"{quota.stored_bytes}; delete checkpoints (RestClient.delete_checkpoint) or let their "
                           "TTL expire", STORED_RETRY_S)
