"""The embedded stack: nats-server, the gateway, one trainer and one sampler on one machine.

``openrl serve`` runs it until Ctrl-C; ``openrl run SCRIPT`` runs it, runs a Python
script against it (``TINKER_BASE_URL`` / ``TINKER_API_KEY`` set), and shuts it down.
Everything lives under a state directory (default ``~/.openrl``):

    <state>/models/tiny-qwen3   the built offline model (built on first start)
    <state>/nats                JetStream file storage (reused by the next start)
    <state>/storage             checkpoints (file:// storage)
    <state>/ports.json          gateway / NATS URLs and every process's Prometheus /metrics URL
                                (openrl/transport/portsfile.py: the workers and the supervisor
                                bind any free port for /metrics and record it there, at each start;
                                the ports of nats-server, the gateway and the --push receivers
                                are held by the stack from before they start: PortHold)
    <state>/logs                one JSON-lines log per process (openrl/observe/logs.py)
    <state>/api_key             the generated ``tml-`` API key the examples read; the gateway
                                accepts it (plus any OPENRL_API_KEYS / OPENRL_API_KEYS_FILE
                                entries) and nothing else (see openrl/edge/auth.py)
    <state>/supervisor.json     each process's state, restarts and idle time (``openrl status``)
    <state>/pids.json           the supervisor's and every child's pid (openrl/transport/pidfile.py:
                                ``openrl stop`` and the next ``openrl serve`` find leftovers there)

Every child dies with the process that started it (``openrl serve``, ``openrl run``, a test):
it is started through :mod:`openrl.transport.tether` (the Linux parent-death signal), so a
``kill -9`` of the supervisor leaves no orphan holding the ports or the GPU. A new stack
refuses to start on a state directory whose previous stack still partly runs, and says how to
stop it (``openrl stop --state-dir DIR``).

``openrl serve`` / ``openrl run`` supervise the processes (:mod:`openrl.transport.supervisor`):
one that dies is restarted with backoff, and with ``--idle-timeout SECONDS`` (default
``OPENRL_IDLE_TIMEOUT``, 300; 0 = always up) the trainer and the sampler are stopped when
their work queues stay empty that long and started again when requests queue up (they
start at zero, unless ``--model`` names models to preload).
"""

from __future__ import annotations

import errno
import json
import os
import secrets
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from openrl.config import Settings
from openrl.contract import topology
from openrl.errors import CLIError
from openrl.model.registry import ModelRegistry, ensure_built
from openrl.observe import startup
from openrl.transport import pidfile, portsfile, tether
from openrl.transport.local_servers import PortHold, start_nats

if TYPE_CHECKING:
    from openrl.transport.supervisor import Supervisor


def api_key(state_dir: Path) -> str:
    """The embedded stack's API key, generated once and kept in ``<state>/api_key``."""
    f = state_dir / "api_key"
    if f.exists():
        return f.read_text().strip()
    key = "tml-" + secrets.token_urlsafe(24)
    f.write_text(key + "\n")
    f.chmod(0o600)
    return key


#: Shares of one GPU for the embedded stack's trainer and vLLM sampler (fractions of its memory).
TRAINER_GPU_MEMORY = 0.45
SAMPLER_GPU_MEMORY = 0.40


