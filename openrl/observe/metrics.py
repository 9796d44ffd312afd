"""Prometheus metrics of the gateway and the workers (prometheus-client, default registry).

Every process exports the metrics it moves; scrape them at:

| process | where |
|---|---|
| gateway | ``GET /metrics`` on the gateway's own port |
| HTTP binding (Knative) | ``GET /metrics`` on the function's port |
| JetStream worker | ``http://<host>:$OPENRL_METRICS_PORT/metrics`` (0 or unset = off); the embedded stack's workers bind any free port (``--metrics-port auto``) and record it in ``<state>/ports.json`` |

Metric families (all names start with ``openrl_``; ``*_total`` are counters, so
``rate(...[1m])`` gives per-second values):

gateway
    ``gateway_requests_total{route,method,status}``, ``gateway_request_seconds{route,method}``,
    ``future_latency_seconds{op,outcome}`` (submit → result, measured by the replica that
    published the request), ``futures_in_flight``,
    ``queue_pending_messages{stream,consumer}`` / ``queue_ack_pending_messages`` /
    ``queue_waiting_pulls`` / ``stream_messages{stream}`` (JetStream, read at scrape time).
workers
    ``worker_requests_total{function,op,outcome}``, ``worker_request_seconds{function,op}``,
    ``worker_in_flight{function}``, ``tokens_trained_total{op}``, ``tokens_sampled_total``,
    ``trainer_packed_runs`` (runs per packed forward(_backward) pass),
    ``busy_seconds_total{function}``: seconds during which the function's engine had at least
    one job running (:class:`BusyClock`; overlapping jobs count once, so ``rate(...)`` is the
    busy fraction, between 0 and 1),
    ``sampler_adapter_cache_total{result="hit"|"miss"}``,
    ``trainer_kl_sample_train_v1{base_model}``, ``trainer_kl_sample_train_v2{base_model}``,
    ``trainer_sample_train_logprob_diff_abs{base_model}`` (mean |Δ|),
    ``trainer_sample_train_logprob_diff_abs_max{base_model}``: histograms with one observation
    per forward(_backward) request whose datums carry sampler logprobs (the sampler–trainer
    mismatch, ``functions/trainer/mismatch.py``), ``trainer_sample_train_tokens_total{base_model}``
    the tokens they were measured on,
    ``startup_seconds{phase}``: seconds per start-up phase of the worker process (process
    start, model load, kernels / vLLM compile and CUDA graphs, first pass, adapter restore:
    :mod:`openrl.observe.startup`),
    ``function_info{function,device,dtype,backend}`` (always 1: what the function runs on,
    from its ``describe()``; ``backend`` is ``pending`` until its first model has loaded).
per API key (label ``owner`` = the owner id the gateway derives from the key, never the key)
    ``usage_tokens_trained_total{owner}``, ``usage_tokens_sampled_total{owner}``,
    ``usage_gpu_seconds_total{owner,function}``: seconds the accelerator (the CPU in the
    embedded stack) spent on the owner's requests; a packed pass is split by token share.
    These are per worker process; :mod:`openrl.observe.usage` keeps the totals every gateway
    replica reads (``GET /api/v1/usage``, the gateway's ``openrl_key_usage{owner,measure}``).

Label values are bounded: routes are path templates, ops the Tinker operations, owners
the API keys in use.
"""

from __future__ import annotations

import re
import threading
import time
from collections import OrderedDict

from prometheus_client import (
    CONTENT_TYPE_LATEST, REGISTRY, Counter, Gauge, Histogram, Info, disable_created_metrics, generate_latest,
)
from prometheus_client.core import CounterMetricFamily

from openrl.config import Settings

disable_created_metrics()  # no *_created series: they double the exposition and dashboards never use them

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)

# ----- gateway ------------------------------------------------------------------------------
GATEWAY_REQUESTS = Counter("openrl_gateway_requests", "HTTP requests answered by the gateway",
                           ["route", "method", "status"])
