"""Request bodies the tinker 0.38.0 SDK sends (dumped with ``exclude_none=True``).

Every model refuses an unknown field, naming it (the SDK's own request types forbid extra
fields, so it never sends one), and never requires ``type``.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, field_validator, model_validator

from ._base import FieldError, WireModel
from .common import AdamwConfig, Finite, ModelInput, NonNegInt, LoraConfig, OptimizerConfig, PosInt, TensorData

__all__ = [
    "ClientConfigRequest", "CreateSessionRequest", "SessionHeartbeatRequest", "FinishReason",
    "SessionFinishRequest", "TelemetryRequest", "RetrieveFutureRequest", "RetrieveFuturesRequest",
    "CancelFutureRequest", "JoinSamplingSessionRequest", "CreateModelRequest", "GetInfoRequest",
    "AdamParams", "DimuonParams", "OptimStepRequest", "DatumJson", "ForwardBackwardInputJson",
    "ForwardBackwardJsonRequest", "ForwardJsonRequest", "SaveWeightsRequest",
    "SaveWeightsForSamplerRequest", "SaveWeightsExternalRequest", "LoadWeightsRequest",
    "UnloadModelRequest", "CreateSamplingSessionRequest", "SamplingParams", "SampleRequest",
    "WeightsInfoRequest", "TtlRequest", "CopyWeightsRequest", "SetSessionProjectRequest",
    "SessionSearchRequest", "SearchOwner", "SessionStatusQuery", "ExternalWeightsUploadStartRequest", "ExternalWeightsUploadFinishRequest",
    "CheckpointSearchCursor", "CheckpointSearchRequest",
]

TtlSeconds = Annotated[int, Field(gt=0)]


def _check_name(v: str | None) -> str | None:
    """A checkpoint name becomes the last part of ``tinker://run/kind/<name>``."""
    if v is None:
        return v
    if v in ("", ".", "..") or any(c in v for c in "/\\\x00"):
        raise ValueError("must be a non-empty name without '/', '\\\\' or NUL, and not '.' or '..'")
    return v


# ---- bootstrap / session -------------------------------------------------------------


class ClientConfigRequest(WireModel):
    """``/client/config`` and ``/client/dynamic_config``: ``{sdk_version}``."""

    sdk_version: str = ""


class CreateSessionRequest(WireModel):
    """``/create_session``."""

    type: Literal["create_session"] | None = None  # the SDK's discriminator; never required
    tags: list[str] = []
    user_metadata: dict[str, Any] | None = None
    sdk_version: str = ""
    project_id: str | None = None
    display_name: str | None = None


class SessionHeartbeatRequest(WireModel):
    """``/session_heartbeat``."""

    type: Literal["session_heartbeat"] | None = None  # the SDK's discriminator; never required
    session_id: str


class FinishReason(WireModel):
    """``reason`` of a session finish: ``{type}``."""

    type: Literal["success", "errored", "interrupted"] = "success"


class SessionFinishRequest(WireModel):
    """``/sessions/{id}/finish``: ``{reason: {type}, detail}``."""

    reason: FinishReason = FinishReason()
    detail: str | None = None


class TelemetryRequest(WireModel):
    """``/telemetry``; events are kept as raw dicts (the server may drop them)."""

    events: list[dict[str, Any]] = []
    platform: str | None = None
    sdk_version: str | None = None
    session_id: str | None = None
    process_uuid: str | None = None


class RetrieveFutureRequest(WireModel):
    """``/retrieve_future``."""

    request_id: str
    allow_metadata_only: bool = False


class RetrieveFuturesRequest(WireModel):
    """``/retrieve_futures`` (only with ``sample_use_retrieve_futures``)."""

    target: dict[str, Any] = {}
    prev_cursor: int = 0
    timeout: float | None = None
    retrieved_request_ids: list[str] = []


class CancelFutureRequest(WireModel):
    """``/cancel_future`` (only with dynamic ``sample_cancel_enabled``)."""

    request_id: str


class JoinSamplingSessionRequest(WireModel):
    """``/join_sampling_session`` (only with ``sample_join_sampling_session``)."""

    type: Literal["join_sampling_session"] | None = None  # the SDK's discriminator; never required
    sampling_session_id: str