@dataclass
class Stack:
    """A running embedded stack (processes and addresses)."""

    state_dir: Path
    host: str = "127.0.0.1"
    port: int | None = 0  # the gateway's; 0 / None: any free port (start() sets the one bound)
    storage: str | None = None
    nats_port: int = 0  # 0: any free port (start() sets the one bound)
    build: bool = True
    procs: list[subprocess.Popen | None] = field(default_factory=list)  # None: a worker not started yet
    push: bool = False  # functions as HTTP receivers fed by a local dispatcher (the Knative Eventing path)
    extra_env: dict[str, str] = field(default_factory=dict)  # e.g. STORAGE_EMULATOR_HOST
    device: str | None = None  # --device: auto | cpu | cuda (None: $OPENRL_DEVICE, else auto)
    trainer_gpu_memory: float | None = None  # --trainer-gpu-memory (None: env, else TRAINER_GPU_MEMORY)
    sampler_gpu_memory: float | None = None  # --sampler-gpu-memory (None: env, else SAMPLER_GPU_MEMORY)
    deterministic: bool | None = None  # --deterministic (None: $OPENRL_DETERMINISTIC, else off)
    preload: list[str] = field(default_factory=list)  # base models the workers load at start (--model names)
    supervise: bool = False  # restart dead processes, scale idle workers to zero (openrl serve / run)
    command_t0: float | None = None  # openrl serve / run: time.monotonic() at the command's start (serve_to_workers)
    # --model's config check running beside the start (openrl/cli/model_check.py): called once the processes are
    # spawned, before the stack reports ready; it raises CLIError (the stack is then stopped)
    model_check: Callable[[], None] | None = None
    idle_timeout: float = 0.0  # --idle-timeout: seconds a worker may idle before it stops (supervise; 0 = never)
    sleep_after: float | None = None  # --sleep-after: seconds before an idle worker sleeps (None: $OPENRL_SLEEP_AFTER)
    supervisor: "Supervisor | None" = None  # set by start() when supervise
    # the ports of the gateway, nats-server and the push receivers, held from before their servers
    # start until stop() (PortHold: a restart binds the same port and nothing takes it meanwhile)
    _holds: dict[str, PortHold] = field(default_factory=dict, init=False, repr=False)

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def nats_url(self) -> str:
        return f"nats://127.0.0.1:{self.nats_port}"

    @property
    def api_key(self) -> str:
        """The stack's API key (``<state>/api_key``, generated on first use)."""
        self.state_dir.mkdir(parents=True, exist_ok=True)
        return api_key(self.state_dir)

    def gateway_env(self, env: dict[str, str]) -> dict[str, str]:
        """The gateway's environment: ``OPENRL_API_KEYS`` = the stack's key plus any entries
        already in ``OPENRL_API_KEYS`` (environment or ``extra_env``; ``OPENRL_API_KEYS_FILE``
        passes through), and the internal token of the ``/events/*`` sinks."""
        keys = [self.api_key] + [k for k in env.get("OPENRL_API_KEYS", "").split(",") if k.strip()]
        out = {**env, "OPENRL_API_KEYS": ",".join(keys)}
        if getattr(self, "_internal_token", None):  # set by start()
            out["OPENRL_INTERNAL_TOKEN"] = self._internal_token
        return out

    def env(self) -> dict[str, str]:
        """Environment for the stack's processes.

        The trainer and the sampler share this machine's GPU (when it has one): unless set,
        the trainer may allocate ``TRAINER_GPU_MEMORY`` of it and vLLM takes
        ``SAMPLER_GPU_MEMORY`` (sized for Qwen3-4B: 8 runs x 1x1024 training and 8 LoRA slots
        with a KV cache for 256 sequences on an H200's 141 GB).
        """
        env = {
            **os.environ,
            "OPENRL_HOME": str(self.state_dir),
            "OPENRL_NATS_URL": self.nats_url,
            "OPENRL_STORAGE": self.storage,
            "TINKER_TELEMETRY": "0",
            # one machine: the trainer's gs:// saves stay in the cache the sampler reads
            "OPENRL_COLOCATED_SAMPLER": "1",
            **self.extra_env,
        }
        if self.device:
            env["OPENRL_DEVICE"] = self.device
        if self.deterministic is not None:
            env["OPENRL_DETERMINISTIC"] = "1" if self.deterministic else "0"
        if self.sleep_after is not None:
            env["OPENRL_SLEEP_AFTER"] = str(self.sleep_after)
        if self.preload:  # the models named with --model: load them (and start vLLM) before the first request
            env.setdefault("OPENRL_PRELOAD", ",".join(self.preload))
        for key, flag, default in (("OPENRL_TRAINER_GPU_MEMORY", self.trainer_gpu_memory, TRAINER_GPU_MEMORY),
                                   ("OPENRL_SAMPLER_GPU_MEMORY", self.sampler_gpu_memory, SAMPLER_GPU_MEMORY)):
            if flag is not None:
                env[key] = str(flag)
            else:
                env.setdefault(key, str(default))
        return env

    def start(self) -> "Stack":
        """Build the model if missing, start nats-server, the workers and the gateway.

        Blocks until the gateway answers ``/api/v1/healthz``.

        The gateway's port (``port``; 0 or None: any free one) and nats-server's are held
        (:class:`PortHold`) before anything starts, and :attr:`port` / :attr:`nats_port` /
        ``<state>/ports.json`` say which they are.

        Raises:
            openrl.errors.CLIError: the state dir's previous stack still partly runs, the port is
                taken, a process exited / the gateway did not answer while starting, or
                :attr:`model_check` failed (what was started is stopped again).
            RuntimeError, TimeoutError: nats-server did not listen.
        """
        self.state_dir.mkdir(parents=True, exist_ok=True)
        left = pidfile.alive(self.state_dir)
        if left:
            raise CLIError(pidfile.describe(left, self.state_dir))
        try:
            gateway = PortHold(self.host, self.port or 0)
        except OSError as exc:
            if exc.errno != errno.EADDRINUSE:
                raise CLIError(f"cannot listen on {self.host}:{self.port}: {exc}") from None
            raise CLIError(f"{self.host}:{self.port} is already in use (another openrl serve, or another "
                           f"program); pick a free port with --port, or stop the other one "
                           f"(`openrl stop --state-dir DIR` for an openrl stack)") from None
        self._holds["gateway"], self.port = gateway, gateway.port
        try:
            self._start()
        except BaseException:  # nothing of a stack that did not start stays behind
            self.stop()
            raise
        return self

    def _hold(self, name: str, port: int = 0) -> int:
        """Hold a port on 127.0.0.1 for process ``name`` until :meth:`stop` (0: any free one); returns it."""
        self._holds[name] = PortHold("127.0.0.1", port)
        return self._holds[name].port

    def _start(self) -> None:
        pidfile.start(self.state_dir)
        self.storage = self.storage or (self.state_dir / "storage").as_uri()
        registry = ModelRegistry.load(Settings().registry_path, models_dir=self.state_dir / "models")
        # Workers that preload the models named with --model do not need the built one: they start while
        # it is built (on an H100 the CLI's torch import and the build came before vLLM's 80 s start:
        # 8 s). Otherwise (or when a preloaded name points at a directory to build) the build comes
        # first, as a worker may load it as soon as it runs.
        built_dirs = {e.path for e in registry if e.build}
        build_later = self.build and bool(self.preload) and not any(
            (e := registry.get(n)) is None or e.path in built_dirs for n in self.preload)
        if self.build and not build_later:
            ensure_built(registry)
        self.nats_port = self._hold("nats", self.nats_port)  # restarts listen on the same port
        env = self.env()
        self._internal_token = secrets.token_urlsafe(24)  # /events/* sinks: gateway and dispatcher only
        logs = self.state_dir / "logs"
        logs.mkdir(exist_ok=True)
        # (name, spawn, critical, consumer): what the supervisor restarts, in start order
        specs: list[tuple[str, Callable[[], subprocess.Popen], bool, tuple[str, str] | None]] = [
            ("nats", lambda: start_nats(self.state_dir, self.nats_port), True, None)]
        routes = []
        known = {"gateway": f"{self.base_url}/metrics"}  # metrics URLs known before anything starts
        for module in ("functions.trainer", "functions.sampler"):
            name = module.split(".")[-1]
            if self.push:  # the dispatcher needs the receiver's URL up front: a held port
                port = self._hold(name)
                cmd = [sys.executable, "-m", "openrl.transport.bindings.http", module, "--host", "127.0.0.1", "--port", str(port)]
                routes += ["--route", f"{name}=http://127.0.0.1:{port}"]
                known[name] = f"http://127.0.0.1:{port}/metrics"
                cons = None  # the dispatcher consumes; the receivers stay up
            else:  # each start binds any free port for /metrics and records it in ports.json
                cmd = [sys.executable, "-m", "openrl.transport.worker", module, "--nats", self.nats_url,
                       "--metrics-port", "auto", "--ports-file", str(self.ports_file)]
                c = topology.consumer(name)
                cons = (c.stream, c.durable)
            specs.append((name, _spawner(cmd, {**env, "OPENRL_METRICS_HOST": "127.0.0.1"}, logs / f"{name}.log"),
                          False, cons))
        if self.push:
            specs.append(("dispatcher", _spawner(
                [sys.executable, "-m", "openrl.transport.bindings.dispatcher", "--nats", self.nats_url,
                 "--gateway", self.base_url, *routes], {**env, "OPENRL_INTERNAL_TOKEN": self._internal_token},
                logs / "dispatcher.log"), False, None))
        specs.append(("gateway", _spawner(
            [sys.executable, "-m", "functions.gateway", "--host", self.host, "--port", str(self.port)],
            self.gateway_env(env), logs / "gateway.log"), True, None))
        # where each process's output starts (the supervisor reads a failed start's cause from there)
        self._log_offsets = {name: _size(self._log_of(name)) for name, *_ in specs}
        # supervised, only nats-server and the gateway must come up here; the supervisor restarts the others
        self._must_live = {i for i, (_, _, critical, _) in enumerate(specs) if critical or not self.supervise}
        # a new file: no URL of a previous stack in this state dir is left in it; with the seconds from
        # the command's start to its first spawn (the --model check, a model build, ports: issue 32's split)
        served = {}
        if self.command_t0 is not None:
            served["serve_to_workers"] = time.monotonic() - self.command_t0
            startup.record("serve_to_workers", served["serve_to_workers"])
        portsfile.update(self.ports_file, fresh=True, gateway=self.base_url, nats=self.nats_url, metrics=known,
                         startup=served)
        for _, spawn, _, cons in specs:  # workers that scale to zero start at zero (unless --model preloads)
            self.procs.append(None if cons and self._starts_at_zero else spawn())
        if build_later:  # before the gateway reports healthy: no request reaches a half-built model
            ensure_built(registry)
        if self.model_check is not None:  # a --model config that fails stops the start here
            self.model_check()
        self._wait_healthy()
        self._wait_reported({i: name for i, (name, _, _, cons) in enumerate(specs)
                             if cons and self.procs[i] is not None})
        if self.supervise:
            self._start_supervisor(specs)

    @property
    def _starts_at_zero(self) -> bool:
        """Workers are first started by their first request (supervised, idle timeout on,
        JetStream pull, nothing to preload)."""
        return self.supervise and self.idle_timeout > 0 and not self.push and not self.preload

    def _log_of(self, name: str) -> Path:
        """The file process ``name``'s output goes to."""
        return self.state_dir / "nats.log" if name == "nats" else self.state_dir / "logs" / f"{name}.log"

    def _start_supervisor(self, specs) -> None:
        from openrl.config import ENV_PREFIX
        from openrl.transport.supervisor import RUNNING, STARTING, ZERO, Managed, Supervisor

        # a worker counts as starting (never idle) until it pulls from its consumer
        managed = [Managed(name, spawn, slot=i, critical=critical, consumer=None if self.push else cons,
                           state=(ZERO if self.procs[i] is None else STARTING) if cons and not self.push else RUNNING,
                           log=self._log_of(name), log_offset=self._log_offsets.get(name, 0))
                   for i, (name, spawn, critical, cons) in enumerate(specs)]
        # the settings the stack's processes get (extra_env over this environment)
        cfg = Settings.of({k[len(ENV_PREFIX):].lower(): v for k, v in self.extra_env.items()
                           if k.startswith(ENV_PREFIX) and v != ""})
        if self.push and self.idle_timeout:
            print("openrl: --idle-timeout is ignored with --push (the dispatcher, not a queue poll, feeds the "
                  "functions); they stay up", file=sys.stderr)
        self.supervisor = Supervisor(managed, self.procs, nats_url=self.nats_url,
                                     state_file=self.state_dir / "supervisor.json",
                                     idle_timeout_s=0.0 if self.push else self.idle_timeout,
                                     info={"gateway": self.base_url, "pid": os.getpid()},
                                     start_failures=cfg.start_failures, failing_retry_s=cfg.failing_retry_s,
                                     ack_wait_s=cfg.ack_wait_s).start(metrics_port=0)  # any free port
        portsfile.update(self.ports_file,
                         metrics={"supervisor": portsfile.metrics_url("127.0.0.1", self.supervisor.metrics_port)})

    @property
    def fatal(self) -> str | None:
        """Why the supervisor gave up (nats-server or the gateway kept dying), else None."""
        return self.supervisor.fatal if self.supervisor is not None else None

    @property
    def ports_file(self) -> Path:
        """``<state>/ports.json``: ``{"gateway": URL, "nats": URL, "metrics": {name: URL}}`` (where
        ``openrl status`` and Prometheus find the processes; :mod:`openrl.transport.portsfile`)."""
        return self.state_dir / portsfile.FILE

    @property
    def metrics_urls(self) -> dict[str, str]:
        """Process name -> its Prometheus /metrics URL, as ``<state>/ports.json`` says now: a JetStream
        worker's is its latest start's (each start binds a new port and records it; a worker
        still at zero has none yet)."""
        return dict(portsfile.read(self.ports_file).get("metrics") or {})

    def _wait_reported(self, workers: dict[int, str], timeout_s: float = 120.0) -> None:
        """Block until each worker of ``workers`` (slot -> name) has recorded its metrics URL in
        ``<state>/ports.json``, or (supervised) exited: the supervisor restarts it.

        Raises:
            openrl.errors.CLIError: a worker that must live exited first, or one did not record
                its URL within ``timeout_s`` seconds.
        """
        deadline = time.monotonic() + timeout_s
        while True:
            urls = self.metrics_urls
            waiting = {}
            for i, name in workers.items():
                exited = self.procs[i].poll() is not None
                if exited and i in self._must_live:
                    raise CLIError(f"the {name} worker exited with {self.procs[i].returncode} while the stack "
                                   f"started; its log is in {self._log_of(name)}")
                if name not in urls and not exited:
                    waiting[i] = name
            if not waiting:
                return
            if time.monotonic() > deadline:
                raise CLIError(f"{', '.join(waiting.values())} did not record a metrics port in {self.ports_file} "
                               f"within {timeout_s:g} s; logs in {self.state_dir / 'logs'}")
            time.sleep(0.1)

    def _wait_healthy(self, timeout_s: float = 120.0) -> None:
        """Wait until this stack's gateway answers: ``/api/v1/healthz`` 200, and
        ``/api/v1/get_server_capabilities`` 200 with the stack's API key. The second check tells
        this gateway from another server on the same port: two stacks started at once on one
        port both get their :class:`PortHold` (two ``SO_REUSEADDR`` sockets that do not listen
        share a port on Linux), the first gateway to listen wins and the other exits with
        ``EADDRINUSE``, and the loser's healthz would otherwise be answered by the winner.

        Raises:
            CLIError: a process that must live exited (for the gateway while another server
                answered on its port: that port is taken, pick another), or no answer within
                ``timeout_s``.
        """
        import httpx

        deadline = time.monotonic() + timeout_s
        stranger = False  # a server answered healthz on our port but refused the stack's key
        while time.monotonic() < deadline:
            for i, p in enumerate(self.procs):
                if p is not None and p.poll() is not None and i in getattr(self, "_must_live", range(len(self.procs))):
                    cmd = list(p.args)
                    cmd = cmd[cmd.index("--") + 1:] if "--" in cmd else cmd  # the tether's command
                    if stranger and "functions.gateway" in cmd:
                        raise CLIError(f"{self.host}:{self.port} is taken by another server (it answers /api/v1/healthz "
                                       f"but refuses this stack's API key; another openrl serve that started at the "
                                       f"same time?) and this stack's gateway exited with {p.returncode}; pick a free "
                                       f"port with --port (0: any free port); its log is in {self.state_dir / 'logs'}")
                    raise CLIError(f"{' '.join(map(str, cmd[:4]))} exited with {p.returncode} while the stack "
                                   f"started; its log is in {self.state_dir / 'logs'}")
            try:
                if httpx.get(f"{self.base_url}/api/v1/healthz", timeout=1).status_code == 200:
                    ours = httpx.get(f"{self.base_url}/api/v1/get_server_capabilities", timeout=2,
                                     headers={"X-API-Key": self.api_key})
                    if ours.status_code == 200:
                        return
                    stranger = True
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        taken = (f"; {self.host}:{self.port} is answered by another server that refuses this stack's API key"
                 if stranger else "")
        raise CLIError(f"the gateway did not answer {self.base_url}/api/v1/healthz within {timeout_s:g} s{taken}; "
                       f"its log is in {self.state_dir / 'logs' / 'gateway.log'}")

    def stop(self) -> None:
        """Stop the supervisor, then SIGTERM every process (gateway and workers first,
        nats-server last) and wait."""
        if self.supervisor is not None:
            self.supervisor.stop()
        for p in reversed(self.procs):
            if p is not None and p.poll() is None:
                p.send_signal(signal.SIGTERM)
                try:
                    p.wait(timeout=40)
                except subprocess.TimeoutExpired:
                    p.kill()
        self.procs.clear()
        for hold in self._holds.values():  # every server is gone: the ports may go
            hold.close()
        self._holds.clear()
        pidfile.clear(self.state_dir)
        self._clear_handoff()

    def _clear_handoff(self) -> None:
        """Free the shared memory of the snapshot handoff (openrl/storage/handoff.py) once every
        snapshot in it is durable; else keep it, for the next trainer on this state dir to write."""
        from openrl.storage.handoff import SnapshotHandoff

        root = SnapshotHandoff.root_for(Settings.of({"home": str(self.state_dir),
                                                     "handoff_dir": self.extra_env.get("OPENRL_HANDOFF_DIR")}))
        if root is None or not root.is_dir():
            return
        handoff = SnapshotHandoff(root, max_bytes=1)
        if not handoff.pending():
            handoff.clear()

    def __enter__(self) -> "Stack":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def _size(path: Path) -> int:
    """Bytes in ``path`` (0 when it does not exist)."""
    try:
        return path.stat().st_size
    except OSError:
        return 0