GATEWAY_REQUEST_SECONDS = Histogram("openrl_gateway_request_seconds", "Gateway HTTP request duration (seconds)",
                                    ["route", "method"], buckets=LATENCY_BUCKETS)
FUTURE_LATENCY = Histogram("openrl_future_latency_seconds",
                           "Seconds from publishing a request to its result landing in the futures bucket",
                           ["op", "outcome"], buckets=LATENCY_BUCKETS)
FUTURES_IN_FLIGHT = Gauge("openrl_futures_in_flight", "Futures this gateway replica published that have no result yet")
QUEUE_PENDING = Gauge("openrl_queue_pending_messages", "JetStream consumer num_pending: messages not yet delivered",
                      ["stream", "consumer"])
QUEUE_ACK_PENDING = Gauge("openrl_queue_ack_pending_messages",
                          "JetStream consumer num_ack_pending: delivered, not yet acked (running)",
                          ["stream", "consumer"])
QUEUE_WAITING = Gauge("openrl_queue_waiting_pulls", "JetStream consumer num_waiting: pull requests of idle workers",
                      ["stream", "consumer"])
STREAM_MESSAGES = Gauge("openrl_stream_messages", "Messages stored in a work stream (not yet acked)", ["stream"])

# ----- workers ------------------------------------------------------------------------------
WORKER_REQUESTS = Counter("openrl_worker_requests", "Request events handled by a function",
                          ["function", "op", "outcome"])
WORKER_REQUEST_SECONDS = Histogram("openrl_worker_request_seconds", "Seconds a function spent on one request event",
                                   ["function", "op"], buckets=LATENCY_BUCKETS)
WORKER_IN_FLIGHT = Gauge("openrl_worker_in_flight", "Request events being handled now", ["function"])
TOKENS_TRAINED = Counter("openrl_tokens_trained", "Tokens in the datums of forward(_backward) requests run",
                         ["op"])
TOKENS_SAMPLED = Counter("openrl_tokens_sampled", "Tokens generated by the sampler")
PACKED_RUNS = Histogram("openrl_trainer_packed_runs", "Training runs packed into one forward(_backward) pass",
                        buckets=(1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64))
#: sampler–trainer logprob mismatch per request (functions/trainer/mismatch.py; ~2e-4 is a healthy
#: kl_sample_train_v1 for a dense model in bf16, per tinker_cookbook's rl_numerics_check)
MISMATCH_BUCKETS = (1e-7, 1e-6, 1e-5, 3e-5, 1e-4, 2e-4, 5e-4, 1e-3, 2e-3, 5e-3, 1e-2, 3e-2, 0.1, 0.3, 1, 3, 10)
#: v1 is a KL estimate (>= 0 in expectation): a request's v1 <= 0 (noise) lands in the ``le="0"``
#: bucket; no negative bounds, so that ``_sum`` is exposed (prometheus_client drops it otherwise)
KL_V1_BUCKETS = (0, *MISMATCH_BUCKETS)
KL_SAMPLE_TRAIN_V1 = Histogram("openrl_trainer_kl_sample_train_v1",
                               "mean(sampler logprob - trainer logprob) over a request's sampled tokens",
                               ["base_model"], buckets=KL_V1_BUCKETS)
KL_SAMPLE_TRAIN_V2 = Histogram("openrl_trainer_kl_sample_train_v2",
                               "0.5 * mean((sampler logprob - trainer logprob)^2) over a request's sampled tokens",
                               ["base_model"], buckets=MISMATCH_BUCKETS)
SAMPLE_TRAIN_ABS = Histogram("openrl_trainer_sample_train_logprob_diff_abs",
                             "mean |sampler logprob - trainer logprob| over a request's sampled tokens",
                             ["base_model"], buckets=MISMATCH_BUCKETS)
SAMPLE_TRAIN_ABS_MAX = Histogram("openrl_trainer_sample_train_logprob_diff_abs_max",
                                 "max |sampler logprob - trainer logprob| over a request's sampled tokens",
                                 ["base_model"], buckets=MISMATCH_BUCKETS)
