"""Where events travel: CloudEvent sources, NATS streams and subjects, durable consumers,
KV buckets, and which function consumes which operation.

Every transport reads this module: the bus creates :data:`STREAMS`, the JetStream worker and
the local dispatcher bind :func:`consumer`, the HTTP binding names its results with
:func:`source_of`, the gateway publishes to :func:`subject_for`, and the Knative Triggers test
routes every op of :data:`FUNCTION_OPS`.

| name | kind | holds |
|---|---|---|
| ``OPENRL_TRAIN`` | stream, work-queue, subjects ``openrl.train.<shard>.<op>`` | trainer request events |
| ``OPENRL_SAMPLE`` | stream, work-queue, subjects ``openrl.sample.<op>`` | sampler request events |
| ``OPENRL_FUTURES`` | KV bucket | request id -> :class:`openrl.contract.records.FutureRecord` |
| ``OPENRL_META`` | KV bucket | sessions, training runs, sampling sessions, worker records |
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from openrl.contract.ops import SAMPLE_OPS, TRAIN_OPS, Op

__all__ = [
    "SOURCE_GATEWAY", "SOURCE_TRAINER", "SOURCE_SAMPLER", "source_of",
    "TRAIN_STREAM", "SAMPLE_STREAM", "FUTURES_BUCKET", "META_BUCKET", "STREAMS",
    "TRAINER", "SAMPLER", "FUNCTION_OPS", "function_of_op", "function_of_module",
    "train_subject", "sample_subject", "subject_for", "stream_for", "deadletter_subject",
    "Consumer", "consumer",
]

#: CloudEvent ``source`` of request events (the gateway) and of each function's results.
SOURCE_GATEWAY = "/openrl/gateway"
SOURCE_TRAINER = "/openrl/trainer"
SOURCE_SAMPLER = "/openrl/sampler"

TRAIN_STREAM = "OPENRL_TRAIN"
SAMPLE_STREAM = "OPENRL_SAMPLE"
FUTURES_BUCKET = "OPENRL_FUTURES"
META_BUCKET = "OPENRL_META"

#: Work-queue stream -> the subjects it captures (created by :meth:`openrl.transport.bus.Bus.connect`).
STREAMS: dict[str, list[str]] = {TRAIN_STREAM: ["openrl.train.>"], SAMPLE_STREAM: ["openrl.sample.>"]}

TRAINER = "trainer"
SAMPLER = "sampler"
#: Function name -> the operations it consumes.
FUNCTION_OPS: dict[str, tuple[Op, ...]] = {TRAINER: TRAIN_OPS, SAMPLER: SAMPLE_OPS}


def source_of(function: str) -> str:
    """CloudEvent ``source`` of a function's result events: ``/openrl/<function>``."""
    return f"/openrl/{function}"


def function_of_op(op: str) -> str:
    """The function (``"trainer"`` / ``"sampler"``) that consumes ``op``.

    Raises:
        ValueError: an op no function consumes.
    """
    for name, ops in FUNCTION_OPS.items():
        if op in ops:
            return name
    raise ValueError(f"no function consumes op {op!r}")


def function_of_module(module: str) -> str:
    """The function a Python module serves: its last dotted part (``functions.trainer`` -> ``trainer``).

    Raises:
        ValueError: the module is not one of :data:`FUNCTION_OPS`' functions.
    """
    name = module.rsplit(".", 1)[-1]
    if name not in FUNCTION_OPS:
        raise ValueError(f"no JetStream consumer is defined for {module!r}")
    return name


def train_subject(shard: int | str, op: str) -> str:
    """NATS subject of a trainer request for ``op`` on trainer shard ``shard``."""
    return f"openrl.train.{shard}.{op}"


def sample_subject(op: str = Op.SAMPLE) -> str:
    """NATS subject of a sampler request."""
    return f"openrl.sample.{op}"


def subject_for(op: str, shard: int | str = 0) -> str:
    """NATS subject of a request for ``op`` (``shard``: the run's trainer shard; ignored for samples)."""
    return train_subject(shard, op) if function_of_op(op) == TRAINER else sample_subject(op)


def stream_for(op: str) -> str:
    """The work-queue stream a request for ``op`` travels on."""
    return TRAIN_STREAM if function_of_op(op) == TRAINER else SAMPLE_STREAM


def deadletter_subject(op: str) -> str:
    """Core-NATS subject a request no worker could finish is copied to."""
    return f"openrl.deadletter.{op}"


@dataclass(frozen=True)
class Consumer:
    """The durable JetStream pull consumer of one function (shared by all its replicas).

    Attributes:
        stream: work-queue stream. durable: consumer name (``trainer-<shard>`` / ``sampler``).
        filter_subject: subjects it takes. source: CloudEvent ``source`` of its results.
    """

    stream: str
    durable: str
    filter_subject: str
    source: str

    def as_dict(self) -> dict[str, str]:
        """The fields as keyword arguments (``JetStreamWorker(fn, bus, **c.as_dict())``)."""
        return asdict(self)


def consumer(function: str, shard: int = 0) -> Consumer:
    """The consumer of ``function`` (``"trainer"`` on trainer shard ``shard``, or ``"sampler"``).

    Raises:
        ValueError: an unknown function.
    """
    if function == TRAINER:
        return Consumer(TRAIN_STREAM, f"trainer-{shard}", f"openrl.train.{shard}.>", SOURCE_TRAINER)
    if function == SAMPLER:
        return Consumer(SAMPLE_STREAM, "sampler", "openrl.sample.>", SOURCE_SAMPLER)
    raise ValueError(f"no JetStream consumer is defined for {function!r}")