# ---- training ------------------------------------------------------------------------


class CreateModelRequest(WireModel):
    """``/create_model``; the run id is ``f"{session_id}:train:{model_seq_id}"``."""

    type: Literal["create_model"] | None = None  # the SDK's discriminator; never required
    session_id: str
    model_seq_id: NonNegInt
    base_model: str
    user_metadata: dict[str, Any] | None = None
    lora_config: LoraConfig | None = None
    optimizer_config: OptimizerConfig = AdamwConfig()


class GetInfoRequest(WireModel):
    """``/get_info`` (synchronous)."""

    type: Literal["get_info"] | None = None  # the SDK's discriminator; never required
    model_id: str


class DatumJson(WireModel):
    """A ``Datum`` as JSON (the SDK's ``types.Datum``): ``{model_input: ModelInput,
    loss_fn_inputs: {name: TensorData}}``. Provenance spans travel only in the protobuf body
    (the SDK's JSON types give them no wire form)."""

    model_input: ModelInput
    loss_fn_inputs: dict[str, TensorData] = {}
    model_input_spans: list[Any] | None = None
    loss_fn_input_spans: list[Any] | None = None

    @model_validator(mode="after")
    def _no_spans(self) -> "DatumJson":
        for name in ("model_input_spans", "loss_fn_input_spans"):
            if getattr(self, name) is not None:
                raise FieldError(name, "provenance spans are accepted in the protobuf body only "
                                       "(Content-Type: application/x-protobuf, as the SDK sends them)")
        return self


class ForwardBackwardInputJson(WireModel):
    """``forward_backward_input`` / ``forward_input``: ``{data: [Datum], loss_fn, loss_fn_config?}``."""

    data: list[DatumJson]
    loss_fn: str = Field(min_length=1)
    loss_fn_config: dict[str, float | str] | None = None


class ForwardBackwardJsonRequest(WireModel):
    """``/forward_backward`` with a JSON body (``Content-Type: application/json``), the SDK's
    JSON ``ForwardBackwardRequest``: ``{model_id, seq_id?, forward_backward_input}``. The SDK
    itself sends protobuf; both forms reach the trainer as the same protobuf bytes."""

    model_id: str = Field(min_length=1)
    seq_id: int | None = None
    forward_backward_input: ForwardBackwardInputJson


class ForwardJsonRequest(WireModel):
    """``/forward`` with a JSON body: ``{model_id, seq_id?, forward_input}`` (the SDK's ``ForwardRequest``)."""

    model_id: str = Field(min_length=1)
    seq_id: int | None = None
    forward_input: ForwardBackwardInputJson


class AdamParams(WireModel):
    """Per-step AdamW hyperparameters (``adam_params``)."""

    learning_rate: Annotated[float, Field(ge=0, allow_inf_nan=False)] = 1e-4
    beta1: Annotated[float, Field(ge=0, lt=1)] = 0.9
    beta2: Annotated[float, Field(ge=0, lt=1)] = 0.95
    eps: Annotated[float, Field(gt=0, allow_inf_nan=False)] = 1e-12
    weight_decay: Annotated[float, Field(ge=0, allow_inf_nan=False)] = 0.0
    grad_clip_norm: Finite = 0.0
    """Clip the global gradient norm to this; ≤ 0 disables clipping."""


class DimuonParams(WireModel):
    """Per-step Dimuon hyperparameters (``optimizer_params`` with ``type: "dimuon"``)."""

    type: Literal["dimuon"] = "dimuon"
    learning_rate: Annotated[float, Field(ge=0, allow_inf_nan=False)]
    grad_clip_norm: Finite = 0.0
    beta1: Annotated[float, Field(ge=0, lt=1)] = 0.9


