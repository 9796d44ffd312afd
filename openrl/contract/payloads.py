"""What each request CloudEvent carries: one pydantic model per operation's ``data``.

The gateway builds these models and publishes :meth:`Payload.to_data`; the trainer and
sampler receive them with :func:`parse_payload`. They are internal types, kept apart from the
Tinker HTTP types in :mod:`openrl.edge.wire` (the gateway validates those at the edge).

``forward`` / ``forward_backward`` events are the exception: their data is the SDK's protobuf
``ForwardBackwardRequest`` body as bytes (``application/x-protobuf``, decompressed), published
unchanged; :func:`openrl.edge.proto.decode_forward_backward_request` turns it into a
:class:`openrl.edge.proto.FwdBwdRequest`. No JSON model exists for them.

| op | data |
|---|---|
| ``create_model`` | :class:`CreateModel` |
| ``forward`` / ``forward_backward`` | protobuf bytes (see above) |
| ``optim_step`` | :class:`OptimStep` |
| ``save_weights`` / ``save_weights_for_sampler`` / ``save_weights_external`` | :class:`SaveWeights` |
| ``load_weights`` | :class:`LoadWeights` (``create=True``: a new run from a checkpoint, seq 0) |
| ``unload_model`` | :class:`UnloadModel` |
| ``skip`` | :class:`Skip` |
| ``sample`` | :class:`Sample` |
"""

from __future__ import annotations

from typing import Any, ClassVar, TypeVar

import pydantic
from pydantic import BaseModel, ConfigDict

from openrl.contract.ops import Op
from openrl.errors import UserError

__all__ = [
    "Payload", "LoraConfig", "CreateModel", "Sequenced", "OptimStep", "SaveWeights", "LoadWeights",
    "UnloadModel", "Skip", "SamplingParams", "Sample", "PAYLOADS", "PROTOBUF_OPS", "parse_payload",
]

P = TypeVar("P", bound="Payload")


class Payload(BaseModel):
    """Base of every JSON event payload. Unknown keys are ignored (an older or newer gateway
    may send more); missing optional keys take the defaults below."""

    model_config = ConfigDict(extra="ignore", protected_namespaces=())

    def to_data(self) -> dict[str, Any]:
        """The event's JSON data: the fields the producer set (explicit ``None`` included),
        nothing else, so the handler's defaults fill in the rest."""
        return self.model_dump(mode="json", exclude_unset=True)

    @classmethod
    def parse(cls: type[P], data: dict[str, Any]) -> P:
        """Validate an event's JSON data.

        Raises:
            UserError: a field is missing or has the wrong type (named as ``data.<field>``).
        """
        try:
            return cls.model_validate(data)
        except pydantic.ValidationError as exc:
            err = exc.errors()[0]
            where = ".".join(str(p) for p in err.get("loc", ())) or "data"
            raise UserError(f"data.{where}", err.get("msg", "invalid")) from None


class LoraConfig(Payload):
    """The LoRA adapter of a run: ``rank`` (1-512), ``seed`` (None = random init), and which
    layer groups get adapters."""

    rank: int = 32
    seed: int | None = None
    train_attn: bool = True
    train_mlp: bool = True
    train_unembed: bool = True
    #: LoRA alpha (the delta is scaled by alpha / rank); None: Tinker's 32. Set only for runs
    #: continued from an imported adapter (its ``lora_alpha``); the SDK has no such field.
    alpha: float | None = None


class CreateModel(Payload):
    """``create_model`` (request id ``<model_id>:0``): a new run with a fresh adapter."""

    op: ClassVar[Op] = Op.CREATE_MODEL
    model_id: str
    base_model: str
    lora_config: LoraConfig = LoraConfig()
    optimizer_config: dict[str, Any] | None = None
    """``{"type": "adamw"}``: the only optimizer the gateway admits."""


class Sequenced(Payload):
    """A training request that holds ``seq_id`` of run ``model_id`` (request id ``<model_id>:<seq_id>``)."""

    model_id: str | None = None
    seq_id: int


class OptimStep(Sequenced):
    """``optim_step``: one AdamW step; ``adam_params`` keys as :class:`openrl.edge.wire.AdamParams`
    (``learning_rate``, ``beta1``, ``beta2``, ``eps``, ``weight_decay``, ``grad_clip_norm``)."""

    op: ClassVar[Op] = Op.OPTIM_STEP
    adam_params: dict[str, float] = {}


