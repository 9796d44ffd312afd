"""Response bodies the server sends; the SDK validates them strictly (required fields
must be present, extra fields are ignored). Serialize with :func:`openrl.edge.wire.dump`
(the gateway's routes name them as ``response_model``, serialised the same way).

Times are :data:`Timestamp`: UTC ISO-8601 with a ``Z``, milliseconds only when not zero
(``2026-11-30T08:14:41.353Z``, ``2026-11-30T08:14:41Z``), the form the records and storage
manifests hold, so a time passes through the gateway unchanged.
"""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Annotated, Any, Literal

from pydantic import PlainSerializer

from ._base import ResponseModel
from .common import AdamwConfig, DimuonConfig


def _iso_z(t: datetime) -> str:
    """``t`` in UTC as ISO-8601 with ``Z``; ``.mmm`` only when the milliseconds are not zero
    (a naive ``t`` is taken as UTC)."""
    t = t.astimezone(timezone.utc) if t.tzinfo else t
    ms = t.microsecond // 1000
    return t.strftime("%Y-%m-%dT%H:%M:%S") + (f".{ms:03d}" if ms else "") + "Z"


Timestamp = Annotated[datetime, PlainSerializer(_iso_z, return_type=str, when_used="json")]
"""A datetime on the wire (see the module doc)."""

__all__ = [
    "UntypedAPIFuture", "TryAgainResponse", "FutureMetadataResponse", "RequestFailedResponse",
    "ClientConfigResponse", "ClientDynamicConfigResponse", "CreateSessionResponse",
    "SessionHeartbeatResponse", "TelemetryResponse", "CreateModelResponse", "ModelData",
    "GetInfoResponse", "OptimStepResponse", "SaveWeightsResponse", "SaveWeightsForSamplerResponse",
    "SaveWeightsExternalResponse", "LoadWeightsResponse", "UnloadModelResponse",
    "CreateSamplingSessionResponse", "SamplerInfo", "Cursor", "Checkpoint",
    "CheckpointsListResponse", "TrainingRun", "TrainingRunsResponse", "WeightsInfoResponse",
    "SupportedModel", "GetServerCapabilitiesResponse", "ExternalWeightsUrlsResponse",
    "ListSessionsResponse", "GetSessionResponse", "HealthResponse", "JoinSamplingSessionResponse",
    "FutureCompletion", "RetrieveFuturesResponse",
]


# ---- futures -------------------------------------------------------------------------


class UntypedAPIFuture(ResponseModel):
    """The handle every async call returns. ``/asample`` must set ``sample_sequence_ids``
    (one per requested sample, in output order)."""

    request_id: str
    model_id: str | None = None
    sample_sequence_ids: list[str] | None = None


class TryAgainResponse(ResponseModel):
    """Not ready yet (the SDK re-polls at once, so hold the poll ~30 s before sending this)."""

    type: Literal["try_again"] = "try_again"
    request_id: str
    queue_state: Literal["active", "paused_capacity", "paused_rate_limit"] = "active"
    queue_state_reason: str | None = None


class FutureMetadataResponse(ResponseModel):
    """Only when the poll set ``allow_metadata_only``: the payload size, in bytes."""

    status: Literal["complete_metadata"] = "complete_metadata"
    response_payload_size: int


class RequestFailedResponse(ResponseModel):
    """A failed future: raises ``RequestFailedError(category)`` in the SDK."""

    error: str
    category: Literal["unknown", "server", "user"] = "server"


# ---- bootstrap / session -------------------------------------------------------------


