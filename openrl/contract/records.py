"""What the JetStream KV buckets hold (see :mod:`openrl.contract.topology`).

``OPENRL_FUTURES`` holds one :class:`FutureRecord` per request id (a JSON head line, then the
result bytes). ``OPENRL_META`` holds JSON records, keyed by
``openrl.transport.bus.kv_key(kind, id)``: :class:`Session` (``session``),
:class:`TrainingRun` (``model``), :class:`SamplerSession` (``sampler``), :class:`Upload`
(``upload``), :class:`CopiedWeights` (``copy``, owner, idempotency key) and
:class:`DownloadSecret` (``config``, ``download_secret``), :class:`WorkerRecord` (``workers``,
function, shard, instance). Checkpoints carry a
:class:`CheckpointManifest` (``manifest.json`` in storage) and a trainer's flushed run state a
:class:`RunStateInfo` (the ``_runstate/<run>/HEAD.json`` pointer's info).

The JSON records are pydantic models that keep unknown keys (``extra="allow"``), so a record
written by a newer gateway survives a read-modify-write by an older one; :meth:`Record.to_record`
gives the dict to store.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field

__all__ = [
    "FutureRecord", "FutureMeta", "Record", "Session", "TrainingRun", "SamplerSession",
    "CheckpointManifest", "RunStateInfo", "Upload", "CopiedWeights", "DownloadSecret",
    "WorkerRecord", "LoraConfig",
]


@dataclass
class FutureRecord:
    """What ``OPENRL_FUTURES`` holds for one request id.

    ``state`` is ``pending`` until a function answers, then ``ok`` or ``error``.
    ``content_type`` and ``body`` are the result event's data (protobuf or JSON bytes).
    ``meta`` (see :class:`FutureMeta`): who asked and when.

    Encoded as one JSON line ``{state, op, content_type, meta}``, ``\\n``, then ``body``.
    """

    state: str
    op: str = ""
    content_type: str = "application/json"
    body: bytes = b""
    meta: dict | None = None

    def encode(self) -> bytes:
        """The KV value: JSON head line + ``\\n`` + body bytes."""
        head = json.dumps(
            {"state": self.state, "op": self.op, "content_type": self.content_type, "meta": self.meta or {}}
        ).encode()
        return head + b"\n" + self.body

    @classmethod
    def decode(cls, raw: bytes) -> "FutureRecord":
        """Inverse of :meth:`encode`.

        Raises:
            json.JSONDecodeError / KeyError: not a future record.
        """
        head, _, body = raw.partition(b"\n")
        h = json.loads(head)
        return cls(state=h["state"], op=h.get("op", ""), content_type=h["content_type"], body=body, meta=h.get("meta"))

    @property
    def info(self) -> "FutureMeta":
        """``meta`` as a :class:`FutureMeta` (all fields None when no meta was stored)."""
        return FutureMeta.model_validate(self.meta or {})


R = TypeVar("R", bound="Record")


class Record(BaseModel):
    """Base of the JSON KV records: unknown keys are kept."""

    model_config = ConfigDict(extra="allow", protected_namespaces=())

    def to_record(self) -> dict[str, Any]:
        """The JSON dict to store."""
        return self.model_dump(mode="json")

    def stored(self) -> dict[str, Any]:
        """The JSON dict to write back after a read-modify-write: the keys that were read (unknown
        ones too) plus the fields assigned since, and no defaults that were not stored
        (``model_dump(mode="json", exclude_unset=True)``). Assign a field (never mutate it in
        place) for the change to be kept."""
        return self.model_dump(mode="json", exclude_unset=True)

    @classmethod
    def load(cls: type[R], data: dict[str, Any] | None) -> R | None:
        """A stored JSON dict as this model; None for None (no record).

        Raises:
            pydantic.ValidationError: the dict is not such a record.
        """
        return None if data is None else cls.model_validate(data)

    @classmethod
    def make(cls, **fields: Any) -> dict[str, Any]:
        """A new record's JSON dict: ``fields`` validated as this model, then exactly the
        keys given (``model_dump(mode="json", exclude_unset=True)``; defaults are not
        added, so the stored JSON is what the caller wrote).

        Raises:
            pydantic.ValidationError: a missing required field or a value of the wrong type.
        """
        return cls(**fields).model_dump(mode="json", exclude_unset=True)


class FutureMeta(Record):
    """``FutureRecord.meta``: ``owner`` (owner id of the caller's key), ``t0`` (unix s the
    gateway accepted the request), ``ts`` (unix s a worker took it up), ``t1`` (unix s the
    result was stored)."""

    owner: str | None = None
    t0: float | None = None
    ts: float | None = None
    t1: float | None = None


class LoraConfig(Record):
    """The LoRA config a record holds (``lora_config`` of a run, checkpoint or upload), as the
    request gave it or an imported adapter declared it; other keys (``alpha``, ...) are kept.
    An absent key reads as None."""

    rank: int | None = None
    seed: int | None = None
    train_unembed: bool | None = None
    train_mlp: bool | None = None
    train_attn: bool | None = None


class Session(Record):
    """A client session (``create_session``); ``status`` becomes ``finished`` on finish."""

    session_id: str
    owner: str
    tags: list[str] = []
    user_metadata: dict[str, Any] = {}
    display_name: str | None = None
    project_id: str | None = None
    sdk_version: str | None = None
    created: str
    last_heartbeat: str | None = None
    status: Literal["active", "finished"] = "active"
    finish_reason: str | None = None
    training_run_ids: list[str] = []
    sampler_ids: list[str] = []


class TrainingRun(Record):
    """A training run (``create_model``, create-via-load, or ``copy_weights`` with ``frozen``).

    ``model_id`` is ``<session_id>:train:<model_seq_id>``; ``shard`` the trainer shard
    (crc32(model_id) mod shards); times are ISO-8601 UTC.
    """

    model_id: str
    session_id: str
    owner: str
    base_model: str | None
    lora_config: LoraConfig = Field(default_factory=LoraConfig)
    optimizer_config: dict[str, Any] | None = None
    tokenizer_id: str | None = None
    shard: int = 0
    created: str
    last_request_time: str | None = None
    user_metadata: dict[str, Any] = {}
    frozen: bool = False
    copy_of: str | None = None
    #: ``"server"`` once a request came without ``seq_id``: the gateway numbers this run's
    #: requests (``next_seq_id`` is the next number); None: its client numbers them (the SDK)
    seq_numbering: str | None = None
    next_seq_id: int | None = None


class SamplerSession(Record):
    """A sampling session: base model plus an optional immutable snapshot (``model_path``)."""

    sampler_id: str
    owner: str
    base_model: str
    model_path: str | None = None
    session_id: str
    created: str


class CheckpointManifest(Record):
    """``manifest.json`` of a checkpoint (:func:`openrl.storage.build_manifest`): files with
    size and sha256, owner, ttl, and the run's metadata at save time.

    Optional keys some manifests carry: ``user_metadata`` (the save request's), ``encryption``
    (``{scheme: "age", recipients}``, :mod:`openrl.storage.sealing`), ``lora_rank`` (older
    manifests without ``lora_config``), ``copied_from`` (``copy_weights``) and
    ``imported_from`` (an uploaded adapter)."""

    tinker_path: str
    checkpoint_id: str | None = None
    checkpoint_type: str | None = None
    training_run_id: str | None = None
    created_unix: float | None = None
    time: str | None = None
    ttl_seconds: int | None = None
    expires_unix: float | None = None
    owner: str = ""
    public: bool = False
    size_bytes: int = 0
    files: dict[str, dict[str, Any]] = {}
    base_model: str | None = None
    lora_config: LoraConfig | None = None
    optimizer_config: dict[str, Any] | None = None
    seq_id: int | None = None
    user_metadata: dict[str, Any] | None = None
    encryption: dict[str, Any] | None = None
    lora_rank: int | None = None
    copied_from: str | None = None
    imported_from: str | None = None


class RunStateInfo(Record):
    """A trainer's flushed run state (:mod:`functions.trainer.durable`): the run's metadata and
    its seq_id ``cursor`` (every request below it applied); ``final`` when flushed by a clean stop."""

    model_id: str | None = None
    cursor: int = 1
    final: bool = False
    base_model: str | None = None
    lora_config: dict[str, Any] | None = None
    optimizer_config: dict[str, Any] | None = None
    flushed_unix: float | None = None
    flushed_by: str | None = None


class Upload(Record):
    """An adapter upload (``external_weights_upload_start``; :mod:`functions.gateway.routes_imports`):
    ``expires_unix`` ends its signed upload URLs; ``tinker_path`` and ``finished`` are set when
    ``external_weights_upload_finish`` stored the checkpoint."""

    upload_id: str
    owner: str
    base_model: str
    lora_config: LoraConfig = Field(default_factory=LoraConfig)
    destination_project_id: str | None = None
    created: str
    expires_unix: int | None = None
    tinker_path: str | None = None
    finished: str | None = None


class CopiedWeights(Record):
    """What a ``copy_weights`` with an idempotency key made (a retry answers the same path)."""

    tinker_path: str
    created: str


class DownloadSecret(Record):
    """The HMAC key of the gateway's signed URLs, when ``OPENRL_DOWNLOAD_SECRET`` is not set
    (made by the first replica that needs it)."""

    secret: str


class WorkerRecord(Record):
    """A worker's presence record (:class:`openrl.transport.worker.WorkerPresence`): what it
    serves, where it runs, what its Function describes (``device``, ``dtype``, ``backend``,
    ``models_failed``, ``details``; as the Function reports them), and when it was refreshed."""

    function: str
    shard: int | None = None
    instance: str | None = None
    pid: int | None = None
    host: str | None = None
    device: Any = None
    dtype: Any = None
    backend: Any = None
    models_failed: Any = None
    details: Any = None
    #: the idle-sleep state (:meth:`openrl.transport.bindings.idle_sleep.IdleSleep.describe`:
    #: ``state``, ``since_unix``, ``sleeps``, ``wakes``, ``last_wake_s``, ``error``); None when the
    #: worker does not sleep (``sleep_after`` 0, or a Function without ``sleep()``)
    sleep: Any = None
    started: str | None = None
    updated: str | None = None
    updated_unix: float | None = None
    refresh_s: float | None = None
