"""The embedded stack's supervisor: restarts what dies, scales idle workers to zero.

``openrl serve`` / ``openrl run`` (:class:`openrl.transport.embedded.Stack` with
``supervise=True``) hand their processes to a :class:`Supervisor`, which checks them every
``poll_s`` (0.5 s) on a background thread:

- **Restarts.** A process that exits without being asked to (any signal or exit code: a
  ``kill -9``, a CUDA out-of-memory kill, an exception) is started again with the same
  command line and environment after an exponential backoff (:class:`Backoff`: 0.5 s,
  1 s, 2 s, ... capped at 30 s; back to 0.5 s once a process ran 60 s). The reason is logged
  (``openrl.supervisor``) and counted in ``openrl_worker_restarts_total{function=...}``. The
  other processes keep running; a restarted trainer restores each run from its last flushed
  state on the run's next request, and the request the dead trainer held unacked is
  redelivered after the JetStream ack wait (``functions/trainer/durable.py``).
  nats-server and the gateway are restarted too, but when one of them dies
  ``crash_limit`` times (3) within ``crash_window_s`` (60 s) the supervisor gives up:
  :attr:`Supervisor.fatal` names it and the stack stops.
- **Workers that cannot start.** A trainer or sampler that dies before it pulls from its work
  consumer (state ``starting``: an import error, a setting its ``start()`` refuses, a crash
  while loading) failed its start. The cause is the last error line it wrote to its log since
  it started (:func:`openrl.transport.startfailures.start_error`: the ``[<module>] start
  failed: ...`` line of :mod:`openrl.transport.worker`, else a traceback's last line), else
  its exit. After ``start_failures`` (3; ``OPENRL_START_FAILURES``) failed starts in a row
  with the same cause (numbers aside; twice as many with any causes) the function is
  **failing**: between start attempts the supervisor drains its consumer and fails each
  queued or new request's future with category ``"server"`` and the start error
  (:func:`openrl.transport.startfailures.drain`, through the dead-letter path's
  :func:`~openrl.transport.bindings.deadletter.fail_undelivered`) instead of letting the SDK
  wait for ever; the seq_ids of the training requests (and the skips) it drained are
  published as skips once the trainer is up again, so those runs go on. Start attempts go on
  every ``failing_retry_s`` (60 s; ``OPENRL_FAILING_RETRY_S``) instead of the backoff;
  requests arriving during an attempt wait for it. The first attempt that pulls ends the
  failing state: the function recovers by itself once the cause is gone. ``openrl status``
  shows the process as ``failing`` with the ``error``; the gauge
  ``openrl_function_failing{function=...}`` is 1 meanwhile. (With ``--push`` the functions
  have no consumer here: they are only restarted.)
- **Scale to zero.** With ``idle_timeout_s`` > 0, a JetStream worker (trainer, sampler) whose
  durable consumer had no pending and no unacked message (``consumer_info``'s
  ``num_pending + num_ack_pending``) and delivered nothing new (``delivered.consumer_seq``
  unchanged: a request handled between two reads leaves nothing pending at either) for
  ``idle_timeout_s`` seconds gets SIGTERM: it stops
  fetching, drains, and the trainer flushes its run state. When messages are pending on
  the consumer of a worker at zero, the worker is started again; requests meanwhile wait in
  the work queue (the gateway only publishes: no request reaches a worker any other way).
  A worker's idle clock is held while another worker is starting (:meth:`Supervisor._peer_starting`),
  so it gets its whole grace after the peer is up.
  Stopping the process frees its GPU memory. The stack then also starts with its workers at
  zero (first started by the first request), unless ``--model`` asks them to preload.

What it sees is written every poll (when it changed, and at least every second) to
``<state>/supervisor.json`` (:meth:`Supervisor.snapshot`; ``openrl status`` prints it) and served
as Prometheus metrics on the port given to :meth:`Supervisor.start` (0: any free port,
:attr:`Supervisor.metrics_port` says which;
``openrl_worker_restarts_total``, ``openrl_function_processes``, ``openrl_function_idle_seconds``,
``openrl_function_failing``).
"""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from openrl.transport import startfailures

log = logging.getLogger("openrl.supervisor")

#: Process states shown by ``openrl status`` (``failing``: a worker that cannot start, see the module doc;
#: shown instead of ``restarting`` / ``starting`` while its function is failing).
RUNNING, STARTING, STOPPING, ZERO, RESTARTING, FAILED, STOPPED, FAILING = (
    "running", "starting", "stopping", "scaled to zero", "restarting", "failed", "stopped", "failing")

