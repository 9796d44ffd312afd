"""The Tinker operations a request CloudEvent can carry (``dev.openrl.<op>.v1``)."""

from __future__ import annotations

from enum import StrEnum

__all__ = ["Op", "TRAIN_OPS", "SAMPLE_OPS", "SEQUENCED_OPS"]


class Op(StrEnum):
    """One Tinker operation. A member *is* its string (``Op.SAMPLE == "sample"``), so it can
    be used wherever an op name is expected (CloudEvent types, NATS subjects, metrics labels)."""

    CREATE_MODEL = "create_model"
    FORWARD_BACKWARD = "forward_backward"
    FORWARD = "forward"
    OPTIM_STEP = "optim_step"
    SAVE_WEIGHTS = "save_weights"
    SAVE_WEIGHTS_FOR_SAMPLER = "save_weights_for_sampler"
    SAVE_WEIGHTS_EXTERNAL = "save_weights_external"
    LOAD_WEIGHTS = "load_weights"
    UNLOAD_MODEL = "unload_model"
    SKIP = "skip"  # a seq_id the gateway rejected at the edge: the trainer moves past it
    SAMPLE = "sample"


#: Operations the trainer consumes (one training run's requests go to one trainer shard).
TRAIN_OPS: tuple[Op, ...] = (
    Op.CREATE_MODEL,
    Op.FORWARD_BACKWARD,
    Op.FORWARD,
    Op.OPTIM_STEP,
    Op.SAVE_WEIGHTS,
    Op.SAVE_WEIGHTS_FOR_SAMPLER,
    Op.SAVE_WEIGHTS_EXTERNAL,
    Op.LOAD_WEIGHTS,
    Op.UNLOAD_MODEL,
    Op.SKIP,
)
#: Operations the sampler consumes.
SAMPLE_OPS: tuple[Op, ...] = (Op.SAMPLE,)
#: Training operations that hold a ``seq_id`` >= 1 of their run (run in seq_id order; a dead
#: one is skipped). Creation (seq 0), unload and skip itself do not.
SEQUENCED_OPS: tuple[Op, ...] = tuple(o for o in TRAIN_OPS if o not in (Op.CREATE_MODEL, Op.UNLOAD_MODEL, Op.SKIP))