def _spawner(cmd: list[str], env: dict[str, str], log: Path) -> Callable[[], subprocess.Popen]:
    """A function that starts ``cmd`` with ``env``, appending its output to ``log`` (each call a new
    process). The log is ``<state>/logs/<name>.log``: the child is recorded as ``name`` in
    ``<state>/pids.json`` and dies with this process (:func:`openrl.transport.tether.popen`)."""

    def spawn() -> subprocess.Popen:
        with open(log, "ab") as out:
            return tether.popen(cmd, name=log.stem, state_dir=log.parent.parent, env=env, stdout=out,
                                stderr=subprocess.STDOUT)

    return spawn


def _log_supervisor(state_dir: Path) -> None:
    """``openrl serve`` / ``run``: the supervisor's log lines go to ``<state>/logs/supervisor.log``
    (JSON lines, INFO and up: starts, scale-downs, restarts) and its warnings (a process died,
    the stack gives up) to stderr as well."""
    import logging

    from openrl.observe.logs import JsonFormatter

    (state_dir / "logs").mkdir(parents=True, exist_ok=True)
    lg = logging.getLogger("openrl.supervisor")
    to_file = logging.FileHandler(state_dir / "logs" / "supervisor.log")
    to_file.setFormatter(JsonFormatter("supervisor"))
    to_err = logging.StreamHandler(sys.stderr)
    to_err.setLevel(logging.WARNING)
    to_err.setFormatter(logging.Formatter("openrl: %(message)s"))
    lg.handlers[:] = [to_file, to_err]
    lg.setLevel(logging.INFO)
    lg.propagate = False