class ClientConfigResponse(ResponseModel):
    """``/client/config``; every field optional for the SDK. Chunk limits in datums / bytes."""

    pjwt_auth_enabled: bool = False
    credential_default_source: str = "api_key"
    use_pyqwest_transport: bool | None = None
    parallel_fwdbwd_chunks: bool | None = None
    proto_compress_fwdbwd: bool | None = None
    fwdbwd_max_chunk_len: int | None = None
    fwdbwd_max_chunk_bytes_count: int | None = None
    fwdbwd_dispatch_bytes_semaphore_size: int | None = None
    sample_dispatch_bytes_semaphore_size: int | None = None
    inflight_response_bytes_semaphore_size: int | None = None
    sample_max_concurrent_requests: int | None = None
    sample_no_retries: bool | None = None
    sample_enable_stuck_detection: bool | None = None
    sample_use_retrieve_futures: bool = False
    sample_join_sampling_session: bool = False
    custom_loss_server_side: bool = False
    billing_exception_max_pause_duration_sec: int | None = None


class ClientDynamicConfigResponse(ResponseModel):
    """``/client/dynamic_config``."""

    refresh_interval_sec: int = 300
    sample_cancel_enabled: bool = False
    sample_cancel_max_batch_size: int = 64


class CreateSessionResponse(ResponseModel):
    """``/create_session``: the new session id; ``warning_message`` is logged by the SDK."""

    type: Literal["create_session"] = "create_session"
    session_id: str
    info_message: str | None = None
    warning_message: str | None = None
    error_message: str | None = None


class SessionHeartbeatResponse(ResponseModel):
    """``/session_heartbeat`` while the session is active."""

    type: Literal["session_heartbeat"] = "session_heartbeat"


class TelemetryResponse(ResponseModel):
    """``/telemetry``: accepted (and dropped)."""

    status: Literal["accepted"] = "accepted"


class JoinSamplingSessionResponse(ResponseModel):
    """``/join_sampling_session`` (not offered by this server)."""

    client_counter: int


class FutureCompletion(ResponseModel):
    """One entry of ``/retrieve_futures`` (not offered by this server)."""

    state: Literal["finished", "failed"]
    request_id: str
    response_payload_uncompressed_size: int | None = None


class RetrieveFuturesResponse(ResponseModel):
    """``/retrieve_futures`` (not offered by this server)."""

    completions: list[FutureCompletion] = []
    cursor: int = 0


# ---- training results ----------------------------------------------------------------


class CreateModelResponse(ResponseModel):
    """Result of the ``create_model`` future."""

    type: Literal["create_model"] = "create_model"
    model_id: str


class ModelData(ResponseModel):
    """``tokenizer_id`` is cut at its first ``:`` by the SDK."""

    arch: str | None = None
    model_name: str | None = None
    tokenizer_id: str | None = None


class GetInfoResponse(ResponseModel):
    """``/get_info``; ``optimizer_config`` defaults to AdamW."""

    type: Literal["get_info"] = "get_info"
    model_id: str
    model_data: ModelData
    is_lora: bool | None = None
    lora_rank: int | None = None
    model_name: str | None = None
    optimizer_config: AdamwConfig | DimuonConfig = AdamwConfig()


class OptimStepResponse(ResponseModel):
    """Result of an ``optim_step`` future."""

    metrics: dict[str, float] | None = None


class SaveWeightsResponse(ResponseModel):
    """Result of a ``save_weights`` future: the checkpoint's ``tinker://`` path."""

    type: Literal["save_weights"] = "save_weights"
    path: str


class SaveWeightsForSamplerResponse(ResponseModel):
    """Named save: ``path``; unnamed save: ``sampling_session_id`` (the SDK asserts it)."""

    type: Literal["save_weights_for_sampler"] = "save_weights_for_sampler"
    path: str | None = None
    sampling_session_id: str | None = None


class SaveWeightsExternalResponse(ResponseModel):
    """Result of a ``save_weights_external`` future: path and size in bytes."""

    type: Literal["save_weights_external"] = "save_weights_external"
    path: str
    size_bytes: int | None = None


class LoadWeightsResponse(ResponseModel):
    """Result of a ``load_weights`` future."""

    type: Literal["load_weights"] = "load_weights"
    path: str | None = None
    model_id: str | None = None


