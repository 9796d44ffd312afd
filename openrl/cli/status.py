"""``openrl status``, ``openrl runs list``, ``openrl checkpoints list RUN``: what the service is doing.

They talk to a gateway's REST routes only (never to NATS or storage), so they work
against any deployment:

| command | routes |
|---|---|
| ``openrl status`` | ``GET /api/v1/status`` (workers with their device / dtype / backend, queues), ``GET /api/v1/training_runs``, ``GET /api/v1/sessions`` |
| ``openrl runs list`` | ``GET /api/v1/training_runs`` |
| ``openrl checkpoints list RUN`` | ``GET /api/v1/training_runs/{RUN}/checkpoints`` |

Flags: ``--base-url`` (default ``$TINKER_BASE_URL``, else the gateway in
``<state>/ports.json`` of a running ``openrl serve``, else ``http://127.0.0.1:8000``),
``--api-key`` (default ``$TINKER_API_KEY``, else ``<state>/api_key``), ``--json`` (the raw
answers instead of tables). Runs and checkpoints are those of the API key.

``openrl status`` of the gateway of ``openrl serve`` / ``openrl run`` (the one its
``<state>/supervisor.json`` names) also shows that stack's processes, from that file
(:mod:`openrl.transport.supervisor`): state (running / starting / stopping / scaled to zero /
restarting / failing), pid, idle seconds, restarts, the last exit and, for a worker that
cannot start, the start error its requests fail with. Base models that a worker failed to load
are listed under the workers table.

``openrl status --cluster`` asks the Kubernetes API and NATS instead of a gateway
(:mod:`openrl.cli.cluster`).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import httpx

from openrl.cli import tables

TIMEOUT_S = 15.0


class GatewayError(Exception):
    """The gateway could not be reached or answered an error (message is for the user)."""


def _base_url(args: argparse.Namespace) -> str:
    if args.base_url:
        return args.base_url.rstrip("/")
    if os.environ.get("TINKER_BASE_URL"):
        return os.environ["TINKER_BASE_URL"].rstrip("/")
    ports = Path(args.state_dir) / "ports.json"
    if ports.exists():
        try:
            return json.loads(ports.read_text())["gateway"].rstrip("/")
        except (ValueError, KeyError):
            pass
    return "http://127.0.0.1:8000"


def _api_key(args: argparse.Namespace) -> str | None:
    if args.api_key:
        return args.api_key
    if os.environ.get("TINKER_API_KEY"):
        return os.environ["TINKER_API_KEY"]
    f = Path(args.state_dir) / "api_key"
    return f.read_text().strip() if f.exists() else None


class Client:
    """A small REST client of the gateway (``X-API-Key`` auth).

    Raises (from :meth:`get`):
        GatewayError: connection refused / timeout, or an HTTP error status (the gateway's
            ``detail`` is in the message).
    """

    def __init__(self, base_url: str, api_key: str | None, hint: str = ""):
        self.base_url, self.hint = base_url, hint
        self.http = httpx.Client(base_url=base_url, timeout=TIMEOUT_S,
                                 headers={"X-API-Key": api_key} if api_key else {})

    def get(self, path: str, **params) -> dict:
        try:
            r = self.http.get(path, params=params or None)
        except httpx.HTTPError as exc:
            raise GatewayError(f"cannot reach the gateway at {self.base_url}: {exc}{self.hint}") from exc
        if r.status_code >= 400:
            try:
                detail = r.json().get("detail")
            except ValueError:
                detail = r.text[:200]
            hint = " (pass --api-key or set TINKER_API_KEY)" if r.status_code == 401 else ""
            raise GatewayError(f"GET {path}: HTTP {r.status_code}: {detail}{hint}")
        return r.json()


def _unreachable_hint(args) -> str:
    """What to do when the gateway does not answer: start the stack of the state dir, or name the gateway."""
    if args.base_url or os.environ.get("TINKER_BASE_URL"):
        return "; check the URL (--base-url / TINKER_BASE_URL) and that the gateway runs"
    sd = Path(args.state_dir)
    if not sd.is_dir():
        return (f"; state dir {sd} does not exist: start a stack with `openrl serve --state-dir {sd}`, pass the "
                "--state-dir of a running one, or --base-url")
    if not (sd / "ports.json").exists():
        return f"; no openrl serve has run with state dir {sd}: start one with `openrl serve`, or pass --base-url"
    return f"; is `openrl serve --state-dir {sd}` still running? Start it again, or pass --base-url"


def _client(args) -> Client:
    return Client(_base_url(args), _api_key(args), _unreachable_hint(args))


# the rich console and tables, shared with openrl.cli.cluster (their own module: no import circle)
_console, _table, _escape = tables.console, tables.table, tables.escape


def _size(n) -> str | None:
    if n is None:
        return None
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024


def _when(iso: str | None) -> str | None:
    """``2026-11-30T08:14:41.353Z`` → ``2026-11-30 08:14:41`` (UTC)."""
    return iso.replace("T", " ").rstrip("Z").split(".")[0] if iso else iso


def _run_rows(runs: list[dict]) -> list[list]:
    return [[r["training_run_id"], r.get("base_model"), r.get("lora_rank"), _when(r.get("last_request_time")),
             (r.get("last_checkpoint") or {}).get("checkpoint_id"),
             (r.get("last_sampler_checkpoint") or {}).get("checkpoint_id")] for r in runs]


RUN_COLUMNS = ["run", "base model", "rank", "last request", "last checkpoint", "last sampler ckpt"]


# -- handlers ---------------------------------------------------------------------------------


#: ``supervisor.json`` not rewritten for this long (seconds): its stack is not running.
SUPERVISOR_STALE_S = 10.0


def supervisor_state(state_dir: Path, base_url: str) -> dict | None:
    """The embedded stack's ``<state>/supervisor.json`` when it describes the gateway at
    ``base_url``, else None; ``stale`` is added (True: not rewritten for
    :data:`SUPERVISOR_STALE_S` seconds while not marked stopped: the stack died)."""
    import time

    f = Path(state_dir) / "supervisor.json"
    try:
        doc = json.loads(f.read_text())
    except (OSError, ValueError):
        return None
    if str(doc.get("gateway", "")).rstrip("/") != base_url.rstrip("/"):
        return None
    doc["stale"] = not doc.get("stopped") and time.time() - float(doc.get("updated_unix") or 0) > SUPERVISOR_STALE_S
    return doc


def _sleep_cell(sleep: dict | None) -> str | None:
    """The worker's idle-sleep state for the table: ``asleep (3 sleeps, last wake 1.2 s)``,
    ``awake``, ...; None when it does not sleep; the last error appended."""
    if not sleep:
        return None
    cell = str(sleep.get("state"))
    extra = []
    if sleep.get("sleeps"):
        extra.append(f"{sleep['sleeps']} sleeps")
    if sleep.get("last_wake_s") is not None:
        extra.append(f"last wake {sleep['last_wake_s']:g} s")
    if extra:
        cell += f" ({', '.join(extra)})"
    if sleep.get("error"):
        cell += f"; {sleep['error']}"
    return cell


def cmd_status(args: argparse.Namespace) -> int:
    """``openrl status``: workers and queues (``/api/v1/status``), the key's runs and sessions;
    with ``--cluster``, the Knative Services and NATS streams instead (:mod:`openrl.cli.cluster`)."""
    if getattr(args, "cluster", False):
        from openrl.cli.cluster import cmd_cluster_status

        return cmd_cluster_status(args)
    c = _client(args)
    status = c.get("/api/v1/status")
    runs = c.get("/api/v1/training_runs", limit=args.limit, offset=0)
    sessions = c.get("/api/v1/sessions", limit=10_000, offset=0)
    try:  # per-key usage (GET /api/v1/usage); an older gateway has no such route
        usage = c.get("/api/v1/usage")
    except GatewayError:
        usage = None
    sup = supervisor_state(args.state_dir, c.base_url)
    if args.json:
        extra = {"supervisor": sup} if sup is not None else {}
        if usage is not None:
            extra["usage"] = usage
        print(json.dumps({"base_url": c.base_url, **status, "training_runs": runs, "sessions": sessions, **extra},
                         indent=2))
        return 0
    con = _console()
    gw = status.get("gateway", {})
    total_runs = (runs.get("cursor") or {}).get("total_count", len(runs.get("training_runs", [])))
    con.print(f"[bold]openrl[/bold] at {c.base_url}: gateway up, {gw.get('futures_in_flight', 0)} futures in "
              f"flight on this replica, {total_runs} training runs and {len(sessions.get('sessions', []))} "
              f"sessions for this key ({gw.get('time')})")
    con.print(_table("Workers (JetStream consumers)",
                     ["function", "shard", "state", "sleep", "device", "dtype", "backend", "queued", "running",
                      "pulls", "redelivered", "idle s"],
                     [[w["function"], w.get("shard"), w["state"], _sleep_cell(w.get("sleep")), w.get("device"),
                       w.get("dtype"), w.get("backend"), w["num_pending"], w["num_ack_pending"], w["num_waiting"],
                       w["num_redelivered"], w.get("idle_s")]
                      for w in status.get("workers", [])]))
    for w in status.get("workers", []):
        if w.get("models_failed"):
            con.print(f"[bold]{w['function']}[/bold]: base models that failed to load (their requests fail): "
                      f"{_escape(w['models_failed'])}")
        for k, v in sorted((w.get("details") or {}).items()):  # fused kernels, vLLM's lm_head LoRA, routed jobs
            con.print(f"[bold]{w['function']}[/bold] {k}: {_escape(str(v))}")
    if sup is not None:
        idle = sup.get("idle_timeout_s")
        note = (f"idle workers stop after {idle:g} s" if idle else "workers always up") + (
            "; STALE: the stack is not running" if sup.get("stale") else "") + (
            f"; {sup['fatal']}" if sup.get("fatal") else "")
        con.print(_table(f"Processes (openrl serve supervisor: {note})",
                         ["process", "state", "pid", "idle s", "restarts", "last exit", "error"],
                         [[p["name"], p["state"], p.get("pid"), p.get("idle_s"), p.get("restarts"), p.get("last_exit"),
                           p.get("error")] for p in sup.get("processes", [])]))
    con.print(_table("Queues", ["stream", "messages", "size"],
                     [[q["stream"], q["messages"], _size(q.get("bytes"))] for q in status.get("queues", [])]))
    con.print(_table(f"Training runs (latest {args.limit})", RUN_COLUMNS, _run_rows(runs.get("training_runs", [])),
                     fold=("run",)))
    if usage is not None:
        con.print(_table("Usage of this key (tokens; accelerator seconds; docs/internals.md: Usage and cost)",
                         ["key id", "trained", "prefilled", "sampled", "trainer s", "sampler s", "stored"],
                         [[u["owner"], u["tokens_trained"], u["tokens_prefilled"], u["tokens_sampled"],
                           round(u["gpu_seconds"].get("trainer", 0.0), 1), round(u["gpu_seconds"].get("sampler", 0.0), 1),
                           _size(u.get("stored_bytes"))] for u in usage.get("owners", [])]))
    return 0


def cmd_runs_list(args: argparse.Namespace) -> int:
    """``openrl runs list``: the key's training runs, newest first."""
    out = _client(args).get("/api/v1/training_runs", limit=args.limit, offset=args.offset)
    if args.json:
        print(json.dumps(out, indent=2))
        return 0
    runs = out.get("training_runs", [])
    total = (out.get("cursor") or {}).get("total_count", len(runs))
    _console().print(_table(f"Training runs ({len(runs)} of {total})", RUN_COLUMNS, _run_rows(runs), fold=("run",)))
    return 0