SAMPLE_TRAIN_TOKENS = Counter("openrl_trainer_sample_train_tokens",
                              "Sampled tokens whose sampler-trainer logprob mismatch was measured", ["base_model"])
SNAPSHOT_SAVES = Counter("openrl_trainer_snapshot_saves", "Unnamed sampler snapshots saved, by the way they reach "
                         "the sampler (memory: the shared-memory handoff; storage: no room there)", ["path"])
SNAPSHOT_PACKS = Counter("openrl_trainer_snapshot_packs", "Unnamed sampler snapshots packed on the device, by "
                         "when (beside_pass: while another runs' pass held the engine lock; locked: holding it)",
                         ["when"])
SNAPSHOT_PERSIST_FAILURES = Counter("openrl_trainer_snapshot_persist_failures",
                                    "Handed-off sampler snapshots whose background write to storage failed "
                                    "(every retry); they stay in the handoff until a trainer writes them")
SNAPSHOT_SOURCE = Counter("openrl_sampler_snapshot_source", "Sample requests on a snapshot, by where the sampler "
                          "found its directory (handoff: shared memory; storage)", ["source"])
ADAPTER_LOAD_SECONDS = Histogram("openrl_sampler_adapter_load_seconds", "Seconds the sampler's backend took to "
                                 "load one adapter (vLLM: add_lora, read + cast + pin)", buckets=LATENCY_BUCKETS)
ADAPTER_LOAD_PART_SECONDS = Histogram("openrl_sampler_adapter_load_part_seconds", "Seconds of one adapter load by "
                                      "part (vLLM: check = reading adapter_config.json in a thread; preload = waiting for the "
                                      "background build in vLLM's worker, OPENRL_VLLM_PRELOAD; engine = the add_lora "
                                      "call to vLLM's engine core, its queue behind engine steps included)",
                                      ["part"], buckets=LATENCY_BUCKETS)
ADAPTER_CACHE = Counter("openrl_sampler_adapter_cache", "Sampler adapter lookups (hit: already loaded)", ["result"])
FUNCTION_INFO = Info("openrl_function", "What a function runs on (device, dtype, backend), from its describe()",
                     ["function"])

# ----- per API key --------------------------------------------------------------------------
USAGE_TOKENS_TRAINED = Counter("openrl_usage_tokens_trained", "Tokens trained per owner (API key id)", ["owner"])
USAGE_TOKENS_SAMPLED = Counter("openrl_usage_tokens_sampled", "Tokens sampled per owner (API key id)", ["owner"])
USAGE_GPU_SECONDS = Counter("openrl_usage_gpu_seconds",
                            "Accelerator seconds spent on an owner's requests (CPU seconds on a CPU stack)",
                            ["owner", "function"])

UNKNOWN_OWNER = "unknown"


class BusyClock:
    """Seconds during which at least one job was running (a union of intervals, not a sum).

    ``with clock.job(): ...`` around each job; overlapping jobs (concurrent samples, a save
    beside a pass) count once. :meth:`seconds` includes the interval still open, so a scrape
    in the middle of a long job sees it. Exported as ``openrl_busy_seconds_total{function}``
    (unit: seconds; a counter, so busy fraction = increase / wall seconds) by
    :data:`BUSY_COLLECTOR` for every clock :func:`busy_clock` made.

    Args:
        clock: the time source (seconds; default ``time.monotonic``), for tests.
    """

    def __init__(self, clock=time.monotonic):
        self._clock = clock
        self._lock = threading.Lock()
        self._active = 0
        self._since = 0.0
        self._total = 0.0

    def enter(self) -> None:
        with self._lock:
            if self._active == 0:
                self._since = self._clock()
            self._active += 1

    def exit(self) -> None:
        with self._lock:
            if self._active <= 0:
                return
            self._active -= 1
            if self._active == 0:
                self._total += max(0.0, self._clock() - self._since)

    def job(self):
        """Context manager: one job running for the duration of the ``with`` block."""
        from contextlib import contextmanager

        @contextmanager
        def _job():
            self.enter()
            try:
                yield
            finally:
                self.exit()

        return _job()

    def seconds(self) -> float:
        """Busy seconds so far, the open interval included."""
        with self._lock:
            return self._total + (max(0.0, self._clock() - self._since) if self._active else 0.0)


