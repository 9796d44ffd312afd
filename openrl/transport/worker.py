"""Run one Function as a JetStream worker process.

    python -m openrl.transport.worker functions.trainer --nats nats://127.0.0.1:4222 [--shard 0]
    python -m openrl.transport.worker functions.sampler --nats nats://127.0.0.1:4222

Logs are JSON lines (:mod:`openrl.observe.logs`); Prometheus metrics are served on
``--metrics-port`` / ``$OPENRL_METRICS_PORT`` (0 = off, :mod:`openrl.observe.metrics`;
``--metrics-port auto``: any free port, recorded with ``--ports-file <state>/ports.json`` as
:mod:`openrl.transport.portsfile` says, which is how the embedded stack starts it); traces are
exported when ``OTEL_EXPORTER_OTLP_ENDPOINT`` is set (:mod:`openrl.observe.tracing`).

A start that raises (an import error, a setting the Function refuses, NATS unreachable) ends
the process with exit code :data:`EXIT_START_FAILED` (3) after one line on stdout (its log in
the embedded stack), ``[<module>] start failed: <ExceptionType>: <first line of the message>``
(:func:`start_failed_line`; the full traceback is in the JSON log record before it). The
embedded stack's supervisor reads that line as the cause of a failed start
(:func:`openrl.transport.supervisor.start_error`).

SIGTERM / SIGINT stop fetching, drain requests in flight (up to ``--drain-s`` seconds),
then call the Function's ``stop()``.

While it runs, the worker describes itself in the ``OPENRL_META`` KV bucket under
``workers.<function>.<shard>.<instance>`` (key parts as :func:`openrl.transport.bus.kv_key` encodes
them; the shard is ``-`` for the sampler, the instance ``<host>:<pid>``): function, shard,
pid, host, device, dtype, backend, models_failed, details (from the Function's ``describe()``;
``models_failed``: the base models that failed to load, :mod:`openrl.model.loadfailures`;
``details``: the :data:`DETAIL_KEYS` it gives: the trainer's fused-kernel states, the vLLM
sampler's unembedding-LoRA mode, the jobs it routed to transformers and why),
started, updated.
It rewrites the record every ``$OPENRL_WORKER_REFRESH_S`` seconds (default 30), so
``backend`` / ``dtype`` follow the first model load, and deletes it on a clean stop.
``GET /api/v1/status`` reads the records (:func:`worker_records`); one not refreshed for
three intervals (a killed worker) is ignored, and the next worker to start deletes it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import socket
import sys
import time

from openrl.config import Settings
from openrl.errors import first_line
from openrl.contract.function import probe
from openrl.observe import metrics, startup
from openrl.transport import portsfile
from openrl.transport.bindings import load_function
from openrl.transport.bindings.idle_sleep import IdleSleep, Sleepy, can_sleep
from openrl.transport.bindings.jetstream import JetStreamWorker
from openrl.contract import topology
from openrl.transport.bus import Bus, now_iso

log = logging.getLogger("openrl.transport.worker")

#: First key part of the worker records in the OPENRL_META bucket.
WORKERS_KEY = "workers"
#: Default seconds between two rewrites of a worker's record ($OPENRL_WORKER_REFRESH_S).
REFRESH_S = 30.0
#: Exit code of a worker whose start raised.
EXIT_START_FAILED = 3
#: What follows ``[<module>] `` on the last line a worker whose start raised writes.
START_FAILED = "start failed: "


class StartFailed(Exception):
    """The Function or its binding could not start; the message is the cause's first line
    (the original exception is ``__cause__``)."""


def start_failed_line(module: str, exc: BaseException) -> str:
    """``[functions.sampler] start failed: RegistryError: ...``: the line a worker whose start
    raised ``exc`` writes last."""
    return f"[{module}] {START_FAILED}{first_line(exc)}"


def _start_failed(module: str, exc: BaseException) -> StartFailed:
    log.error("%s", start_failed_line(module, exc), exc_info=exc)
    print(start_failed_line(module, exc), flush=True)
    return StartFailed(first_line(exc))


def consumer_for(module: str, shard: int) -> dict:
    """Stream, durable consumer name, subject filter and result source of a function module
    (``functions.trainer`` / ``functions.sampler``), as :func:`openrl.contract.topology.consumer` defines them.

    Raises:
        ValueError: the module serves no known function.
    """
    return topology.consumer(topology.function_of_module(module), shard).as_dict()


def function_of_consumer(consumer: str) -> tuple[str, int | None]:
    """``"trainer-3"`` -> ``("trainer", 3)``, ``"sampler"`` -> ``("sampler", None)``: the
    (function, shard) a durable consumer name stands for (as ``/api/v1/status`` reports it)."""
    name, _, shard = consumer.partition("-")
    return name, (int(shard) if shard.isdigit() else None)


#: ``describe()`` keys copied into a worker record's ``details`` (shown by ``openrl status``).
DETAIL_KEYS = ("kernels", "unembed", "routed", "fallback_error", "gpu_memory", "deterministic")


def describe(fn) -> dict:
    """The Function's ``describe()`` (device, dtype, backend, ...) as a dict of strings;
    ``{}`` when it has none or it fails (describing never stops a worker)."""
    try:
        info = getattr(fn, "describe", lambda: {})() or {}
        return {str(k): (None if v is None else str(v)) for k, v in dict(info).items()}
    except Exception:  # noqa: BLE001
        log.warning("describe() failed", exc_info=True)
        return {}


def _shard_part(shard: int | None) -> str:
    return "-" if shard is None else str(shard)


def _is_stale(rec: dict, now: float) -> bool:
    refresh = float(rec.get("refresh_s") or REFRESH_S)
    return now - float(rec.get("updated_unix") or 0) > 3 * refresh + 5


class WorkerPresence:
    """This worker's record in the ``OPENRL_META`` bucket (see the module doc).

    Args:
        bus: a connected :class:`openrl.transport.bus.Bus`.
        fn: the started Function (its ``describe()`` is read on every refresh).
        function / shard: what the worker serves (``"trainer"``, 0 / ``"sampler"``, None).
        refresh_s: seconds between rewrites; default ``Settings().worker_refresh_s``
            (``$OPENRL_WORKER_REFRESH_S`` or 30).

    Raises:
        ValueError: ``refresh_s`` not > 0.
    """

    def __init__(self, bus: Bus, fn, *, function: str, shard: int | None, refresh_s: float | None = None,
                 sleeper: IdleSleep | None = None):
        if refresh_s is None:
            refresh_s = Settings().worker_refresh_s
        if not refresh_s > 0:
            raise ValueError(f"refresh_s (OPENRL_WORKER_REFRESH_S) must be > 0 seconds, got {refresh_s}")
        self.bus, self.fn = bus, fn
        self.function, self.shard, self.refresh_s = function, shard, float(refresh_s)
        self.host, self.pid = socket.gethostname(), os.getpid()
        self.instance = f"{self.host}:{self.pid}"
        self.started = now_iso()
        self.sleeper = sleeper
        self._task: asyncio.Task | None = None
        self._pending_publish: asyncio.Task | None = None
        self._dirty = False

    @property
    def key(self) -> tuple[str, ...]:
        """The record's key parts (``Bus.meta_put(value, *key)``)."""
        return (WORKERS_KEY, self.function, _shard_part(self.shard), self.instance)

    def record(self) -> dict:
        """The record as written now; also refreshes ``openrl_function_info``."""
        info = describe(self.fn)
        metrics.set_function_info(self.function, info)
        return {
            "function": self.function, "shard": self.shard, "instance": self.instance, "pid": self.pid,
            "host": self.host, "device": info.get("device"), "dtype": info.get("dtype"),
            "backend": info.get("backend"), "models_failed": info.get("models_failed"),
            "details": {k: v for k, v in info.items() if k in DETAIL_KEYS} or None,
            "sleep": None if self.sleeper is None else self.sleeper.describe(),
            "started": self.started, "updated": now_iso(),
            "updated_unix": round(time.time(), 3), "refresh_s": self.refresh_s,
        }

    def changed(self, _state: str = "") -> None:
        """Rewrite the record soon (the sleep state changed); never raises. Changes that come
        while a rewrite is under way are written by one more rewrite after it."""
        self._dirty = True
        if self._pending_publish is not None and not self._pending_publish.done():
            return

        async def _publish() -> None:
            while self._dirty:
                self._dirty = False
                try:
                    await self.publish()
                except Exception as exc:  # noqa: BLE001 - NATS restarting: the periodic refresh catches up
                    log.warning("could not rewrite the worker record: %s", exc)
                    return

        try:
            self._pending_publish = asyncio.get_running_loop().create_task(_publish())
        except RuntimeError:  # no running loop (tests calling it directly)
            pass

    async def publish(self) -> dict:
        """Write the record once; returns it."""
        rec = self.record()
        await self.bus.meta_put(rec, *self.key)
        return rec

    async def start(self) -> None:
        """Write the record, delete records of workers that stopped refreshing theirs, and
        keep rewriting it every ``refresh_s`` seconds until :meth:`stop`."""
        await self.publish()
        try:
            now = time.time()
            for rec in await self.bus.meta_list(WORKERS_KEY):
                if _is_stale(rec, now) and rec.get("function") and rec.get("instance"):
                    await self.bus.meta_delete(WORKERS_KEY, rec["function"], _shard_part(rec.get("shard")),
                                               rec["instance"])
        except Exception as exc:  # noqa: BLE001 - housekeeping only
            log.warning("could not delete stale worker records: %s", exc)
        self._task = asyncio.create_task(self._loop())

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.refresh_s)
            try:
                await self.publish()
            except Exception as exc:  # noqa: BLE001 - NATS restarting: try again next time
                log.warning("could not refresh the worker record: %s", exc)

    async def stop(self) -> None:
        """Stop refreshing and delete the record (a clean stop)."""
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None
        try:
            await self.bus.meta_delete(*self.key)
        except Exception as exc:  # noqa: BLE001 - NATS down: the record goes stale instead
            log.warning("could not delete the worker record: %s", exc)