class OptimStepRequest(WireModel):
    """``/optim_step``: ``adam_params`` for AdamW runs, ``optimizer_params`` otherwise
    (an ``optim_params`` key is routed to one of them by its ``type``)."""

    type: Literal["optim_step"] | None = None  # the SDK's discriminator; never required
    model_id: str
    seq_id: int | None = None
    adam_params: AdamParams | None = None
    optimizer_params: DimuonParams | None = None

    @model_validator(mode="before")
    @classmethod
    def _route_optim_params(cls, data: Any) -> Any:
        if isinstance(data, dict) and "optim_params" in data and not (
            "adam_params" in data or "optimizer_params" in data
        ):
            data = dict(data)
            p = data.pop("optim_params")
            typ = p.get("type") if isinstance(p, dict) else None
            data["optimizer_params" if typ not in (None, "adam", "adamw") else "adam_params"] = p
        return data

    @model_validator(mode="after")
    def _one_of(self) -> "OptimStepRequest":
        if self.adam_params is None and self.optimizer_params is None:
            raise FieldError("adam_params", "required (or optimizer_params)")
        if self.adam_params is not None and self.optimizer_params is not None:
            raise FieldError("optimizer_params", "give either adam_params or optimizer_params, not both")
        return self

    @property
    def params(self) -> AdamParams | DimuonParams:
        """Whichever of ``adam_params`` / ``optimizer_params`` was sent."""
        return self.adam_params if self.adam_params is not None else self.optimizer_params  # type: ignore[return-value]


class SaveWeightsRequest(WireModel):
    """``/save_weights`` (``save_state``): ``path`` is a bare checkpoint name."""

    type: Literal["save_weights"] | None = None  # the SDK's discriminator; never required
    model_id: str
    path: str | None = None
    seq_id: int | None = None
    ttl_seconds: TtlSeconds | None = None
    overwrite: bool = False
    user_metadata: dict[str, str] | None = None

    @field_validator("path")
    @classmethod
    def _name(cls, v: str | None) -> str | None:
        return _check_name(v)


class SaveWeightsForSamplerRequest(WireModel):
    """``/save_weights_for_sampler``: named (``path``) or unnamed
    (``sampling_session_seq_id``: save and create a sampling session)."""

    type: Literal["save_weights_for_sampler"] | None = None  # the SDK's discriminator; never required
    model_id: str
    path: str | None = None
    sampling_session_seq_id: NonNegInt | None = None
    kind: Literal["snapshot", "inflight"] = "snapshot"
    seq_id: int | None = None
    ttl_seconds: TtlSeconds | None = None
    user_metadata: dict[str, str] | None = None

    @field_validator("path")
    @classmethod
    def _name(cls, v: str | None) -> str | None:
        return _check_name(v)

    @model_validator(mode="after")
    def _target(self) -> "SaveWeightsForSamplerRequest":
        if self.path is None and self.sampling_session_seq_id is None:
            raise FieldError("path", "either path or sampling_session_seq_id is required")
        return self


class SaveWeightsExternalRequest(WireModel):
    """``/save_weights_external``."""

    type: Literal["save_weights_external"] | None = None  # the SDK's discriminator; never required
    model_id: str
    path: str
    seq_id: int | None = None
    ttl_seconds: TtlSeconds | None = None
    age_encryption_recipients: list[str] | None = None

    @field_validator("path")
    @classmethod
    def _name(cls, v: str | None) -> str | None:
        return _check_name(v)


class LoadWeightsRequest(WireModel):
    """``/load_weights``. Create-via-load: ``session_id`` + ``model_seq_id`` (the new run
    is ``f"{session_id}:train:{model_seq_id}"``). In place (legacy): ``model_id`` + ``seq_id``."""

    type: Literal["load_weights"] | None = None  # the SDK's discriminator; never required
    model_id: str | None = None
    seq_id: int | None = None
    session_id: str | None = None
    model_seq_id: NonNegInt | None = None
    base_model: str | None = None
    user_metadata: dict[str, Any] | None = None
    path: str
    optimizer: bool = False
    optimizer_config: OptimizerConfig | None = None
    weights_access_token: str | None = None

    @model_validator(mode="after")
    def _addressing(self) -> "LoadWeightsRequest":
        if self.session_id is not None:
            if self.model_id is not None:
                raise FieldError("model_id", "give either model_id or session_id, not both")
            if self.model_seq_id is None:
                raise FieldError("model_seq_id", "required with session_id")
        elif self.model_id is None:
            raise FieldError("model_id", "required (or session_id + model_seq_id)")
        return self

    @property
    def is_create(self) -> bool:
        """True for the create-via-load form."""
        return self.session_id is not None