class UnloadModelResponse(ResponseModel):
    """Result of an ``unload_model`` future."""

    type: Literal["unload_model"] = "unload_model"
    model_id: str


# ---- sampling ------------------------------------------------------------------------


class CreateSamplingSessionResponse(ResponseModel):
    """``/create_sampling_session``: id ``<session>:sample:<n>``."""

    type: Literal["create_sampling_session"] = "create_sampling_session"
    sampling_session_id: str


class SamplerInfo(ResponseModel):
    """GET ``/samplers/{id}`` (the SDK's GetSamplerResponse)."""

    sampler_id: str
    base_model: str
    model_path: str | None = None


# ---- REST ----------------------------------------------------------------------------


class Cursor(ResponseModel):
    """Paging of a listing: ``offset`` and ``limit`` asked, ``total_count`` in all."""

    offset: int
    limit: int
    total_count: int


class Checkpoint(ResponseModel):
    """``checkpoint_id`` is ``weights/<name>`` | ``sampler_weights/<name>`` | ``external_weights/<name>``."""

    checkpoint_id: str
    checkpoint_type: Literal["training", "sampler", "external"]
    time: Timestamp
    tinker_path: str
    size_bytes: int | None = None
    public: bool = False
    user_metadata: dict[str, Any] | None = None
    expires_at: Timestamp | None = None


class CheckpointsListResponse(ResponseModel):
    """``/training_runs/{id}/checkpoints`` and ``/checkpoints``."""

    checkpoints: list[Checkpoint] = []
    cursor: Cursor | None = None


class TrainingRun(ResponseModel):
    """One training run as ``RestClient`` shows it."""

    training_run_id: str
    base_model: str
    model_owner: str
    is_lora: bool
    corrupted: bool = False
    lora_rank: int | None = None
    last_request_time: Timestamp
    last_checkpoint: Checkpoint | None = None
    last_sampler_checkpoint: Checkpoint | None = None
    user_metadata: dict[str, Any] | None = None
    """As the run was created with (the SDK sends strings)."""


class TrainingRunsResponse(ResponseModel):
    """``/training_runs``: one page, newest first."""

    training_runs: list[TrainingRun] = []
    cursor: Cursor


class WeightsInfoResponse(ResponseModel):
    """``/weights_info``: base model and LoRA shape of a checkpoint."""

    base_model: str
    is_lora: bool
    lora_rank: int | None = None
    train_unembed: bool | None = None
    train_mlp: bool | None = None
    train_attn: bool | None = None
    optimizer_config: AdamwConfig | DimuonConfig = AdamwConfig()


class SupportedModel(ResponseModel):
    """One base model of ``/get_server_capabilities`` (context length in tokens)."""

    model_name: str | None = None
    max_context_length: int | None = None
    trainable: bool | None = None
    sampleable: bool | None = None


class GetServerCapabilitiesResponse(ResponseModel):
    """``/get_server_capabilities``. ``max_tokens_cap`` (openrl's, not in the SDK's type, which
    ignores it): most tokens one sampled sequence generates, the limit on ``max_tokens`` and
    what an omitted one gets (``min(cap, context - prompt)``; ``OPENRL_SAMPLER_MAX_TOKENS_CAP``)."""

    supported_models: list[SupportedModel] = []
    max_tokens_cap: int | None = None


class ExternalWeightsUrlsResponse(ResponseModel):
    """Signed download URLs of a checkpoint's files (``{file: url}``) and when they expire."""

    urls: dict[str, str]
    expires: Timestamp


class ListSessionsResponse(ResponseModel):
    """``/sessions``: session ids, newest first."""

    sessions: list[str] = []


class GetSessionResponse(ResponseModel):
    """``/sessions/{id}``."""

    training_run_ids: list[str] = []
    sampler_ids: list[str] = []
    user_metadata: dict[str, Any] | None = None
    display_name: str | None = None


class HealthResponse(ResponseModel):
    """``/healthz``."""

    status: Literal["ok"] = "ok"