#: ``openrl serve`` / ``openrl run``: seconds with no request in flight before the trainer and the
#: sampler sleep (GPU memory freed, the process kept; back in under a second on an H200: 0.63 s to
#: the first forward_backward, 0.41 s to the first sample, docs/benchmarks.md), unless
#: ``--sleep-after`` or ``OPENRL_SLEEP_AFTER`` says otherwise. A worker started outside the
#: embedded stack (a Knative revision) keeps ``Settings.sleep_after`` (0: Knative scales its pods).
SERVE_SLEEP_AFTER = 60.0


def _stack_from_args(args) -> Stack:
    """The supervised stack of ``openrl serve`` / ``openrl run`` from their parsed flags
    (``--idle-timeout`` unset: ``Settings().idle_timeout``; ``--sleep-after`` unset:
    ``OPENRL_SLEEP_AFTER`` if set, else :data:`SERVE_SLEEP_AFTER`)."""
    cfg = Settings()
    state = Path(getattr(args, "state_dir", None) or cfg.home_dir)
    idle = getattr(args, "idle_timeout", None)
    sleep_after = getattr(args, "sleep_after", None)
    if sleep_after is None:
        sleep_after = cfg.sleep_after if "sleep_after" in cfg.model_fields_set else SERVE_SLEEP_AFTER
    return Stack(state_dir=state.expanduser().resolve(), host=getattr(args, "host", "127.0.0.1"),
                 port=int(getattr(args, "port", 8000)), storage=getattr(args, "storage", None),
                 build=not getattr(args, "no_build", False), push=bool(getattr(args, "push", False)),
                 device=getattr(args, "device", None), trainer_gpu_memory=getattr(args, "trainer_gpu_memory", None),
                 sampler_gpu_memory=getattr(args, "sampler_gpu_memory", None),
                 deterministic=getattr(args, "deterministic", None),
                 preload=[name for name, _ in getattr(args, "model", None) or []], supervise=True,
                 command_t0=getattr(args, "t0", None), model_check=getattr(args, "model_check", None),
                 idle_timeout=cfg.idle_timeout if idle is None else float(idle),
                 sleep_after=float(sleep_after))