class UnloadModelRequest(WireModel):
    """``/unload_model`` (unused by 0.38.0)."""

    type: Literal["unload_model"] | None = None  # the SDK's discriminator; never required
    model_id: str


# ---- sampling ------------------------------------------------------------------------


class CreateSamplingSessionRequest(WireModel):
    """``/create_sampling_session``; id ``f"{session_id}:sample:{sampling_session_seq_id}"``."""

    type: Literal["create_sampling_session"] | None = None  # the SDK's discriminator; never required
    session_id: str
    sampling_session_seq_id: NonNegInt
    base_model: str | None = None
    model_path: str | None = None

    @model_validator(mode="after")
    def _source(self) -> "CreateSamplingSessionRequest":
        if self.base_model is None and self.model_path is None:
            raise FieldError("base_model", "either base_model or model_path is required")
        return self


class SamplingParams(WireModel):
    """``sampling_params``. ``stop``: ``None`` keeps EOS stopping; ``[]`` disables every
    stop token, EOS included; otherwise strings or token ids to stop at."""

    temperature: Annotated[float, Field(ge=0, allow_inf_nan=False)] = 1.0
    top_k: Annotated[int, Field(ge=-1)] = -1
    """-1 (or 0) = no limit."""
    top_p: Annotated[float, Field(gt=0, le=1)] = 1.0
    max_tokens: NonNegInt | None = None
    seed: int | None = None
    stop: str | list[str] | list[int] | None = None

    @property
    def stop_strings(self) -> list[str]:
        """Stop strings (``stop`` as a str or list of str)."""
        if isinstance(self.stop, str):
            return [self.stop]
        return [s for s in self.stop or [] if isinstance(s, str)]

    @property
    def stop_token_ids(self) -> list[int]:
        """Stop token ids (``stop`` as a list of int)."""
        return [s for s in self.stop or [] if isinstance(s, int)] if not isinstance(self.stop, str) else []


class SampleRequest(WireModel):
    """``/asample``; the SDK always addresses a sampling session (``sampling_session_id``,
    ``seq_id``)."""

    type: Literal["sample"] | None = None  # the SDK's discriminator; never required
    num_samples: PosInt = 1
    prompt: ModelInput
    sampling_params: SamplingParams = SamplingParams()
    base_model: str | None = None
    model_path: str | None = None
    sampling_session_id: str | None = None
    seq_id: int | None = None
    prompt_logprobs: bool = False
    topk_prompt_logprobs: NonNegInt = 0
    topk_sample_logprobs: NonNegInt = 0
    target_prompt_logprobs: TensorData | None = None
    """int64 ``[len(prompt) - 1, K]`` token ids, -1 = unused cell (CSR pad -1)."""
    prompt_alt_tokens_k: NonNegInt = 0
    prompt_logprobs_last_n: PosInt | None = None
    record_stability_info: bool = False

    @field_validator("prompt_logprobs", "record_stability_info", mode="before")
    @classmethod
    def _none_false(cls, v: Any) -> Any:
        return False if v is None else v

    @model_validator(mode="after")
    def _check(self) -> "SampleRequest":
        if self.prompt_logprobs_last_n is not None and not self.prompt_logprobs:
            raise FieldError("prompt_logprobs_last_n", "requires prompt_logprobs")
        t = self.target_prompt_logprobs
        if t is not None:
            if t.dtype != "int64":
                raise FieldError("target_prompt_logprobs.dtype", "must be int64 token ids")
            if t.shape is None or len(t.shape) != 2:
                raise FieldError("target_prompt_logprobs.shape", "must be 2-D [len(prompt) - 1, K]")
        return self


# ---- REST ----------------------------------------------------------------------------


class WeightsInfoRequest(WireModel):
    """``/weights_info``."""

    tinker_path: str


