"""Training-run records and checkpoint reads that several route modules share.

A training run is a record in the ``OPENRL_META`` bucket (key ``model.<model_id>``), made by
``create_model``, create-via-load (``load_weights`` with ``session_id``) or ``copy_weights``;
its id is fixed by the SDK: ``<session_id>:train:<model_seq_id>``.
"""

from __future__ import annotations

from functions.gateway.context import Gateway
from openrl.contract.records import CheckpointManifest, Session, TrainingRun
from openrl.errors import NotFound, NotSupported, UserError
from openrl.storage import TinkerPath
from openrl.transport.bus import now_iso


def model_id_for(session_id: str, model_seq_id: int) -> str:
    """Training-run id, fixed by the SDK: ``<session_id>:train:<model_seq_id>``."""
    return f"{session_id}:train:{model_seq_id}"


async def add_to_session(g: Gateway, session_id: str, key: str, item: str) -> None:
    """Append ``item`` to the list ``key`` (``training_run_ids`` / ``sampler_ids``) of a
    session record (compare-and-set: concurrent appends and heartbeats are kept)."""

    def add(rec: Session) -> None:
        setattr(rec, key, [*getattr(rec, key), item])

    await g.update_session(session_id, add)


async def new_run(g: Gateway, owner: str, session_id: str, model_seq_id: int, base_model: str, lora: dict,
                  extra: dict) -> TrainingRun:
    """Create the record of run ``<session_id>:train:<model_seq_id>`` in the caller's session,
    or return the existing one (a retried create).

    Args:
        owner: the caller's owner id. lora: the LoRA config dict. extra: more record fields
            (``optimizer_config``, ``user_metadata``).

    Raises:
        NotFound: ``session_id`` is not the caller's. UserError: unknown ``base_model``.
    """
    await g.session(session_id, owner)
    entry = g.registry.resolve(base_model)
    model_id = model_id_for(session_id, model_seq_id)
    rec = TrainingRun(**{
        "model_id": model_id,
        "session_id": session_id,
        "owner": owner,
        "base_model": base_model,
        "lora_config": lora,
        "tokenizer_id": entry.tokenizer_id,
        "shard": g.shard_of(model_id),
        "created": now_iso(),
        "last_request_time": now_iso(),
        **extra,
    })
    if await g.bus.meta_create(rec.stored(), "model", model_id):
        await add_to_session(g, session_id, "training_run_ids", model_id)
        return rec
    return await g.model(model_id, owner)


def refuse_frozen(rec: TrainingRun) -> None:
    """Training calls on a run made by copy_weights (:mod:`functions.gateway.routes_copy`) are refused.

    Raises:
        UserError: naming ``model_id``.
    """
    if rec.frozen:
        raise UserError("model_id", f"training run {rec.model_id!r} holds a copy made by copy_weights "
                        f"(of {rec.copy_of}) and cannot be trained on; create_training_client_from_state "
                        "from the copy's path trains a new run from it")


def check_optimizer(opt: dict, field_name: str = "optimizer_config") -> None:
    """Only AdamW is implemented; anything else is refused when the run is created.

    Raises:
        NotSupported: ``opt["type"]`` is not ``"adamw"`` (e.g. ``"dimuon"``).
    """
    kind = (opt or {}).get("type", "adamw")
    if kind != "adamw":
        raise NotSupported(field_name, f"optimizer {kind!r}; this server trains with AdamW only "
                                       "(create the training client without optimizer_config, or with type 'adamw')")


def checkpoint_path(model_id: str, kind: str, name: str) -> str:
    """``tinker://<model_id>/<kind>/<name>``, checked.

    Raises:
        UserError: naming ``path``.
    """
    return str(TinkerPath.parse(f"tinker://{model_id}/{kind}/{name}", field="path"))


async def readable_manifest(g: Gateway, ckpt: TinkerPath, owner: str, field_name: str = "path") -> CheckpointManifest:
    """The manifest of a checkpoint ``owner`` may read (its own, or a published one).

    Raises:
        NotFound: naming ``field_name`` (also for another key's private checkpoint).
    """
    m = await g.manifest(ckpt)
    if m is None or (m.owner != owner and not m.public):
        raise NotFound(field_name, f"no checkpoint at {ckpt}")
    return m