#: Seconds after a drain before a pull seen on the consumer counts as the worker's (the drain's
#: own pull requests expire after :data:`openrl.transport.startfailures.DRAIN_FETCH_S`).
DRAIN_LINGER_S = 1.0


@dataclass
class Backoff:
    """Exponential restart delay: ``min(cap_s, base_s * 2 ** (n - 1))`` seconds before the n-th
    restart in a row; the count starts over once a process ran ``stable_s`` seconds."""

    base_s: float = 0.5
    cap_s: float = 30.0
    stable_s: float = 60.0

    def delay(self, n: int) -> float:
        """Seconds to wait before the ``n``-th consecutive restart (n >= 1)."""
        return min(self.cap_s, self.base_s * 2 ** max(0, n - 1))


@dataclass
class Managed:
    """One supervised process.

    Attributes:
        name: ``nats``, ``gateway``, ``trainer``, ``sampler`` or ``dispatcher`` (the metrics'
            ``function`` label).
        spawn: starts the process (same command line and environment every time) and
            returns it; it may block until the process listens (nats-server).
        slot: index of this process in the stack's ``procs`` list, replaced on every start
            (None there: a worker not started yet, in state ``scaled to zero``).
        critical: dying ``crash_limit`` times within ``crash_window_s`` stops the stack.
        consumer: ``(stream, durable)`` of its JetStream work consumer: a worker that scales
            to zero; None for the others.
        log: the file its output goes to (a worker's failed start is read there);
            ``log_offset`` its size when the current process started.
        failing: the start error of a worker whose function is failing (module doc), else None;
            ``cause`` the last failed start's, ``start_fails`` / ``any_start_fails`` failed starts
            in a row with that cause / any, ``skips`` the ``(model_id, seq_id, shard)`` of
            trainer requests drained meanwhile, ``failed_requests`` how many were failed.
    """

    name: str
    spawn: Callable[[], subprocess.Popen]
    slot: int
    critical: bool = False
    consumer: tuple[str, str] | None = None
    state: str = RUNNING
    restarts: int = 0
    streak: int = 0  # restarts in a row without a stable run
    deaths: list[float] = field(default_factory=list)  # monotonic times of unexpected exits
    last_exit: str | None = None
    started_at: float = field(default_factory=time.monotonic)
    restart_at: float = 0.0
    stop_sent_at: float = 0.0
    last_busy: float = field(default_factory=time.monotonic)
    queued: int | None = None
    running: int | None = None
    delivered: int | None = None  # the consumer's delivered sequence at the last read (module doc)
    log: Path | None = None
    log_offset: int = 0
    cause: str | None = None
    start_fails: int = 0
    any_start_fails: int = 0
    failing: str | None = None
    skips: set = field(default_factory=set)
    failed_requests: int = 0
    drained_at: float = 0.0


def describe_exit(code: int) -> str:
    """``-9`` -> ``"killed by SIGKILL"``, ``1`` -> ``"exit code 1"`` (a Popen return code)."""
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