async def worker_records(bus: Bus) -> dict[tuple[str, int | None], dict]:
    """The live worker records, newest per (function, shard).

    Records not refreshed for three of their intervals (a killed worker) are left out.
    """
    now = time.time()
    out: dict[tuple[str, int | None], dict] = {}
    for rec in await bus.meta_list(WORKERS_KEY):
        if _is_stale(rec, now) or not rec.get("function"):
            continue
        key = (rec["function"], rec.get("shard"))
        if key not in out or float(rec.get("updated_unix") or 0) > float(out[key].get("updated_unix") or 0):
            out[key] = rec
    return out


async def serve(module: str, nats_url: str | None, shard: int, cfg: "Settings | dict | None", drain_s: float, *,
                stop: asyncio.Event | None = None, refresh_s: float | None = None) -> None:
    """Start the Function of ``module``, consume its JetStream work until ``stop`` is set
    (default: until SIGTERM / SIGINT), then drain, delete the worker record and stop it.

    Args:
        module: function module, e.g. ``functions.trainer``.
        nats_url: NATS URL (None: ``cfg.nats_url``, ``$OPENRL_NATS_URL``).
        shard: trainer shard served (ignored by the sampler).
        cfg: the Function's ``start()`` config (:class:`openrl.config.Settings`, or a dict of
            explicit values over the environment).
        drain_s: seconds to let requests in flight finish on stop.
        stop: an event that ends the worker (tests); None installs signal handlers.
        refresh_s: seconds between worker-record rewrites (default ``cfg.worker_refresh_s``).

    Raises:
        StartFailed: the start raised (importing the module, ``start()``, connecting to NATS,
            binding the consumer); the line :func:`start_failed_line` was printed and logged.
    """
    startup.record("process_to_serve", startup.process_age_s())
    try:
        cfg = Settings.of(cfg)
        fn = load_function(module)
        with startup.timed("function_start"):
            await fn.start(cfg)
        ok, reason = probe(fn.ready())
        if not ok:  # a Function that finishes loading later still gets its work (JetStream holds it until then)
            log.warning("%s is not ready after start(): %s", module, reason)
        consumer = consumer_for(module, shard)
        function, shard_id = function_of_consumer(consumer["durable"])
        metrics.set_function_info(function, describe(fn))
        bus = await Bus(nats_url or cfg.nats_url).connect()
        sleeper = None
        if cfg.sleep_after > 0 and can_sleep(fn):
            sleeper = IdleSleep(fn, cfg.sleep_after)
        worker = JetStreamWorker(fn if sleeper is None else Sleepy(fn, sleeper), bus, **consumer)
        presence = WorkerPresence(bus, fn, function=function, shard=shard_id,
                                  refresh_s=refresh_s if refresh_s is not None else cfg.worker_refresh_s,
                                  sleeper=sleeper)
        await presence.start()
        if sleeper is not None:
            sleeper.on_change = presence.changed
            sleeper.start()
    except Exception as exc:  # noqa: BLE001 - any start error: one line naming it, then exit
        raise _start_failed(module, exc) from exc
    if stop is None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
    run = asyncio.create_task(worker.run())
    startup.record("ready", startup.process_age_s())
    print(f"[{module}] ready", flush=True)
    await stop.wait()
    if sleeper is not None:
        await sleeper.stop()
    await worker.stop(drain_s)
    run.cancel()
    await presence.stop()
    await fn.stop()
    await bus.close()


