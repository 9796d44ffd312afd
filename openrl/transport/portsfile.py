"""``<state>/ports.json``: where the embedded stack's processes listen.

::

    {"gateway": "http://127.0.0.1:8000", "nats": "nats://127.0.0.1:21234",
     "metrics": {"gateway": "http://127.0.0.1:8000/metrics", "trainer": "http://127.0.0.1:40211/metrics", ...}}

Several processes write it: the stack (:class:`openrl.transport.embedded.Stack`) writes the
gateway and NATS URLs and the metrics URLs it knows (the gateway's, the supervisor's, the
push receivers'); a JetStream worker started with ``--metrics-port auto --ports-file FILE``
binds any free port and records its own metrics URL (:mod:`openrl.transport.worker`), at
every start, so after a restart the file names the new process's port. Each write holds an
exclusive lock (``ports.json.lock`` next to it) for its read-modify-write and replaces the
file atomically, so readers (``openrl status``, the tests, Prometheus file discovery) never
see half a file and need no lock.
"""

from __future__ import annotations

import fcntl
import json
import os
from pathlib import Path

FILE = "ports.json"


def read(path: Path) -> dict:
    """The document in ``path`` ({} when it is missing or not a JSON object)."""
    try:
        doc = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return {}
    return doc if isinstance(doc, dict) else {}


def update(path: Path, *, fresh: bool = False, metrics: dict[str, str] | None = None, **fields: str) -> dict:
    """Merge ``fields`` (top-level keys, e.g. ``gateway``) and ``metrics`` (name -> /metrics URL,
    merged into the ``metrics`` object) into ``path``, under its lock; ``fresh``: start from
    an empty document instead of what the file holds. Returns the document written.

    Raises:
        OSError: the file or its lock cannot be written (e.g. the directory is missing).
    """
    path = Path(path)
    with open(path.with_name(path.name + ".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        doc = {} if fresh else read(path)
        doc.update(fields)
        doc["metrics"] = {**(doc.get("metrics") or {}), **(metrics or {})}
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(doc, indent=2) + "\n")
        tmp.replace(path)
    return doc


def metrics_url(host: str, port: int) -> str:
    """The /metrics URL of a server bound to ``host:port`` (a wildcard address as 127.0.0.1)."""
    host = "127.0.0.1" if host in ("", "0.0.0.0", "::") else host
    return f"http://[{host}]:{port}/metrics" if ":" in host else f"http://{host}:{port}/metrics"