class _BusyCollector:
    """Exports ``openrl_busy_seconds_total{function}`` from the :class:`BusyClock` s of this process."""

    def __init__(self):
        self.clocks: dict[str, BusyClock] = {}

    def collect(self):
        fam = CounterMetricFamily("openrl_busy_seconds",
                                  "Seconds the function's engine had at least one job running (overlaps count once)",
                                  labels=["function"])
        for name, clock in sorted(self.clocks.items()):
            fam.add_metric([name], clock.seconds())
        yield fam


BUSY_COLLECTOR = _BusyCollector()
REGISTRY.register(BUSY_COLLECTOR)


def busy_clock(function: str) -> BusyClock:
    """The process's :class:`BusyClock` of ``function`` (``trainer``, ``sampler``), made on first use."""
    clock = BUSY_COLLECTOR.clocks.get(function)
    if clock is None:
        clock = BUSY_COLLECTOR.clocks.setdefault(function, BusyClock())
    return clock


def exposition() -> tuple[bytes, str]:
    """(body, content type) of the Prometheus text exposition of this process."""
    return generate_latest(REGISTRY), CONTENT_TYPE_LATEST


def serve(port: int | str | None = None, host: str | None = None) -> int:
    """Serve ``/metrics`` on a background thread (for processes without an HTTP app).

    Args:
        port: TCP port, or ``"auto"``: any free port (the system picks it when the server
            binds; the return value says which). Default ``$OPENRL_METRICS_PORT``. 0 or
            unset: do nothing.
        host: bind address; default ``$OPENRL_METRICS_HOST`` or ``0.0.0.0``.

    Returns:
        The port served, or 0 when metrics are off.

    Raises:
        OSError: the port is taken.
        ValueError: ``port`` is a string other than ``"auto"``.
    """
    if port is None or not host:
        env = Settings()
        port = env.metrics_port if port is None else port
        host = host or env.metrics_host
    if isinstance(port, str) and port != "auto":
        raise ValueError(f"metrics port must be a number or 'auto', got {port!r}")
    if not port:
        return 0
    from prometheus_client import start_http_server

    server, _ = start_http_server(0 if port == "auto" else port, addr=host)
    return server.server_port


# ----- hooks the functions call -------------------------------------------------------------
def set_function_info(function: str, info: dict) -> None:
    """Publish what ``function`` runs on as ``openrl_function_info{function=...,<key>=<value>} 1``.

    The bindings call it after the Function's ``start()`` (and again later: the JetStream
    worker on each presence refresh, the HTTP binding at each scrape), with the Function's
    ``describe()``, e.g. ``{"device": "cuda", "dtype": "bfloat16", "backend": "vllm"}``.

    Args:
        function: the function's name (``trainer``, ``sampler``).
        info: label values; each call replaces the previous set. Values are turned into
            strings (None into ``""``); keys that are not valid Prometheus label names, or
            that clash with ``function``, are left out.
    """
    labels = {}
    for key, value in (info or {}).items():
        key = str(key)
        if key == "function" or key.startswith("__") or not _LABEL_NAME.fullmatch(key):
            continue
        labels[key] = "" if value is None else str(value)
    FUNCTION_INFO.labels(function).info(labels)


_LABEL_NAME = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*")