class TtlRequest(WireModel):
    """PUT ``…/checkpoints/{id}/ttl``: ``{ttl_seconds}`` (null = never expires)."""

    ttl_seconds: TtlSeconds | None = None


class CopyWeightsRequest(WireModel):
    """``/copy_weights``: copy ``source_path`` into a new, untrainable training run, either in
    slot ``model_seq_id`` of the caller's session ``session_id`` or in a new session of project
    ``destination_project_id``. ``ttl_seconds``: 3600 s (1 hour) to 10 years, or None."""

    source_path: str
    session_id: str | None = None
    model_seq_id: NonNegInt | None = None
    destination_project_id: str | None = None
    ttl_seconds: Annotated[int, Field(ge=3600, le=10 * 365 * 86400)] | None = None
    weights_access_token: str | None = None
    """Refused when set: this server issues no weights access tokens."""

    @model_validator(mode="after")
    def _destination(self) -> "CopyWeightsRequest":
        if self.session_id is not None:
            if self.model_seq_id is None:
                raise FieldError("model_seq_id", "required with session_id")
        elif not self.destination_project_id:
            raise FieldError("destination_project_id", "give destination_project_id, or session_id + model_seq_id")
        return self


class SetSessionProjectRequest(WireModel):
    """PUT ``/sessions/{id}/project``."""

    project_id: str


class SearchOwner(WireModel):
    """A search's ``owner`` (the SDK's ``SearchOwner``): ``{"type": "own"}``, ``{"type":
    "accessible"}``, or ``{"type": "user", "owner_urns": [...]}`` (owner ids, as the search's
    answers name owners; at most 10)."""

    type: str
    owner_urns: Annotated[list[str], Field(min_length=1, max_length=10)] | None = None


class SessionStatusQuery(WireModel):
    """A session search's ``statuses`` entry (the SDK's ``SessionStatusQuery``): ``{"type"}``, and
    for ``client_finished`` optionally ``reasons`` (the finish reasons to match)."""

    type: str
    reasons: Annotated[list[Literal["success", "errored", "interrupted"]], Field(min_length=1)] | None = None


class SessionSearchCursor(WireModel):
    """A session search's ``cursor``: the previous page's ``next_cursor``, sent back."""

    last_created_at: str = ""
    last_session_id: str = ""


class SessionSearchRequest(WireModel):
    """``/sessions/search`` (the SDK's ``SessionSearchRequest``; see
    :func:`functions.gateway.routes_rest.search_sessions`)."""

    session_id: str | None = None
    display_name: str | None = None
    project_ids: list[str] | None = None
    user_metadata: dict[str, Any] | None = None
    statuses: list[SessionStatusQuery] | None = None
    owner: SearchOwner | None = None
    cursor: SessionSearchCursor | None = None
    limit: int | None = None


class ExternalWeightsUploadStartRequest(WireModel):
    """``/external_weights_upload_start`` (SDK 0.39+ ``RestClient.external_weights_upload_start``;
    see :mod:`functions.gateway.routes_imports`): the base model and LoRA shape of the adapter
    about to be uploaded."""

    base_model: str = Field(min_length=1)
    lora_config: LoraConfig
    destination_project_id: str | None = None


class ExternalWeightsUploadFinishRequest(WireModel):
    """``/external_weights_upload_finish``: the ``upload_id`` of a started upload."""

    upload_id: str = Field(min_length=1)


class CheckpointSearchCursor(WireModel):
    """A checkpoint search's ``cursor``: the previous page's ``next_cursor``, sent back."""

    last_created_at: str
    last_checkpoint_uuid: str


class CheckpointSearchRequest(WireModel):
    """``/checkpoints/search`` (SDK 0.39+ ``RestClient.search_checkpoints``; see
    :func:`functions.gateway.routes_imports.search_checkpoints`)."""

    project_ids: list[str] | None = None
    user_metadata: dict[str, str] | None = None
    checkpoint_type: Literal["training", "sampler", "external"] | None = None
    owner: SearchOwner | None = None
    base_models: list[str] | None = None
    limit: int = Field(default=50, ge=1, le=200)
    cursor: CheckpointSearchCursor | None = None
