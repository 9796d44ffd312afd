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

import math
from typing import Annotated, Any, Callable, ClassVar, TypeVar

import pydantic
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, PrivateAttr, model_validator
from pydantic_core import PydanticCustomError

from openrl.contract.ops import Op
from openrl.errors import UserError

__all__ = [
    "Payload", "LoraConfig", "CreateModel", "Sequenced", "OptimStep", "SaveWeights", "LoadWeights",
    "UnloadModel", "Skip", "SamplingParams", "Sample", "PAYLOADS", "PROTOBUF_OPS", "parse_payload",
    "target_rows",
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


# --------------------------------------------------------------------------- sample
#
# ``sample`` is also the sampler's job: the engine and every backend take a :class:`Sample` as it
# came in the event (``functions.sampler.types.SamplerBackend.sample``). A new sampling parameter
# is a field here, in the wire model (``openrl.edge.wire.SampleRequest``) and in the backend that
# honours it; the static ranges are the field constraints below, what depends on the model or
# the service's caps is :func:`openrl.contract.sample_limits.check_sample_limits`.


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_real(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _invalid(message: str, field: str | None = None) -> PydanticCustomError:
    """A validation error whose text is exactly ``message``; ``field`` names the field for a
    check of the whole model (whose error has no location)."""
    return PydanticCustomError("sample_field", "{message}", {"message": message, **({"field": field} if field else {})})


def _constraint(ok: Callable[[Any], bool], rule: str) -> BeforeValidator:
    """A field constraint: a value for which ``ok`` is false is refused as ``"<rule>, got <value!r>"``
    (bools are never integers or numbers here: ``_is_int`` / ``_is_real``)."""

    def check(v: Any) -> Any:
        if not ok(v):
            raise _invalid(f"{rule}, got {v!r}")
        return v

    return BeforeValidator(check)


def _int_at_least(lo: int, *, optional: bool = False) -> BeforeValidator:
    return _constraint(lambda v: (optional and v is None) or (_is_int(v) and v >= lo), f"must be an integer >= {lo}")


def _check_stop(v: Any) -> Any:
    """``stop``: None, a non-empty string, or a list of non-empty strings or of token ids (not mixed)."""
    if v is None:
        return v
    items = [v] if isinstance(v, str) else v
    if not isinstance(items, (list, tuple)):
        raise _invalid("must be a string, a list of strings or a list of token ids")
    if all(isinstance(s, str) for s in items):
        if any(s == "" for s in items):
            raise _invalid("stop strings must not be empty")
    elif not all(_is_int(s) for s in items):
        raise _invalid("must be all strings or all token ids, not a mix")
    return v


class SamplingParams(Payload):
    """``sampling_params``: how each token is drawn and when a sequence ends. Temperature, top-k
    and top-p change only *which* token is drawn: every logprob the sampler returns is the raw
    model distribution's (temperature 1, unfiltered; ``functions.sampler.types``)."""

    model_config = ConfigDict(revalidate_instances="always")  # parse() checks a Sample built in Python again

    max_tokens: Annotated[int | None, _int_at_least(1, optional=True)] = None
    """Most tokens generated per sequence (>= 1; prompt + max_tokens must fit the context). None =
    until a stop or the end of the context, capped by the engine's ``max_tokens_default`` when set
    (no hidden short default: the gateway sends ``min(OPENRL_SAMPLER_MAX_TOKENS_CAP, context - P)``
    for a request that omits it). The engine's validated copy always holds an int."""
    temperature: Annotated[float, _constraint(lambda v: _is_real(v) and v >= 0, "must be a finite number >= 0")] = 1.0
    """Finite, >= 0; 0 = greedy (argmax)."""
    top_p: Annotated[float, _constraint(lambda v: _is_real(v) and 0 < v <= 1, "must be in (0, 1]")] = 1.0
    """Nucleus mass in (0, 1]; 1 = no nucleus filtering."""
    top_k: Annotated[int, _constraint(lambda v: _is_int(v) and v >= -1,
                                      "must be -1 (no limit) or a positive integer")] = -1
    """Keep the k most likely tokens; -1 (or 0) = no limit."""
    seed: Annotated[int | None, _constraint(lambda v: v is None or _is_int(v), "must be an integer")] = None
    """Sequence ``i`` of a request with seed ``s`` is drawn from a generator seeded by ``(s, i)``
    only, so the same seed gives the same samples whatever else is batched with it. None = a
    fresh random seed."""
    stop: Annotated[str | list[str] | list[int] | None, BeforeValidator(_check_stop)] = None
    """None = stop at EOS; ``[]`` = never stop (only ``max_tokens``); token ids or non-empty
    strings (a bare string counts as a one-element list; not mixed) = stop at any of them or at
    EOS. The returned tokens include the stop token / the token completing a stop string
    (``functions/sampler/stops.py``). Ids must be in the vocabulary and strings need the model's
    tokenizer (:func:`~openrl.contract.sample_limits.check_sample_limits`). The engine's validated
    copy holds :attr:`stop_list`."""

    @property
    def stop_list(self) -> list[str] | list[int] | None:
        """``stop`` as a list (a bare string as a one-element list); None stays None."""
        return [self.stop] if isinstance(self.stop, str) else self.stop


class Sample(Payload):
    """``sample`` (request id ``<sampling_session_id>:<seq_id>``; also compute_logprobs, a sample
    with ``prompt_logprobs``), and the sampler's job. The sampler is stateless, so the event names
    the base model and the immutable ``tinker://`` snapshot (``model_path``, None = the base model
    alone).

    :meth:`parse` refuses a value outside a field's range with a ``UserError`` naming the field as
    the client sees it (``prompt.chunks``, ``num_samples``, ``sampling_params.<name>``,
    ``topk_prompt_logprobs``, ...); what depends on the model is
    :func:`openrl.contract.sample_limits.check_sample_limits`'s.
    """

    model_config = ConfigDict(revalidate_instances="always")  # parse() checks a Sample built in Python again

    op: ClassVar[Op] = Op.SAMPLE
    prompt_tokens: list[Annotated[int, Field(strict=True)]]
    """The prompt's token ids (the ``encoded_text`` chunks concatenated), P >= 1 of them, each in the
    vocabulary."""
    base_model: str
    """The registered base model (the sampler picks its engine by it; backends ignore it)."""
    model_path: str | None = None
    """The ``tinker://`` snapshot sampled, None = the base model alone. The sampler's job carries the
    snapshot's normalised path, which is its adapter key (``SamplerEngine.ensure_adapter``)."""
    num_samples: Annotated[int, _int_at_least(1)] = 1
    """Independent sequences drawn from the prompt (>= 1, at most the service's cap)."""
    sampling_params: SamplingParams = SamplingParams()
    sampling_session_id: str | None = None
    seq_id: int | None = None
    prompt_logprobs: bool = False
    """Return the prompt's logprobs (``SampleResult.prompt_logprobs``)."""
    topk_prompt_logprobs: Annotated[int, _int_at_least(0)] = 0
    """K >= 0 (at most the sampler's ``max_topk``): the top-K (id, logprob) at every prompt position."""
    topk_sample_logprobs: Annotated[int, _int_at_least(0)] = 0
    """K >= 0 (at most ``max_topk``): the top-K (id, logprob) at every sampled position."""
    prompt_logprobs_last_n: Annotated[int | None, _int_at_least(1, optional=True)] = None
    """Score only the last N prompt positions (1 <= N <= P-1; needs ``prompt_logprobs``): earlier
    positions are NaN (prompt logprobs) / empty (top-k rows)."""
    target_prompt_logprobs: dict[str, Any] | None = None
    """Token ids to score at each prompt position: a JSON TensorData (``data``, ``dtype``, ``shape``,
    optional ``sparse_crow_indices`` / ``sparse_col_indices``) of int64 ids ``[len(prompt) - 1, K]``,
    -1 = unused cell; row ``i`` names ids scored at position ``i+1``. Decoded as
    :attr:`target_prompt_ids`."""
    prompt_alt_tokens_k: Annotated[int, _int_at_least(0)] = 0
    """k >= 0 (at most ``max_topk``): draw k tokens at every prompt position after the first, at the
    request's temperature."""
    record_stability_info: bool = False
    """Record each returned sequence (tokens, logprobs) for ``stable_reinforce`` training."""

    _target_rows: list[list[int]] | None = PrivateAttr(None)

    @model_validator(mode="after")
    def _decode_targets(self) -> "Sample":
        self._target_rows = None
        if self.target_prompt_logprobs:
            try:
                self._target_rows = target_rows(self.target_prompt_logprobs)
            except UserError as exc:
                raise _invalid(exc.message.removeprefix(f"{exc.field}: "), field=exc.field) from None
        return self

    @property
    def target_prompt_ids(self) -> list[list[int]] | None:
        """``target_prompt_logprobs`` decoded at validation: ``[P-1][K]`` ids (-1 = unused cell), or
        None when not asked for."""
        return self._target_rows

    @classmethod
    def parse(cls, data: dict[str, Any] | Sample) -> Sample:
        """Validate an event's JSON data, or validate again a ``Sample`` built or changed in Python
        (``model_construct``, ``model_copy(update=...)``: the field constraints hold after this).

        Raises:
            UserError: a field missing, of the wrong type or out of its range, named as the client
                sees it: ``prompt.chunks`` (the prompt), ``sampling_params.<name>``,
                ``target_prompt_logprobs`` (a tensor that does not decode), else the field's name.
        """
        try:
            return cls.model_validate(data)
        except pydantic.ValidationError as exc:
            err = exc.errors()[0]
            raise UserError(_client_field(err), err.get("msg", "invalid")) from None


def _client_field(err: Any) -> str:
    """The field a ``Sample`` validation error names, as the client sees it."""
    named = (err.get("ctx") or {}).get("field")
    if named:
        return named
    loc = [str(p) for p in err.get("loc", ())]
    if not loc:
        return "data"
    if loc[0] == "prompt_tokens":
        return "prompt.chunks"
    if loc[0] == "sampling_params" and len(loc) > 1:
        return f"sampling_params.{loc[1]}"
    return loc[0]


def target_rows(td: dict[str, Any]) -> list[list[int]]:
    """A JSON TensorData of int64 target ids ``[P-1, K]`` (dense or CSR, -1 = unused) as rows.

    Raises:
        UserError: ``target_prompt_logprobs``: the tensor is not 2-D, its values are not integers,
            or its CSR indices do not fit its shape.
    """
    shape = td.get("shape") or []
    if len(shape) != 2:
        raise UserError("target_prompt_logprobs", f"expected shape [len(prompt)-1, K], got {shape}")
    try:
        rows, k = int(shape[0]), int(shape[1])
        data = [int(x) for x in td.get("data") or []]
    except (TypeError, ValueError, OverflowError):
        raise UserError("target_prompt_logprobs", "the shape and the ids must be integers") from None
    if td.get("sparse_crow_indices") is not None:
        crow, col = td["sparse_crow_indices"], td.get("sparse_col_indices") or []
        if len(crow) != rows + 1 or len(col) != len(data) or (col and max(col) >= k):
            raise UserError("target_prompt_logprobs", "CSR indices do not match the shape")
        dense = [[-1] * k for _ in range(rows)]
        for r in range(rows):
            for j in range(crow[r], crow[r + 1]):
                dense[r][col[j]] = data[j]
        return dense
    if len(data) != rows * k:
        raise UserError("target_prompt_logprobs", f"{len(data)} values for shape {shape}")
    return [data[r * k:(r + 1) * k] for r in range(rows)]


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