class SaveWeights(Sequenced):
    """``save_weights`` (adapter + optimizer state), ``save_weights_for_sampler`` (a sampler
    snapshot; ``sampling_session_id`` when the save also made a sampling session) and
    ``save_weights_external`` (the PEFT adapter, downloadable).

    ``path`` is the checkpoint's ``tinker://<run>/<kind>/<name>``; ``owner`` the owner id of
    the caller's key (written into the manifest); ``ttl_seconds`` None = never expires.
    """

    path: str
    ttl_seconds: int | None = None
    owner: str = ""
    sampling_session_id: str | None = None
    #: the save's ``user_metadata`` (``save_state`` / ``save_weights_for_sampler``), kept in the
    #: manifest: listings show it and ``search_checkpoints`` filters by it
    user_metadata: dict[str, str] | None = None


class LoadWeights(Sequenced):
    """``load_weights``: in place (``create=False``, the run's seq_id 1) or create-via-load
    (``create=True``, seq_id 0, with the new run's ``base_model`` / ``lora_config`` /
    ``optimizer_config``). ``optimizer``: also load the AdamW state."""

    op: ClassVar[Op] = Op.LOAD_WEIGHTS
    path: str
    optimizer: bool = False
    create: bool = False
    base_model: str | None = None
    lora_config: LoraConfig = LoraConfig()
    optimizer_config: dict[str, Any] | None = None


class UnloadModel(Payload):
    """``unload_model`` (request id ``<model_id>:unload``): drop the run and its stored state."""

    op: ClassVar[Op] = Op.UNLOAD_MODEL
    model_id: str | None = None
    seq_id: None = None


class Skip(Sequenced):
    """``skip`` (request id ``<model_id>:<seq_id>:skip``): a seq_id answered at the edge (4xx) or
    dead-lettered, which will never come; the trainer moves the run's cursor past it."""

    op: ClassVar[Op] = Op.SKIP


class SamplingParams(Payload):
    """``sampling_params``. ``stop``: None keeps EOS stopping; ``[]`` disables every stop token;
    else strings or token ids. ``max_tokens`` None = up to the context; ``top_k`` -1 = no limit."""

    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    stop: str | list[str] | list[int] | None = None


class Sample(Payload):
    """``sample`` (request id ``<sampling_session_id>:<seq_id>``; also compute_logprobs, a sample
    with ``prompt_logprobs``). The sampler is stateless, so the event names the base model and
    the immutable ``tinker://`` snapshot (``model_path``, None = the base model alone).

    ``target_prompt_logprobs`` is a JSON TensorData (``data``, ``dtype``, ``shape``, optional
    ``sparse_crow_indices`` / ``sparse_col_indices``) of int64 ids ``[len(prompt) - 1, K]``.
    """

    op: ClassVar[Op] = Op.SAMPLE
    prompt_tokens: list[int]
    base_model: str
    model_path: str | None = None
    num_samples: int = 1
    sampling_params: SamplingParams = SamplingParams()
    sampling_session_id: str | None = None
    seq_id: int | None = None
    prompt_logprobs: bool = False
    topk_prompt_logprobs: int = 0
    topk_sample_logprobs: int = 0
    prompt_logprobs_last_n: int | None = None
    target_prompt_logprobs: dict[str, Any] | None = None
    prompt_alt_tokens_k: int = 0
    record_stability_info: bool = False


#: Operations whose data is protobuf bytes, not a JSON payload.
PROTOBUF_OPS: tuple[Op, ...] = (Op.FORWARD_BACKWARD, Op.FORWARD)

#: The payload model of each JSON operation.
PAYLOADS: dict[Op, type[Payload]] = {
    Op.CREATE_MODEL: CreateModel,
    Op.OPTIM_STEP: OptimStep,
    Op.SAVE_WEIGHTS: SaveWeights,
    Op.SAVE_WEIGHTS_FOR_SAMPLER: SaveWeights,
    Op.SAVE_WEIGHTS_EXTERNAL: SaveWeights,
    Op.LOAD_WEIGHTS: LoadWeights,
    Op.UNLOAD_MODEL: UnloadModel,
    Op.SKIP: Skip,
    Op.SAMPLE: Sample,
}


def parse_payload(op: str, data: dict[str, Any]) -> Payload:
    """The payload model of a JSON request event of operation ``op``.

    Raises:
        UserError: ``op`` has no JSON payload, or ``data`` does not fit its model.
    """
    model = PAYLOADS.get(op)  # type: ignore[call-overload]
    if model is None:
        raise UserError("type", f"unsupported operation {op!r}")
    return model.parse(data)
