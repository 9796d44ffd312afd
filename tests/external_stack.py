"""The external-stack mode of the SDK-level tests: ``tests/stack`` against an ``openrl serve``
started elsewhere (the GPU conformance run, ``bench/gpu_conformance.py``).

Set ``OPENRL_TEST_STACK_STATE=<state dir of a running openrl serve>``. The ``stack`` fixture
(and ``sdk_stack``, ``service``, ``api_key``, ``tokenizer``) then stand for that stack:
``base_url`` and the NATS URL come from ``<state>/ports.json``, the key from
``<state>/api_key``. Tests that start a stack of their own, or kill or stop its processes,
skip with a reason that starts with ``external stack:``.

``<state>/conformance.json`` (written by ``bench/gpu_conformance.py --serve`` or
``--print-env``, which also give the serve its environment) adds what the keyed tests need:
the three extra API keys of ``tests/fixtures_keys.py`` and the environment the serve was
started with (``OPENRL_API_KEYS``, ``OPENRL_TRACE_FILE``, the seq-gap timeout and body limit
of ``keyed_stack``). Without it the keyed tests skip.

This module imports only the standard library (the runner imports it on the GPU machine).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

ENV = "OPENRL_TEST_STACK_STATE"
CONFORMANCE_FILE = "conformance.json"
REASON = "external stack: "


def external_state() -> Path | None:
    """The state dir named by ``$OPENRL_TEST_STACK_STATE`` (None: the tests start their own stacks).

    Raises:
        FileNotFoundError: the variable names a directory without ``ports.json`` (no serve ran there).
    """
    raw = os.environ.get(ENV, "").strip()
    if not raw:
        return None
    state = Path(raw).expanduser().resolve()
    if not (state / "ports.json").is_file():
        raise FileNotFoundError(f"{ENV}={raw}: no ports.json there (is `openrl serve --state-dir {raw}` running?)")
    return state


def skip_reason(why: str) -> str:
    """The skip reason of a test that cannot run against an external stack (``external stack: <why>``)."""
    return REASON + why


@dataclass
class ExternalProc:
    """One process of the external stack as ``<state>/supervisor.json`` listed it when the
    fixture was made; ``poll()`` answers like ``subprocess.Popen.poll`` for the tests' "no
    worker died" checks: None while the supervisor has not restarted it since."""

    name: str
    pid: int | None
    restarts: int
    state_file: Path
    args: list[str] = field(default_factory=list)

    @property
    def returncode(self) -> int | None:
        return self.poll()

    def poll(self) -> int | None:
        """None while the process has not died since the snapshot; else its last exit code (or -1)."""
        try:
            doc = json.loads(self.state_file.read_text())
        except (OSError, ValueError):
            return None
        row = next((r for r in doc.get("processes", []) if r.get("name") == self.name), None)
        if row is None or row.get("restarts", 0) <= self.restarts:
            return None
        return row.get("last_exit") if isinstance(row.get("last_exit"), int) else -1


_ARGS = {"nats": "nats-server", "trainer": "functions.trainer", "sampler": "functions.sampler",
         "gateway": "functions.gateway", "dispatcher": "openrl.transport.bindings.dispatcher"}


@dataclass
class ExternalStack:
    """A running ``openrl serve`` seen from the tests: the attributes of
    :class:`openrl.transport.embedded.Stack` that the tests read (``state_dir``, ``base_url``,
    ``api_key``, ``nats_url``, ``storage``, ``metrics_urls``, ``procs``), plus ``serve_env``
    (what conformance.json says the serve was started with) and ``keys``. ``start()`` /
    ``stop()`` do nothing: the stack belongs to whoever started it."""

    state_dir: Path
    base_url: str
    api_key: str
    nats_url: str
    storage: str
    procs: list[ExternalProc]
    serve_env: dict[str, str]
    keys: dict[str, str]
    keyring: object | None = None  # fixtures_keys.Keys, set by the keyed_stack fixture
    external: bool = True
    supervisor: None = None
    fatal: None = None

    @classmethod
    def from_state(cls, state: Path) -> "ExternalStack":
        """Read ``ports.json``, ``api_key``, ``supervisor.json`` and ``conformance.json`` of ``state``.

        Raises:
            FileNotFoundError: ``ports.json`` or ``api_key`` is missing.
        """
        ports = json.loads((state / "ports.json").read_text())
        conf = read_conformance(state)
        sup = state / "supervisor.json"
        procs = []
        if sup.is_file():
            for row in json.loads(sup.read_text()).get("processes", []):
                procs.append(ExternalProc(row["name"], row.get("pid"), int(row.get("restarts") or 0), sup,
                                          [_ARGS.get(row["name"], row["name"])]))
        env = conf.get("env", {})
        return cls(state_dir=state, base_url=ports["gateway"], api_key=(state / "api_key").read_text().strip(),
                   nats_url=ports.get("nats", ""), storage=env.get("OPENRL_STORAGE") or (state / "storage").as_uri(),
                   procs=procs, serve_env=env,
                   keys=conf.get("keys", {}))

    @property
    def metrics_urls(self) -> dict[str, str]:
        """Process name -> /metrics URL, as ``ports.json`` says now (a restarted worker records
        its new port there)."""
        try:
            return dict(json.loads((self.state_dir / "ports.json").read_text()).get("metrics") or {})
        except (OSError, ValueError):
            return {}

    @property
    def _internal_token(self) -> str:
        """The ``/events/*`` token is private to the serve process: a test that needs it skips."""
        import pytest

        pytest.skip(skip_reason("the /events/* internal token is private to the serve process"))

    def start(self) -> "ExternalStack":
        return self

    def stop(self) -> None:
        return None


def read_conformance(state: Path) -> dict:
    """``<state>/conformance.json`` (``{"keys": {...}, "env": {...}}``), or {} when absent."""
    f = state / CONFORMANCE_FILE
    return json.loads(f.read_text()) if f.is_file() else {}


def write_conformance(state: Path, keys: dict[str, str], env: dict[str, str]) -> Path:
    """Write ``<state>/conformance.json`` (mode 0600: it holds API keys); returns its path."""
    state.mkdir(parents=True, exist_ok=True)
    f = state / CONFORMANCE_FILE
    f.write_text(json.dumps({"keys": keys, "env": env}, indent=2) + "\n")
    f.chmod(0o600)
    return f


def mark_conformance_used(state: Path, by: str) -> str | None:
    """Mark ``<state>/conformance.json``'s keys as used by ``by``; returns who used them before
    (None: nobody, the caller may use them)."""
    f = state / CONFORMANCE_FILE
    doc = read_conformance(state)
    if doc.get("used_by"):
        return str(doc["used_by"])
    doc["used_by"] = by
    f.write_text(json.dumps(doc, indent=2) + "\n")
    return None


def requires_serve_env(stack, name: str) -> None:
    """Skip (external stack only) unless the serve was started with environment variable ``name``
    (as conformance.json records it)."""
    if getattr(stack, "external", False) and name not in stack.serve_env:
        import pytest

        pytest.skip(skip_reason(f"the serve was not started with {name} (bench/gpu_conformance.py --serve sets it)"))


def skip_if_external(stack, why: str) -> None:
    """Skip with ``external stack: <why>`` when ``stack`` is an external one."""
    if getattr(stack, "external", False):
        import pytest

        pytest.skip(skip_reason(why))