def main(args) -> int:
    """``openrl serve``: run until Ctrl-C."""
    stack = _stack_from_args(args)
    stop = {"flag": False}

    def _sig(*_):
        stop["flag"] = True
        if stack.supervisor is not None:  # Ctrl-C reached the children too: their exits are no crashes
            stack.supervisor.halt()

    signal.signal(signal.SIGINT, _sig)
    signal.signal(signal.SIGTERM, _sig)
    _log_supervisor(stack.state_dir)
    stack.start()
    key = api_key(stack.state_dir)
    print(json.dumps({"base_url": stack.base_url, "api_key_file": str(stack.state_dir / "api_key")}))
    idle = f"; idle workers stop after {stack.idle_timeout:g} s" if stack.idle_timeout and not stack.push else ""
    sleep_after = stack.sleep_after if stack.sleep_after is not None else Settings().sleep_after
    if sleep_after and not stack.push:
        idle = f"; idle workers sleep after {sleep_after:g} s" + idle.replace(";", ",", 1)
    print(f"openrl is serving on {stack.base_url}  (API key: {key}{idle}; Ctrl-C stops)", flush=True)
    try:
        while not stop["flag"] and not stack.fatal:
            stack.supervisor.fatal_event.wait(0.5)
    finally:
        if stack.fatal:
            print(f"openrl serve: {stack.fatal}; logs in {stack.state_dir / 'logs'}", file=sys.stderr)
        print("stopping...", flush=True)
        stack.stop()
    return 1 if stack.fatal else 0


def run_script(args) -> int:
    """``openrl run SCRIPT [ARGS...]``: start the stack, run the script against it, stop."""
    stack = _stack_from_args(args)
    _log_supervisor(stack.state_dir)
    stack.start()
    try:
        env = {**os.environ, "TINKER_BASE_URL": stack.base_url, "TINKER_API_KEY": api_key(stack.state_dir),
               "TINKER_TELEMETRY": "0", "OPENRL_HOME": str(stack.state_dir)}
        script = subprocess.Popen([sys.executable, args.script, *args.script_args], env=env)
        try:
            while script.poll() is None:
                if stack.fatal:
                    print(f"openrl run: {stack.fatal}; stopping the script", file=sys.stderr)
                    script.terminate()
                    script.wait()
                    return 1
                time.sleep(0.5)
        except KeyboardInterrupt:  # Ctrl-C reached the script and the stack too (same process group)
            if stack.supervisor is not None:
                stack.supervisor.halt()
            script.wait()
            raise
        return script.returncode
    finally:
        stack.stop()
