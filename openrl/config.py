"""One settings object for every openrl process: :class:`Settings`.

Environment variables stay the source (``OPENRL_<FIELD>``, case-insensitive; empty values
count as unset), values given explicitly win::

    cfg = Settings()                                   # from the environment
    cfg = Settings(storage="file:///tmp/s", flush_interval_s=0)   # explicit values win
    cfg = Settings.of({"storage": url, "gap_timeout_s": 8})       # a Function's start() dict

``Settings`` is the ``cfg`` each Function's ``start(cfg)`` receives (the Knative Functions
template's ``start(cfg)``; :mod:`openrl.contract.function`): the bindings
(:mod:`openrl.transport.worker`, :mod:`openrl.transport.bindings.http`) build it, and
``start`` also accepts a plain dict (:meth:`Settings.of`), which older callers and the
tests pass. Functions read no environment variable themselves.

The state directory ``$OPENRL_HOME`` defaults to :data:`DEFAULT_HOME` (``~/.openrl``)
here and nowhere else; storage defaults to ``file://<home>/storage`` for the gateway and
the workers alike.

Modules outside the functions that need a setting where it is used (the bus, the dispatcher,
logs, metrics, tracing, the gateway's download and auth code, the sweeper, the device and
model-registry fallbacks, vLLM's engine knobs) read it through ``Settings()`` too, or take it
as a parameter from a caller that has the cfg; this class is the one list of what can be
configured. Only the test hold points (``OPENRL_TEST_HOLD_FILE``, :mod:`openrl.testhooks`)
and other programs' variables (``OTEL_*``, ``STORAGE_EMULATOR_HOST``,
``GOOGLE_CLOUD_PROJECT``, ``TINKER_*``, ``VLLM_*``) are read from ``os.environ`` directly.

This module is a leaf: it imports nothing of openrl.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import AliasChoices, Field, field_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

#: Default state directory (``$OPENRL_HOME``): models, models.toml, nats, storage, logs, api_key.
DEFAULT_HOME = "~/.openrl"
#: Environment prefix of every setting.
ENV_PREFIX = "OPENRL_"

#: ``start()`` dict keys of earlier releases -> the field they set (kept working).
LEGACY_KEYS = {
    "registry": "model_registry",
    "gap_timeout_s": "seq_gap_timeout_s",
    "gpu_memory": "trainer_gpu_memory",
    "backend": "sampler_backend",
    "storage_url": "storage",  # the property the functions' start() docs name (was silently ignored)
}


def _env(*names: str, field: str | None = None) -> AliasChoices:
    """Environment names read for a field (first set wins), plus the field's own name for
    explicit values."""
    return AliasChoices(*names, *((field,) if field else ()))


class Settings(BaseSettings):
    """Every openrl setting; field ``x`` comes from ``$OPENRL_X`` unless noted.

    Durations are seconds, sizes bytes, memory shares fractions of one GPU's memory.

    Raises:
        pydantic.ValidationError (a ValueError): a value of the wrong type or out of range;
            the message names the field.
    """

    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, env_ignore_empty=True, extra="ignore",
                                      populate_by_name=True, frozen=False)

    # ----- shared -----------------------------------------------------------------------
    home: str = Field(DEFAULT_HOME, description="state directory (OPENRL_HOME); see :attr:`home_dir`")
    storage: str | None = Field(None, description="file:// or gs:// storage URL; default file://<home>/storage")
    nats_url: str = Field("nats://127.0.0.1:4222", description="NATS server URL")
    model_registry: str | None = Field(None, description="registry TOML file; default the packaged one")
    models_dir: str | None = Field(None, description="where built / relative models live; default <home>/models")
    device: str | None = Field(None, description="auto | cpu | cuda | cuda:N (None: auto, openrl.model.device)")
    preload: Annotated[list[str], NoDecode] = Field(
        default_factory=list, description="base-model names to load at start (comma-separated in the env)")
    model_retry_s: float = Field(60.0, ge=0, description="a base model that failed to load fails its requests "
                                 "at once for this long, unless its directory changes; then the next request loads "
                                 "it again (0 = every request tries)")
    torch_threads: int | None = Field(None, ge=1, description="torch CPU threads; default half the cores")
    internal_token: str | None = Field(None, description="shared secret of the gateway's /events/* sinks")
    usage_flush_s: float = Field(10.0, ge=0, description="how often a worker writes its per-key usage totals to "
                                 "the KV bucket (openrl/observe/usage.py); 0 = off")

    # ----- trainer ----------------------------------------------------------------------
    trainer_gpu_memory: float | None = Field(
        None, gt=0, le=1, description="fraction of the GPU the trainer may allocate; None = all")
    pack_max_delay_s: float = Field(0.25, ge=0, description="longest a ready pass waits for other runs; 0 = never")
    pass_token_budget: int = Field(
        262_144, ge=0, description="most tokens of one packed pass, filled round-robin over API keys so one key's "
        "flood cannot starve another's runs (each key's first ready request always goes in); 0 = no budget. "
        "The default is 8 of the engine's 32768-token micro-batches")
    seq_gap_timeout_s: float = Field(300.0, ge=0, description="how long a request waits for a missing seq_id")
    max_seq_ahead: int = Field(10_000, ge=0, description="seq_ids further past a run's next one fail at once")
    flush_interval_s: float = Field(120.0, ge=0, description="periodic run-state flush interval; 0 = off")
    restore_wait_s: float = Field(10.0, ge=0, description="how long a restore waits for a fresher flush")
    fused_kernels: bool = Field(True, description="the trainer's fused LoRA kernels on CUDA (0 = off)")
    lora_pass_cache: bool = Field(False, description="the trainer casts each run's float32 adapter "
                                  "to the compute dtype once per pass when the run's rows span several "
                                  "micro-batches, instead of once per micro-batch (openrl/model/lora/pass_weights.py; "
                                  "same bits; off: on an H100, deterministic mode, 8 runs, it saved 21 percent of the casts "
                                  "and the pass time moved within noise (0.99-1.03); the default plan never uses it there)")
    deterministic: bool = Field(False, description="deterministic mode (issue 33): packing never changes a run's "
                                "numbers; each datum / sampling request runs in its own forward (slower). A "
                                "registry entry's `deterministic` overrides it per base model")
    trainer_gpus: int = Field(
        1, ge=1, validation_alias=_env("OPENRL_TRAINER_GPUS", "OPENRL_TRAINER_PROCS"),
        description="ranks of one trainer engine (GPUs of this node on CUDA, processes on CPU; "
                    "OPENRL_TRAINER_PROCS is the same): > 1 shards the base with FSDP2 and runs passes "
                    "data parallel (functions/trainer/distributed.py, docs/multi-gpu.md)")

    # ----- sampler ----------------------------------------------------------------------
    sampler_backend: str = Field("auto", description="auto | hf | vllm (auto: vLLM on CUDA when installed)")
    sampler_gpu_memory: float | None = Field(
        None, gt=0, le=1, validation_alias=_env("OPENRL_SAMPLER_GPU_MEMORY", "OPENRL_VLLM_GPU_UTIL"),
        description="vLLM gpu_memory_utilization (older name OPENRL_VLLM_GPU_UTIL)")
    sampler_max_num_seqs: int | None = Field(
        None, ge=1, validation_alias=_env("OPENRL_SAMPLER_MAX_NUM_SEQS", "OPENRL_VLLM_MAX_NUM_SEQS"),
        description="vLLM max_num_seqs (older name OPENRL_VLLM_MAX_NUM_SEQS)")
    sampler_max_tokens_cap: int = Field(
        4096, ge=1,
        description="most tokens one sampled sequence generates: the largest max_tokens a request may ask "
                    "(400 beyond) and what an omitted max_tokens gets, min(cap, context - prompt); "
                    "reported by get_server_capabilities")
    vllm_max_loras: int | None = Field(None, ge=1, description="vLLM max_loras")
    vllm_max_lora_rank: int | None = Field(None, ge=1, description="vLLM max_lora_rank")
    vllm_engine_args: dict[str, Any] | None = Field(
        None, description="extra vLLM AsyncEngineArgs as JSON, e.g. "
        "'{\"compilation_config\":{\"cudagraph_specialize_lora\":false}}' (a compilation_config is merged key "
        "by key over the backend's; an unknown field fails the sampler's start naming it); for A/B runs of "
        "vLLM's start and speed without a code change (functions/sampler/backends/vllm_settings.py)")
    vllm_preload: bool = Field(True, description="vLLM builds each adapter (read, cast, pin, pack) in a background "
                               "thread of its worker before add_lora, so the engine core's loop, where every run "
                               "decodes, only registers it (functions/sampler/backends/vllm_preload.py; measured "
                               "through the stack on an H100: the loop's part of a load 0.66 s -> 0.02 s with one "
                               "RL run; 0 = vLLM's own add_lora does it all on the loop)")
    vllm_preload_threads: int = Field(2, ge=1, le=16, description="with vllm_preload: adapters built at once in "
                                      "vLLM's worker (each holds the GIL only between torch calls; an 8-run RL round "
                                      "asks for 8 at once: docs/benchmarks.md, seventeenth session)")
    vllm_unembed_lora: str | None = Field(None, description="keep (vLLM applies the lm_head LoRA, checked on first use) or fallback (such adapters are sampled with transformers); functions/sampler/backends/vllm.py")

    # ----- transport --------------------------------------------------------------------
    ack_wait_s: float = Field(30.0, gt=0, description="JetStream ack wait of the work consumers")
    futures_ttl_s: float = Field(7 * 86400.0, ge=0, description="lifetime of a future in the KV bucket")
    worker_refresh_s: float = Field(30.0, gt=0, description="seconds between worker-record rewrites")
    colocated_sampler: bool = Field(False, description="the trainer shares this machine and its cache dir with the "
                                    "sampler (the embedded stack): gs:// snapshots it saves stay in the cache, so "
                                    "the sampler reads them locally instead of downloading them back")
    handoff_dir: str | None = Field(None, description="with colocated_sampler: the directory (a tmpfs) through "
                                    "which the trainer hands unnamed sampler snapshots to the sampler from memory, "
                                    "default /dev/shm/openrl-<hash of home>; off = always through storage "
                                    "(openrl/storage/handoff.py)")
    handoff_staged: bool = Field(True, description="with the handoff: the trainer packs an unnamed snapshot on the "
                                 "GPU under the engine lock, then writes it through a pinned host buffer after "
                                 "releasing the lock; false = the whole write under the lock, straight into the "
                                 "file's mapped pages (the earlier path, kept to compare)")
    handoff_spares: int = Field(2, ge=0, le=16, description="with handoff_staged: pre-allocated tmpfs files kept per "
                                "adapter size, made in the background after a save; a save writes over one instead "
                                "of a new file, whose pages the kernel must first allocate and zero (0 = off; "
                                "docs/benchmarks.md, issue 31's fourth session)")
    handoff_writers: int = Field(2, ge=1, le=16, description="with handoff_staged: most unnamed snapshots written at "
                                 "once; each holds a packed copy of its adapter on the GPU and a pinned host buffer "
                                 "of its size (a rank-32 Qwen3-4B adapter: 284 MB of each)")
    pack_beside_pass: bool = Field(False, description="with handoff_staged: sampler saves run beside the trainer's "
                                   "next works and an unnamed snapshot is packed while a forward(_backward) pass of "
                                   "other runs holds the engine lock (the pass reads the weights, writes only "
                                   "gradients), instead of waiting for the pass; one-device engines only "
                                   "(functions/trainer/pass_window.py). Off by default until measured on a GPU "
                                   "(docs/benchmarks.md, eighteenth session)")
    handoff_max_bytes: int = Field(0, ge=0, description="most bytes of snapshots the handoff holds; 0 = a quarter "
                                   "of its file system, at most 16 GiB")
    idle_timeout: float = Field(1800.0, ge=0, description="embedded stack (openrl serve / run): seconds a worker's "
                                "queue stays empty before it is stopped (scale to zero; the next request is a cold "
                                "start, about 95 s for a vLLM sampler on an H100); 0 = keep it up. Idle sleep "
                                "(sleep_after) frees the GPU long before")
    sleep_after: float = Field(0.0, ge=0, description="seconds a trainer / sampler worker has no request in flight "
                               "before it sleeps: it keeps its process and moves its weights (and the trainer's "
                               "runs) to host memory, giving the GPU back, and wakes before the next request "
                               "(openrl/transport/bindings/idle_sleep.py); 0 = never. Below idle_timeout it "
                               "comes first; scale to zero still follows after idle_timeout. Unset, openrl serve / "
                               "run use 60 s (openrl.transport.embedded.SERVE_SLEEP_AFTER) and a worker started "
                               "on its own (a Knative revision) 0")
    compile_cache_sync: Literal["auto", "on", "off"] = Field(
        "auto", description="the sampler keeps its compile caches (VLLM_CACHE_ROOT, TRITON_CACHE_DIR, "
        "TORCHINDUCTOR_CACHE_DIR) in storage under .compile-cache/: fetched before its engine starts, stored "
        "again when the start compiled something new (openrl/storage/compile_cache.py); auto = on with gs:// "
        "storage (a pod on GKE starts with an empty /tmp), off with file:// (the state dir keeps them)")
    start_failures: int = Field(3, ge=1, description="embedded stack: failed starts of a worker in a row with the "
                                "same cause (twice as many with any causes) after which its function is failing: "
                                "its queued and new requests fail with the start error")
    failing_retry_s: float = Field(60.0, gt=0, description="embedded stack: seconds between two start attempts "
                                   "of a failing worker")
    host: str = Field("0.0.0.0", description="HTTP binding's listen address")
    port: int = Field(8080, validation_alias=_env("PORT"), description="HTTP binding's port ($PORT, Knative)")

    # ----- gateway ----------------------------------------------------------------------
    long_poll_s: float = Field(25.0, ge=0, description="retrieve_future hold before try_again")
    trainer_shards: int = Field(1, ge=1, description="trainer shards (crc32(model_id) % shards)")
    max_body_bytes: int = Field(64 * 1024 * 1024, ge=1, description="largest request body (413 beyond)")
    max_pending_samples: int = Field(10_000, ge=0, description="sample backlog before 429; 0 = off")
    max_pending_train: int = Field(10_000, ge=0, description="train backlog before 429; 0 = off")
    k_sink: str | None = Field(None, validation_alias=_env("K_SINK"),
                               description="Knative SinkBinding broker URL ($K_SINK)")
    public_url: str | None = Field(None, description="base URL of download links")
    download_ttl_s: int = Field(3600, ge=1, description="lifetime of a download URL")
    download_secret: str | None = Field(None, description="HMAC key of download URLs")
    proto_compress: bool = Field(False, description="offer zstd-compressed forward_backward bodies")
    api_keys: str | None = Field(None, description="accepted API keys, comma-separated (openrl.edge.auth)")
    api_keys_file: str | None = Field(None, description="file of accepted API keys")
    insecure_any_key: bool = Field(False, description="accept any key (tests only)")
    quota_runs: str | None = Field(None, description="default per-key quota: concurrent training runs "
                                   "(0 / unlimited = none; per key in the key entry, openrl.edge.auth)")
    quota_tokens_per_min: str | None = Field(None, description="default per-key quota: trained + sampled tokens "
                                             "admitted per 60 s (0 / unlimited = none)")
    quota_stored_bytes: str | None = Field(None, description="default per-key quota: bytes of live checkpoints, "
                                           "K/M/G/T suffixes (0 / unlimited = none)")
    sweep_interval_s: float = Field(300.0, ge=0, description="checkpoint TTL sweeps; 0 = off")

    # ----- observability ----------------------------------------------------------------
    log_format: str = Field("json", description="json | text")
    log_level: str = Field("INFO", description="root log level")
    metrics_port: int = Field(0, ge=0, description="Prometheus /metrics port of a worker; 0 = off")
    metrics_host: str = Field("0.0.0.0", description="Prometheus /metrics listen address")
    trace_file: str | None = Field(None, description="write spans as JSON lines here")

    @field_validator("home", "storage", "model_registry", "models_dir", mode="before")
    @classmethod
    def _path_as_str(cls, v: Any) -> Any:
        return os.fspath(v) if isinstance(v, os.PathLike) else v

    @field_validator("preload", mode="before")
    @classmethod
    def _split_names(cls, v: Any) -> Any:
        if isinstance(v, str):
            return [n.strip() for n in v.split(",") if n.strip()]
        return v

    # ----- derived ----------------------------------------------------------------------
    @property
    def home_dir(self) -> Path:
        """The state directory: absolute, ``~`` expanded; not created."""
        return Path(os.path.abspath(Path(self.home).expanduser()))

    @property
    def storage_url(self) -> str:
        """``storage`` or ``file://<home>/storage`` (the same default in every process)."""
        return self.storage or (self.home_dir / "storage").as_uri()

    @property
    def models_path(self) -> Path:
        """``models_dir`` or ``<home>/models``."""
        return Path(self.models_dir).expanduser() if self.models_dir else self.home_dir / "models"

    @property
    def registry_path(self) -> Path | None:
        """``model_registry`` as a path, None for the packaged registry."""
        return Path(self.model_registry).expanduser() if self.model_registry else None

    @property
    def cache_dir(self) -> Path:
        """``<home>/cache``: downloaded snapshots, compile caches."""
        return self.home_dir / "cache"

    @classmethod
    def of(cls, cfg: "Settings | Mapping[str, Any] | None" = None, **overrides: Any) -> "Settings":
        """``cfg`` as Settings: a Settings as is (copied with ``overrides``), else a dict of
        explicit values over the environment.

        Dict keys of earlier releases (:data:`LEGACY_KEYS`: ``registry``, ``gap_timeout_s``,
        ``gpu_memory``, ``backend``) are accepted; a None value means "not given" (the
        environment, else the default, applies); keys that name no setting are ignored.

        Raises:
            pydantic.ValidationError: a value of the wrong type or out of range.
        """
        overrides = {k: v for k, v in overrides.items() if v is not None}
        if isinstance(cfg, Settings):
            return cfg.model_copy(update=overrides) if overrides else cfg
        given = {**dict(cfg or {}), **overrides}
        for old, new in LEGACY_KEYS.items():
            if old in given:
                value = given.pop(old)
                given.setdefault(new, value)
        return cls(**{k: v for k, v in given.items() if v is not None and k in cls.model_fields})


def default_home() -> Path:
    """The state directory of this environment (``$OPENRL_HOME`` or :data:`DEFAULT_HOME`), absolute."""
    return Settings().home_dir