def _metrics_port(value: str) -> int | str:
    """``--metrics-port``: a port number, or ``auto`` (any free port).

    Raises:
        argparse.ArgumentTypeError: neither.
    """
    if value == "auto":
        return value
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"a port number or 'auto', not {value!r}") from None


def main(argv: list[str] | None = None) -> None:
    """Command line: see the module doc."""
    ap = argparse.ArgumentParser(prog="python -m openrl.transport.worker")
    ap.add_argument("module", help="function module, e.g. functions.trainer")
    ap.add_argument("--nats", default=None, help="NATS URL (default $OPENRL_NATS_URL)")
    ap.add_argument("--shard", type=int, default=0, help="trainer shard served by this process")
    ap.add_argument("--config", default="{}",
                    help="JSON object of settings for the Function's start(), over the OPENRL_* environment "
                         "(field names of openrl.config.Settings)")
    ap.add_argument("--drain-s", type=float, default=30.0)
    ap.add_argument("--metrics-port", type=_metrics_port, default=None,
                    help="serve Prometheus /metrics on this port, or 'auto': any free port "
                         "(default $OPENRL_METRICS_PORT; 0 = off)")
    ap.add_argument("--ports-file", default=None,
                    help="record the metrics URL served as metrics.<function> in this ports.json "
                         "(openrl.transport.portsfile; the embedded stack's <state>/ports.json)")
    args = ap.parse_args(argv)
    from openrl.observe import logs
    from openrl.observe import tracing

    name = args.module.split(".")[-1]
    try:
        cfg = Settings.of(json.loads(args.config), nats_url=args.nats)  # the one settings object of this process
    except Exception as exc:  # noqa: BLE001 - a bad setting: the line that names it, then exit
        _start_failed(args.module, exc)
        sys.exit(EXIT_START_FAILED)
    logs.setup(name, level=cfg.log_level, fmt=cfg.log_format)
    tracing.setup(f"openrl-{name}")
    port = metrics.serve(args.metrics_port if args.metrics_port is not None else cfg.metrics_port,
                         host=cfg.metrics_host)
    if port:
        log.info("metrics on :%d/metrics", port)
        if args.ports_file:
            portsfile.update(args.ports_file, metrics={name: portsfile.metrics_url(cfg.metrics_host, port)})
    try:
        asyncio.run(serve(args.module, None, args.shard, cfg, args.drain_s))
    except StartFailed:
        sys.exit(EXIT_START_FAILED)
    finally:
        tracing.shutdown()


if __name__ == "__main__":
    main()