def record_trained(work: list[tuple[str | None, str, int]], seconds: float, *, function: str = "trainer") -> None:
    """Account one trainer pass.

    Args:
        work: one ``(owner, op, tokens)`` per request in the pass; ``op`` forward or
            forward_backward for token counts, anything else (optim_step, save) counts
            only seconds.
        seconds: device seconds of the whole pass; split among owners by token share
            (evenly when no request has tokens).
    """
    from openrl.observe.usage import LEDGER

    total = sum(t for _, _, t in work)
    for owner, op, tokens in work:
        owner = owner or UNKNOWN_OWNER
        trained = 0
        if tokens:
            TOKENS_TRAINED.labels(op).inc(tokens)
            if op == "forward_backward":
                USAGE_TOKENS_TRAINED.labels(owner).inc(tokens)
                trained = tokens
        share = (tokens / total) if total else 1.0 / max(1, len(work))
        USAGE_GPU_SECONDS.labels(owner, function).inc(max(0.0, seconds) * share)
        # the per-key ledger every gateway replica reads (openrl/observe/usage.py)
        LEDGER.add(owner, function=function, tokens_trained=trained, seconds=max(0.0, seconds) * share)


def record_sample_train(base_model: str | None, metrics: dict[str, float]) -> None:
    """Observe one forward(_backward) request's sampler–trainer mismatch.

    Args:
        base_model: the run's base-model name (label ``base_model``; ``unknown`` if None).
        metrics: the request's :meth:`functions.trainer.mismatch.MismatchStats.metrics`; a
            request with no measured token (``sample_train_tokens:sum`` 0) observes nothing.
    """
    tokens = float(metrics.get("sample_train_tokens:sum", 0.0))
    if tokens <= 0:
        return
    label = base_model or UNKNOWN_OWNER
    SAMPLE_TRAIN_TOKENS.labels(label).inc(tokens)
    KL_SAMPLE_TRAIN_V1.labels(label).observe(metrics["kl_sample_train_v1:mean"])
    KL_SAMPLE_TRAIN_V2.labels(label).observe(metrics["kl_sample_train_v2:mean"])
    SAMPLE_TRAIN_ABS.labels(label).observe(metrics["sample_train_logprob_diff_abs:mean"])
    SAMPLE_TRAIN_ABS_MAX.labels(label).observe(metrics["sample_train_logprob_diff_abs:max"])


def record_sampled(owner: str | None, tokens: int, seconds: float, prompt_tokens: int = 0) -> None:
    """Account one sampling request: ``tokens`` generated (all its sequences) after a prefill of
    ``prompt_tokens``, in ``seconds`` of engine time."""
    from openrl.observe.usage import LEDGER

    owner = owner or UNKNOWN_OWNER
    TOKENS_SAMPLED.inc(tokens)
    USAGE_TOKENS_SAMPLED.labels(owner).inc(tokens)
    USAGE_GPU_SECONDS.labels(owner, "sampler").inc(max(0.0, seconds))
    LEDGER.add(owner, function="sampler", tokens_sampled=tokens, tokens_prefilled=prompt_tokens,
               seconds=max(0.0, seconds))


class FutureTracker:
    """Submit → result latency of the futures this gateway replica published.

    :meth:`track` at publish time, :meth:`on_update` from the futures-bucket watcher when
    a record changes; a resolved record observes ``openrl_future_latency_seconds`` and
    ends the future's trace span. Entries older than ``max_age_s`` seconds are dropped
    (their span ends with ``openrl.abandoned``), so memory stays bounded.
    """

    def __init__(self, max_age_s: float = 3600.0, max_entries: int = 100_000):
        self.max_age_s, self.max_entries = max_age_s, max_entries
        self._lock = threading.Lock()
        self._pending: OrderedDict[str, tuple[float, str, object]] = OrderedDict()

    def track(self, request_id: str, op: str, span=None) -> None:
        """Start timing ``request_id`` (op ``op``); ``span`` is ended when the result lands."""
        now = time.monotonic()
        with self._lock:
            self._pending[request_id] = (now, op, span)
            while self._pending:
                rid, (t0, _, old_span) = next(iter(self._pending.items()))
                if now - t0 <= self.max_age_s and len(self._pending) <= self.max_entries:
                    break
                del self._pending[rid]
                _end_span(old_span, "abandoned")
            FUTURES_IN_FLIGHT.set(len(self._pending))

    def on_update(self, request_id: str, raw: bytes | None) -> None:
        """Futures-bucket watcher callback: ``raw`` is the encoded FutureRecord."""
        if request_id not in self._pending or not raw:
            return
        state = raw.partition(b"\n")[0]
        try:
            import json

            state = json.loads(state).get("state")
        except ValueError:
            return
        if state == "pending":
            return
        with self._lock:
            item = self._pending.pop(request_id, None)
            FUTURES_IN_FLIGHT.set(len(self._pending))
        if item is None:
            return
        t0, op, span = item
        FUTURE_LATENCY.labels(op, state).observe(time.monotonic() - t0)
        _end_span(span, state)

    def __len__(self) -> int:
        return len(self._pending)