class Supervisor:
    """Watches the stack's processes (see the module doc).

    Args:
        managed: the processes, already started (their current Popen is ``procs[m.slot]``).
        procs: the stack's process list; a restart replaces the entry in place.
        nats_url: where the work consumers are read.
        state_file: ``<state>/supervisor.json``.
        idle_timeout_s: idle grace of the workers (seconds); 0 keeps them up.
        info: extra keys of the state file (e.g. the gateway URL).
        poll_s: seconds between two checks. stop_timeout_s: how long a worker stopped for
            idleness may drain and flush before it is SIGKILLed.
        start_failures: failed starts in a row with the same cause after which a worker's
            function is failing (``>= 1``). failing_retry_s: seconds between start attempts of
            a failing worker (``> 0``). ack_wait_s: the work consumers' ack wait, used if the
            supervisor creates a consumer to drain it (None: ``Settings().ack_wait_s``).

    Raises:
        ValueError: a negative ``idle_timeout_s``, ``start_failures`` < 1, ``failing_retry_s`` <= 0.
    """

    def __init__(self, managed: list[Managed], procs: list[subprocess.Popen], *, nats_url: str, state_file: Path,
                 idle_timeout_s: float = 0.0, info: dict | None = None, poll_s: float = 0.5,
                 backoff: Backoff | None = None, crash_limit: int = 3, crash_window_s: float = 60.0,
                 stop_timeout_s: float = 300.0, start_failures: int = 3, failing_retry_s: float = 60.0,
                 ack_wait_s: float | None = None):
        if idle_timeout_s < 0:
            raise ValueError(f"idle_timeout (--idle-timeout, OPENRL_IDLE_TIMEOUT) must be >= 0 seconds, "
                             f"got {idle_timeout_s}")
        if start_failures < 1:
            raise ValueError(f"start_failures (OPENRL_START_FAILURES) must be >= 1, got {start_failures}")
        if not failing_retry_s > 0:
            raise ValueError(f"failing_retry_s (OPENRL_FAILING_RETRY_S) must be > 0 seconds, got {failing_retry_s}")
        self.start_failures, self.failing_retry_s, self.ack_wait_s = start_failures, float(failing_retry_s), ack_wait_s
        self._bus = None  # a Bus on the supervisor's NATS connection, made when a function first fails
        self.managed, self.procs = managed, procs
        self.nats_url, self.state_file = nats_url, Path(state_file)
        self.idle_timeout_s, self.info = float(idle_timeout_s), dict(info or {})
        self.poll_s, self.backoff = poll_s, backoff or Backoff()
        self.crash_limit, self.crash_window_s, self.stop_timeout_s = crash_limit, crash_window_s, stop_timeout_s
        self.fatal: str | None = None
        self.fatal_event = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._http = None
        self._last_write = 0.0
        self._last_doc: str | None = None
        from prometheus_client import CollectorRegistry, Counter, Gauge

        self.registry = CollectorRegistry()  # its own: several stacks may live in one (test) process
        self.restarts_total = Counter("openrl_worker_restarts", "processes of the embedded stack restarted "
                                      "after they died", ["function"], registry=self.registry)
        self.up = Gauge("openrl_function_processes", "running processes per function (0: scaled to zero or down)",
                        ["function"], registry=self.registry)
        self.idle = Gauge("openrl_function_idle_seconds", "seconds since the function's work consumer last "
                          "held a pending or unacked message", ["function"], registry=self.registry)
        self.failing_gauge = Gauge("openrl_function_failing", "1 while the function's worker cannot start and "
                                   "its requests fail with the start error", ["function"], registry=self.registry)
        for m in managed:
            self.restarts_total.labels(m.name)
            self.failing_gauge.labels(m.name).set(0)
            self.up.labels(m.name).set(0 if procs[m.slot] is None else 1)

    # ----- lifecycle ----------------------------------------------------------------------
    def start(self, metrics_port: int | None = None, metrics_host: str = "127.0.0.1") -> "Supervisor":
        """Start watching on a daemon thread; serve the metrics on ``metrics_port`` (0: any free
        port, :attr:`metrics_port` says which; None: not at all).

        Raises:
            OSError: the metrics port is taken.
        """
        if metrics_port is not None:
            from prometheus_client import start_http_server

            self._http, _ = start_http_server(metrics_port, addr=metrics_host, registry=self.registry)
        self._write(force=True)
        self._thread = threading.Thread(target=lambda: asyncio.run(self._main()), name="openrl-supervisor",
                                        daemon=True)
        self._thread.start()
        return self

    @property
    def metrics_port(self) -> int | None:
        """The port the metrics are served on (None: not served, or stopped)."""
        return self._http.server_port if self._http is not None else None

    def halt(self) -> None:
        """Stop restarting and scaling at once, without waiting (safe in a signal handler: Ctrl-C
        reaches the children too, and their exits must not be taken for crashes)."""
        self._stop.set()

    def stop(self) -> None:
        """Stop watching (no more restarts or scaling); the processes are left as they are."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=60)
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
            self._http = None
        self._write(force=True, stopped=True)

    def proc(self, name: str) -> subprocess.Popen | None:
        """The current (possibly exited) process of ``name``; None before its first start.

        Raises:
            KeyError: no process of that name.
        """
        for m in self.managed:
            if m.name == name:
                return self.procs[m.slot]
        raise KeyError(name)

    # ----- the loop -----------------------------------------------------------------------
    async def _main(self) -> None:
        conn: dict = {"nc": None, "js": None}

        async def quiet(exc) -> None:  # nats-server restarting or stopping: no tracebacks on stderr
            log.debug("supervisor's NATS connection: %s", exc)

        async def quiet_dc() -> None:
            log.debug("supervisor's NATS connection lost; reconnecting")

        async def connect() -> None:  # in the background: restarts never wait for NATS
            import nats

            while not self._stop.is_set():
                try:
                    nc = await nats.connect(self.nats_url, max_reconnect_attempts=-1, reconnect_time_wait=0.5,
                                            connect_timeout=5, error_cb=quiet, disconnected_cb=quiet_dc)
                    conn["nc"], conn["js"] = nc, nc.jetstream(timeout=2)
                    return
                except Exception as exc:  # noqa: BLE001 - nats-server (re)starting
                    log.warning("supervisor: cannot reach NATS yet (%s); retrying", exc)
                    await asyncio.sleep(1.0)

        connecting = asyncio.create_task(connect())
        try:
            while not self._stop.is_set() and self.fatal is None:
                try:
                    await self.tick(conn["js"], conn["nc"])
                except Exception:  # noqa: BLE001 - the supervisor itself never dies of one bad check
                    log.exception("supervisor check failed")
                await asyncio.sleep(self.poll_s)
        finally:
            connecting.cancel()
            if conn["nc"] is not None:
                try:
                    await conn["nc"].close()
                except Exception:  # noqa: BLE001
                    pass

    async def _load(self, js, m: Managed) -> tuple[int, int, int, int] | None:
        """``(num_pending, num_ack_pending, num_waiting, delivered)`` of ``m``'s consumer
        (``delivered``: ``delivered.consumer_seq``, messages the consumer ever delivered); a missing
        consumer counts the stream's messages as pending; None when JetStream cannot be read."""
        if js is None or m.consumer is None:
            return None
        stream, durable = m.consumer
        from nats.js.errors import NotFoundError

        try:
            info = await js.consumer_info(stream, durable)
            return (int(info.num_pending or 0), int(info.num_ack_pending or 0), int(info.num_waiting or 0),
                    int(getattr(info.delivered, "consumer_seq", 0) or 0))
        except NotFoundError:  # no worker ever bound it (new state dir): the stream holds the work
            try:
                return int((await js.stream_info(stream)).state.messages or 0), 0, 0, 0
            except Exception:  # noqa: BLE001
                return None
        except Exception:  # noqa: BLE001 - NATS restarting
            return None

    async def tick(self, js, nc=None) -> None:
        """One check of every process (see the module doc); ``js`` / ``nc``: the JetStream context
        and the NATS connection (None: not connected yet; nothing is read or drained)."""
        now = time.monotonic()
        for m in self.managed:
            if self._stop.is_set():
                return
            p = self.procs[m.slot]
            code = p.poll() if p is not None else None
            if code is not None and m.state in (RUNNING, STARTING):
                if self._stop.is_set():
                    return
                self._died(m, p, code, now)
            elif code is not None and m.state == STOPPING:
                m.state = ZERO
                m.last_exit = describe_exit(code)
                self.up.labels(m.name).set(0)
                log.info("%s (pid %d) scaled to zero after %.1f s idle (%s)", m.name, p.pid,
                         now - m.last_busy, m.last_exit)
            elif p is not None and code is None and m.state == STOPPING and now - m.stop_sent_at > self.stop_timeout_s:
                log.warning("%s (pid %d) did not stop %.0f s after SIGTERM; killing it", m.name, p.pid,
                            self.stop_timeout_s)
                p.kill()
            if self.fatal is not None:
                return
            if m.state == RESTARTING and now >= m.restart_at:
                await self._spawn(m, restart=True)
            load = await self._load(js, m)
            if load is None:
                continue
            pending, ack_pending, waiting, delivered = load
            m.queued, m.running = pending, ack_pending
            # a request handled between two reads leaves nothing pending at either: the delivered
            # sequence moved (a stream of 0.1 s samples polled every 0.5 s looked idle, and the sampler
            # was stopped under load: the H100 sweep of docs/benchmarks.md, fifteenth session)
            moved = m.delivered is not None and delivered != m.delivered
            m.delivered = delivered
            if pending + ack_pending > 0 or moved or m.state == STARTING and not waiting:
                m.last_busy = now  # a worker loading its model is not idle yet
            elif m.state == RUNNING and self._peer_starting(m):
                m.last_busy = now  # its client waits on the peer (an RL step: sample, then train)
            if m.state == STARTING and waiting and now - m.drained_at > DRAIN_LINGER_S:
                m.state = RUNNING  # it pulls
                m.start_fails = m.any_start_fails = 0
                m.cause = None
                if m.failing is not None:
                    await self._recovered(m, nc)
            if m.failing is not None and m.state == RESTARTING and pending > 0 and nc is not None:
                try:
                    await self._drain(m, nc)
                except Exception as exc:  # noqa: BLE001 - NATS restarting: the next check drains
                    log.warning("could not drain the queue of %s: %s", m.name, exc)
            if self.idle_timeout_s > 0 and m.state == RUNNING and now - m.last_busy >= self.idle_timeout_s:
                log.info("%s (pid %d) idle for %.1f s (--idle-timeout %g): SIGTERM", m.name, p.pid,
                         now - m.last_busy, self.idle_timeout_s)
                m.state, m.stop_sent_at = STOPPING, now
                p.send_signal(signal.SIGTERM)
            elif m.state == ZERO and pending + ack_pending > 0:
                log.info("%s: %d requests queued at zero: starting it", m.name, pending + ack_pending)
                await self._spawn(m, restart=False)
            self.idle.labels(m.name).set(round(now - m.last_busy, 3))
        self._write()

    def _peer_starting(self, m: Managed) -> bool:
        """Whether another scaling worker (one with a consumer) is starting now. While it is, ``m``'s
        idle clock is held: an RL loop alternates between sampler and trainer, so a trainer that is
        idle because its client waits for a sampler loading vLLM (110 s from zero on the H200) is
        not done. Without the hold, an ``--idle-timeout`` shorter than the peer's start makes the two
        stop each other in turn (measured: 130 s RL steps at 30 s, docs/benchmarks.md)."""
        return any(o is not m and o.consumer is not None and o.state == STARTING for o in self.managed)

    def _died(self, m: Managed, p: subprocess.Popen, code: int, now: float) -> None:
        failed_start = m.consumer is not None and m.state == STARTING  # died before it pulled
        m.last_exit = describe_exit(code)
        self.up.labels(m.name).set(0)
        if now - m.started_at >= self.backoff.stable_s:
            m.streak = 0
        m.streak += 1
        m.deaths = [t for t in m.deaths if now - t < self.crash_window_s] + [now]
        if m.critical and len(m.deaths) >= self.crash_limit:
            m.state = FAILED
            self.fatal = (f"{m.name} died {len(m.deaths)} times within {self.crash_window_s:g} s "
                          f"(last: {m.last_exit}); stopping the stack")
            log.error("%s", self.fatal)
            self._write(force=True)
            self.fatal_event.set()
            return
        delay = self.backoff.delay(m.streak)
        if failed_start:
            delay = self._failed_start(m, delay)
        m.state, m.restart_at = RESTARTING, now + delay
        log.warning("%s (pid %d) died: %s; restarting in %.1f s (restart %d in a row)", m.name, p.pid,
                    m.last_exit if m.cause is None else f"{m.last_exit}: {m.cause}", delay, m.streak)

    def _failed_start(self, m: Managed, delay: float) -> float:
        """Count a start that died (module doc); returns the delay before the next attempt
        (``failing_retry_s`` once the function is failing)."""
        cause = (startfailures.read_start_error(m.log, m.log_offset) if m.log is not None else None) or (
            f"the process ended ({m.last_exit}) before it took requests")
        m.start_fails = m.start_fails + 1 if startfailures.same_cause(cause, m.cause) else 1
        m.any_start_fails += 1
        m.cause = cause
        if m.failing is None and m.start_fails < self.start_failures and m.any_start_fails < 2 * self.start_failures:
            return delay
        if m.failing is None:
            log.error("%s cannot start: %s (%d failed starts in a row); its requests fail with this error until a "
                      "start succeeds; trying again every %g s (log: %s)", m.name, cause, m.any_start_fails,
                      self.failing_retry_s, m.log)
        m.failing = cause
        self.failing_gauge.labels(m.name).set(1)
        return self.failing_retry_s

    def failing_message(self, m: Managed) -> str:
        """The error of the requests of a failing function (category ``"server"``)."""
        return (f"the {m.name} worker cannot start: {m.failing} ({m.any_start_fails} failed starts in a row; "
                f"openrl serve tries again every {self.failing_retry_s:g} s"
                + (f"; its log: {m.log})" if m.log is not None else ")"))

    async def _bus_on(self, nc):
        from openrl.transport.bus import Bus

        if self._bus is None or self._bus.nc is not nc:
            self._bus = await Bus(self.nats_url, ack_wait_s=self.ack_wait_s).attach(nc)
        return self._bus

    async def _drain(self, m: Managed, nc) -> int:
        """Fail the requests queued on failing ``m``'s consumer (:func:`startfailures.drain`)."""
        bus = await self._bus_on(nc)
        try:
            failed = await startfailures.drain(bus, *m.consumer, self.failing_message(m), m.skips,
                                               stopping=self._stop.is_set)
        finally:
            m.drained_at = time.monotonic()
        if failed:
            m.failed_requests += failed
            log.warning("%s cannot start: failed %d queued requests with its start error", m.name, failed)
        return failed

    async def _recovered(self, m: Managed, nc) -> None:
        """``m`` pulls again: clear its failing state and publish the skips of the trainer
        requests drained meanwhile (:func:`startfailures.publish_skips`)."""
        log.warning("%s is up again after failing to start (%s); %d requests were failed meanwhile",
                    m.name, m.failing, m.failed_requests)
        m.failing = None
        self.failing_gauge.labels(m.name).set(0)
        if m.skips and nc is not None:
            try:
                await startfailures.publish_skips(await self._bus_on(nc), m.skips)
            except Exception as exc:  # noqa: BLE001 - the gap timeout moves the runs on instead
                log.warning("could not publish %d skips after %s recovered: %s", len(m.skips), m.name, exc)
        m.skips.clear()
        m.failed_requests = 0

    async def _spawn(self, m: Managed, *, restart: bool) -> None:
        if self._stop.is_set():
            return
        if m.log is not None:
            try:
                m.log_offset = m.log.stat().st_size
            except OSError:
                m.log_offset = 0
        try:
            new = await asyncio.to_thread(m.spawn)
        except Exception as exc:  # noqa: BLE001 - e.g. nats-server's port still taken: try again later
            m.streak += 1
            delay = self.backoff.delay(m.streak)
            m.state, m.restart_at, m.last_exit = RESTARTING, time.monotonic() + delay, f"start failed: {exc}"
            log.warning("%s could not be started (%s); retrying in %.1f s", m.name, exc, delay)
            return
        self.procs[m.slot] = new
        now = time.monotonic()
        m.started_at = m.last_busy = now
        m.state = STARTING if m.consumer is not None else RUNNING
        self.up.labels(m.name).set(1)
        if restart:
            m.restarts += 1
            self.restarts_total.labels(m.name).inc()
        log.info("%s %s (pid %d)", m.name, "restarted" if restart else "started", new.pid)

    # ----- state file ---------------------------------------------------------------------
    def snapshot(self, *, stopped: bool = False) -> dict:
        """The state file's content::

            {"updated_unix", "idle_timeout_s", "stopped", "fatal", <info>...,
             "processes": [{"name", "state", "pid", "idle_s", "restarts", "last_exit",
                            "queued", "running", "error", "failed_requests"}]}

        ``idle_s`` (seconds since the worker's consumer last held work) and ``queued`` /
        ``running`` (its consumer's pending / unacked messages) are None for nats and the gateway.
        ``state`` is ``failing`` and ``error`` the start error while a worker cannot start
        (``failed_requests``: requests failed with it so far); else ``error`` is None.
        """
        now = time.monotonic()
        rows = []
        for m in self.managed:
            p = self.procs[m.slot]
            alive = p is not None and p.poll() is None
            state = FAILING if m.failing is not None and m.state in (RESTARTING, STARTING) else m.state
            rows.append({"name": m.name, "state": STOPPED if stopped else state,
                         "pid": p.pid if alive and not stopped else None,
                         "idle_s": round(now - m.last_busy, 1) if m.consumer else None, "restarts": m.restarts,
                         "last_exit": m.last_exit, "queued": m.queued, "running": m.running,
                         "error": m.failing, "failed_requests": m.failed_requests})
        return {**self.info, "updated_unix": round(time.time(), 3), "idle_timeout_s": self.idle_timeout_s,
                "stopped": stopped, "fatal": self.fatal, "processes": rows}

    def _write(self, *, force: bool = False, stopped: bool = False) -> None:
        doc = self.snapshot(stopped=stopped)
        key = json.dumps({**doc, "updated_unix": 0, "processes": [{**r, "idle_s": None} for r in doc["processes"]]})
        if not force and key == self._last_doc and time.monotonic() - self._last_write < 1.0:
            return
        tmp = self.state_file.with_name(self.state_file.name + ".tmp")
        tmp.write_text(json.dumps(doc, indent=2) + "\n")
        tmp.replace(self.state_file)
        self._last_doc, self._last_write = key, time.monotonic()
