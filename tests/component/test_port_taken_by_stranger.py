"""A stack whose port another server took while it started fails naming the port, instead of
taking the stranger's ``/api/v1/healthz`` for its own (a README trial, 2026-12-07: two stacks
started at once on port 8000 both got their port hold, the other's gateway listened first, this
one's exited with ``EADDRINUSE``, and the demo then ran against the other stack: a 401 on every
request).

Real processes and sockets: the stranger is a real HTTP server on 127.0.0.1 that answers
``healthz`` and refuses every API key (as another openrl stack does); this stack's gateway is a
real process that exits once the stranger has been asked for the stack's key (standing in for a
gateway that lost the bind). Nothing is mocked inside ``Stack._wait_healthy``.
"""

from __future__ import annotations

import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from openrl.errors import CLIError
from openrl.transport.embedded import Stack


def test_a_stranger_on_the_port_is_not_taken_for_the_gateway(tmp_path):
    asked = threading.Event()

    class Stranger(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - http.server's name
            if self.path == "/api/v1/healthz":
                self.send_response(200)
            else:
                asked.set()
                self.send_response(401)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *_):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Stranger)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    gateway = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read(); sys.exit(1)", "functions.gateway"],
                               stdin=subprocess.PIPE)
    threading.Thread(target=lambda: (asked.wait(30), gateway.stdin.close()), daemon=True).start()
    (tmp_path / "st").mkdir()
    stack = Stack(state_dir=tmp_path / "st", port=server.server_address[1])
    stack.procs = [gateway]
    stack._must_live = {0}
    try:
        with pytest.raises(CLIError) as err:
            stack._wait_healthy(timeout_s=60)
    finally:
        gateway.kill()
        gateway.wait()
        server.shutdown()
    msg = str(err.value)
    assert f"127.0.0.1:{server.server_address[1]} is taken by another server" in msg
    assert "refuses this stack's API key" in msg and "--port" in msg
    assert asked.is_set()


def test_no_answer_at_all_still_times_out_naming_the_log(tmp_path):
    (tmp_path / "st").mkdir()
    import socket

    with socket.socket() as s:  # a bound port nobody listens on: connections are refused
        s.bind(("127.0.0.1", 0))
        stack = Stack(state_dir=tmp_path / "st", port=s.getsockname()[1])
        with pytest.raises(CLIError, match="did not answer .*healthz within 1 s; its log is in"):
            stack._wait_healthy(timeout_s=1)