def _end_span(span, outcome: str) -> None:
    if span is None:
        return
    try:
        span.set_attribute("openrl.outcome", outcome)
        if outcome != "ok":
            from opentelemetry.trace import Status, StatusCode

            span.set_status(Status(StatusCode.ERROR, outcome))
        span.end()
    except Exception:  # noqa: BLE001 - tracing never breaks a request
        pass


FUTURES = FutureTracker()


async def refresh_queue_gauges(bus) -> list[dict]:
    """Read the work streams' consumer infos from JetStream into the queue gauges.

    Returns the stream summaries of :func:`queue_status` (so ``/api/v1/status`` and
    ``/metrics`` share one read).
    """
    streams = await queue_status(bus)
    for s in streams:
        STREAM_MESSAGES.labels(s["stream"]).set(s["messages"])
        for c in s["consumers"]:
            QUEUE_PENDING.labels(s["stream"], c["consumer"]).set(c["num_pending"])
            QUEUE_ACK_PENDING.labels(s["stream"], c["consumer"]).set(c["num_ack_pending"])
            QUEUE_WAITING.labels(s["stream"], c["consumer"]).set(c["num_waiting"])
    return streams


async def queue_status(bus) -> list[dict]:
    """The work streams and their consumers as JSON-able dicts.

    Each stream: ``{"stream", "messages", "bytes", "consumers": [...]}``; each consumer:
    ``{"consumer", "num_pending", "num_ack_pending", "num_waiting", "num_redelivered",
    "last_active" (ISO-8601 or None), "idle_s" (seconds since last delivery or None),
    "state"}`` where ``state`` is ``busy`` (requests running), ``polling`` (a worker is
    waiting for work), ``backlog`` (messages wait, nobody pulls: no live worker) or ``idle``.
    A stream that does not exist yet is skipped.
    """
    from datetime import datetime, timezone

    from nats.js.errors import NotFoundError

    from openrl.transport.bus import SAMPLE_STREAM, TRAIN_STREAM

    jsm = bus.nc.jsm()
    out = []
    now = datetime.now(timezone.utc)
    for name in (TRAIN_STREAM, SAMPLE_STREAM):
        try:
            si = await jsm.stream_info(name)
            infos = await jsm.consumers_info(name)
        except NotFoundError:
            continue
        consumers = []
        for ci in sorted(infos, key=lambda c: c.name):
            last = ci.delivered.last_active if ci.delivered else None
            if ci.ack_floor and ci.ack_floor.last_active and (last is None or ci.ack_floor.last_active > last):
                last = ci.ack_floor.last_active
            pending, acking, waiting = ci.num_pending or 0, ci.num_ack_pending or 0, ci.num_waiting or 0
            state = "busy" if acking else "polling" if waiting else "backlog" if pending else "idle"
            consumers.append({
                "consumer": ci.name,
                "filter_subject": getattr(ci.config, "filter_subject", None),
                "num_pending": pending,
                "num_ack_pending": acking,
                "num_waiting": waiting,
                "num_redelivered": ci.num_redelivered or 0,
                "last_active": last.isoformat().replace("+00:00", "Z") if last else None,
                "idle_s": round((now - last).total_seconds(), 3) if last else None,
                "state": state,
            })
        out.append({"stream": name, "messages": si.state.messages, "bytes": si.state.bytes, "consumers": consumers})
    return out
