"""What every gateway route shares: the bus, the model registry, storage and settings.

The gateway holds no private state: sessions, training runs and sampling sessions are
records in the ``OPENRL_META`` KV bucket, futures live in ``OPENRL_FUTURES``. Any
number of gateway replicas can serve the same SDK client.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import zlib
from dataclasses import dataclass, field
from pathlib import Path

from openrl import events
from openrl.bus import Bus, FutureWaiter, sample_subject, train_subject
from openrl.errors import NotFound, UserError
from openrl.registry import ModelRegistry
from openrl.storage import Storage


@dataclass
class GatewaySettings:
    """Tunables of the gateway (env var in brackets).

    long_poll_s: how long ``retrieve_future`` holds a request before ``try_again``
        (seconds; must stay under the SDK's 45 s read timeout) [OPENRL_LONG_POLL_S].
    trainer_shards: number of trainer shards; a training run's requests all go to
        shard ``crc32(model_id) % trainer_shards`` [OPENRL_TRAINER_SHARDS].
    max_num_samples / max_tokens_limit: per-request sampling limits.
    max_body_bytes: largest accepted request body (bytes).
    """

    long_poll_s: float = float(os.environ.get("OPENRL_LONG_POLL_S", "25"))
    trainer_shards: int = int(os.environ.get("OPENRL_TRAINER_SHARDS", "1"))
    max_num_samples: int = 128
    max_tokens_limit: int = 4096
    max_body_bytes: int = 64 * 1024 * 1024
    fwdbwd_max_chunk_len: int = 1024
    heartbeat_expiry_s: float = 600.0
    k_sink: str | None = os.environ.get("K_SINK")  # Knative SinkBinding: POST request events to the Broker


@dataclass
class Gateway:
    """The shared state handle of the gateway's routes."""

    bus: Bus
    registry: ModelRegistry
    storage: Storage
    settings: GatewaySettings = field(default_factory=GatewaySettings)
    waiter: FutureWaiter | None = None
    _vocab: dict[str, int] = field(default_factory=dict)
    _http: object | None = None

    # ----- identity ---------------------------------------------------------------
    @staticmethod
    def owner_of(api_key: str | None) -> str:
        """A stable, non-reversible owner id for an API key (sha256 prefix)."""
        return hashlib.sha256((api_key or "").encode()).hexdigest()[:16]

    def shard_of(self, model_id: str) -> int:
        """Trainer shard of a training run: crc32(model_id) mod trainer_shards."""
        return zlib.crc32(model_id.encode()) % max(1, self.settings.trainer_shards)

    def vocab_size(self, base_model: str) -> int:
        """Vocabulary size of a registered base model (tokens), read from its config.json."""
        if base_model not in self._vocab:
            entry = self.registry.resolve(base_model)
            cfg = json.loads((Path(entry.path) / "config.json").read_text())
            self._vocab[base_model] = int(cfg["vocab_size"])
        return self._vocab[base_model]

    # ----- records ----------------------------------------------------------------
    async def session(self, session_id: str, owner: str) -> dict:
        """The session record, or NotFound (also for another key's session)."""
        rec = await self.bus.meta_get("session", session_id)
        if rec is None or rec.get("owner") != owner:
            raise NotFound("session_id", f"unknown session {session_id!r}")
        return rec

    async def model(self, model_id: str, owner: str, field_name: str = "model_id") -> dict:
        """The training-run record, or NotFound (also for another key's run)."""
        rec = await self.bus.meta_get("model", model_id)
        if rec is None or rec.get("owner") != owner:
            raise NotFound(field_name, f"unknown training run {model_id!r}")
        return rec

    async def sampler(self, sampler_id: str, owner: str) -> dict:
        rec = await self.bus.meta_get("sampler", sampler_id)
        if rec is None or rec.get("owner") != owner:
            raise NotFound("sampling_session_id", f"unknown sampling session {sampler_id!r}")
        return rec

    # ----- publishing -------------------------------------------------------------
    async def submit(
        self,
        op: str,
        request_id: str,
        subject: str,
        data: dict | bytes,
        *,
        model: dict | None = None,
        future_meta: dict | None = None,
    ) -> bool:
        """Record a pending future and publish its request event.

        A request id that already exists is a retried duplicate: nothing is published
        again and False is returned (the caller answers with the same future).
        """
        created = await self.bus.future_create(request_id, op, meta=future_meta)
        if not created:
            return False
        ext = {}
        if op in events.TRAIN_OPS:
            shard = (model or {}).get("shard", 0)
            ext["trainershard"] = str(shard)
            subject_nats = train_subject(shard, op)
        else:
            subject_nats = sample_subject(op)
        ev = events.request_event(op, request_id, subject, data, extensions=ext)
        headers, body = events.to_headers_body(ev)
        if self.settings.k_sink:
            await self._post_to_sink(headers, body)
        else:
            await self.bus.publish(subject_nats, headers, body, msg_id=request_id)
        return True

    async def _post_to_sink(self, headers: dict[str, str], body: bytes) -> None:
        """Deliver a request event to the Knative Broker (``K_SINK``) in binary mode.

        Raises:
            ServerError: the Broker did not accept the event (the pending future is failed too).
        """
        import httpx

        from openrl.bus import kv_key
        from openrl.errors import ServerError

        if self._http is None:
            self._http = httpx.AsyncClient(timeout=30.0)
        try:
            r = await self._http.post(self.settings.k_sink, headers=headers, content=body)
            ok = r.status_code < 300
        except httpx.HTTPError:
            ok = False
        if not ok:
            # forget the pending future so that the SDK's retry publishes the request again
            await self.bus.futures.delete(kv_key(headers.get("ce-id", "")))
            raise ServerError("the event broker did not accept the request; retry")

    async def touch_model(self, model_id: str, **fields) -> None:
        """Update last_request_time (and other fields) of a training run record."""
        from openrl.bus import now_iso

        def upd(old):
            old = dict(old or {})
            old["last_request_time"] = now_iso()
            old.update(fields)
            return old

        await self.bus.meta_update(upd, "model", model_id)


def require(cond: bool, field_name: str, message: str) -> None:
    """Raise UserError(field_name, message) unless ``cond``."""
    if not cond:
        raise UserError(field_name, message)


async def to_thread(fn, *args):
    return await asyncio.to_thread(fn, *args)