def cmd_checkpoints_list(args: argparse.Namespace) -> int:
    """``openrl checkpoints list RUN``: a run's checkpoints, newest first."""
    from urllib.parse import quote

    out = _client(args).get(f"/api/v1/training_runs/{quote(args.run, safe=':')}/checkpoints")
    if args.json:
        print(json.dumps(out, indent=2))
        return 0
    cks = out.get("checkpoints", [])
    rows = [[k["checkpoint_id"], k.get("checkpoint_type"), _when(k.get("time")), _size(k.get("size_bytes")),
             "yes" if k.get("public") else "no", _when(k.get("expires_at"))] for k in cks]
    con = _console()
    con.print(_table(f"Checkpoints of {args.run} ({len(cks)})",
                     ["checkpoint", "type", "time", "size", "public", "expires"], rows, fold=("checkpoint",)))
    con.print(f"tinker path: tinker://{args.run}/<checkpoint>")
    return 0


def _guard(fn):
    def run(args):
        try:
            return fn(args)
        except GatewayError as exc:
            print(f"openrl {args.command}: error: {exc}", file=sys.stderr)
            return 1

    return run


# -- parsers ----------------------------------------------------------------------------------


def configure(sub, common: argparse.ArgumentParser) -> None:
    """Add ``status``, ``runs`` and ``checkpoints`` to the ``openrl`` parser (see :func:`openrl.cli.command`)."""
    conn = argparse.ArgumentParser(add_help=False)
    conn.add_argument("--base-url", default=None,
                      help="gateway URL (default $TINKER_BASE_URL, <state>/ports.json, http://127.0.0.1:8000)")
    conn.add_argument("--api-key", default=None, help="API key (default $TINKER_API_KEY or <state>/api_key)")
    conn.add_argument("--json", action="store_true", help="print the gateway's JSON instead of tables")

    p = sub.add_parser("status", parents=[common, conn], help="workers, queues, runs and sessions of a gateway")
    p.add_argument("--limit", type=int, default=5, help="training runs shown (default 5)")
    from openrl.cli.cluster import add_flags

    add_flags(p)
    p.set_defaults(func=_guard(cmd_status))

    r = sub.add_parser("runs", parents=[common], help="training runs of your API key")
    rsub = r.add_subparsers(dest="runs_command", metavar="{list}", required=True)
    rl = rsub.add_parser("list", parents=[common, conn], help="list training runs, newest first")
    rl.add_argument("--limit", type=int, default=20)
    rl.add_argument("--offset", type=int, default=0)
    rl.set_defaults(func=_guard(cmd_runs_list))

    k = sub.add_parser("checkpoints", parents=[common], help="checkpoints of a training run")
    ksub = k.add_subparsers(dest="checkpoints_command", metavar="{list}", required=True)
    kl = ksub.add_parser("list", parents=[common, conn], help="list a run's checkpoints, newest first")
    kl.add_argument("run", help="training run id (see openrl runs list)")
    kl.set_defaults(func=_guard(cmd_checkpoints_list))
