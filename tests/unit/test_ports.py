"""``PortHold`` (openrl/transport/embedded.py) and ``<state>/ports.json`` (openrl/transport/portsfile.py).

A port known before its server binds it must not be taken meanwhile (issue 34 item 4: the
sampler's metrics port, a number picked before the server started, was taken between the pick
and the bind): a PortHold keeps it bound, and only a server that shares it (``SO_REUSEADDR``)
binds it. Servers that report their port bind port 0 and record it in ports.json; several
processes record their metrics URLs there: no update is lost.
"""

from __future__ import annotations

import errno
import socket
import struct
import threading

import pytest

from openrl.transport import portsfile
from openrl.transport.local_servers import PortHold


def test_a_held_port_is_taken_by_no_one_but_the_server_it_is_held_for():
    """A PortHold refuses the port to a plain bind and to connections while no server listens;
    a server binding it with SO_REUSEADDR (as uvicorn, http.server and Go's net.Listen do) gets
    it, and again after it stopped (a restart); while one listens, nobody else binds it."""
    with PortHold() as hold:
        port = hold.port
        assert port > 0
        with socket.socket() as s, pytest.raises(OSError) as err:  # no SO_REUSEADDR: refused
            s.bind(("127.0.0.1", port))
        assert err.value.errno == errno.EADDRINUSE
        for _ in range(2):  # the server, then a restart of it on the same port
            with socket.socket() as c:
                assert c.connect_ex(("127.0.0.1", port)) == errno.ECONNREFUSED  # nothing listens
            with socket.create_server(("127.0.0.1", port)) as server:  # sets SO_REUSEADDR
                with socket.create_connection(("127.0.0.1", port), timeout=10):
                    pass
                with socket.socket() as other, pytest.raises(OSError) as err:
                    other.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                    other.bind(("127.0.0.1", port))
                assert err.value.errno == errno.EADDRINUSE
                server.accept()[0].close()


def test_the_kernel_hands_a_held_port_to_no_other_socket():
    """Neither a bind to port 0 nor an outgoing connection's local port is ever a held port
    (200 holds, 400 of each: without the hold, about 3 of each would land on one)."""
    holds = [PortHold() for _ in range(200)]
    held = {h.port for h in holds}
    got: set[int] = set()
    try:
        with socket.create_server(("127.0.0.1", 0), backlog=512) as server:
            target = server.getsockname()
            for _ in range(400):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", 0))
                    got.add(s.getsockname()[1])
                with socket.socket() as c:
                    c.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # RST: no TIME_WAIT
                    c.connect(target)
                    got.add(c.getsockname()[1])
                    server.accept()[0].close()
    finally:
        for h in holds:
            h.close()
    assert not got & held


def test_holding_a_port_a_server_listens_on_fails():
    with socket.create_server(("127.0.0.1", 0)) as server, pytest.raises(OSError) as err:
        PortHold("127.0.0.1", server.getsockname()[1])
    assert err.value.errno == errno.EADDRINUSE


def test_concurrent_updates_of_ports_json_lose_nothing(tmp_path):
    f = tmp_path / "ports.json"
    portsfile.update(f, fresh=True, gateway="http://127.0.0.1:1", metrics={"gateway": "http://127.0.0.1:1/metrics"})

    def record(worker: int) -> None:
        for i in range(25):
            portsfile.update(f, metrics={f"w{worker}-{i}": f"http://127.0.0.1:{20000 + 100 * worker + i}/metrics"})

    threads = [threading.Thread(target=record, args=(w,)) for w in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    doc = portsfile.read(f)
    assert doc["gateway"] == "http://127.0.0.1:1"
    assert len(doc["metrics"]) == 1 + 6 * 25
    # a fresh write forgets what a previous stack recorded
    portsfile.update(f, fresh=True, gateway="http://127.0.0.1:2")
    assert portsfile.read(f) == {"gateway": "http://127.0.0.1:2", "metrics": {}}


def test_metrics_url_names_a_wildcard_bind_as_loopback():
    assert portsfile.metrics_url("0.0.0.0", 9100) == "http://127.0.0.1:9100/metrics"
    assert portsfile.metrics_url("127.0.0.1", 9100) == "http://127.0.0.1:9100/metrics"
    assert portsfile.metrics_url("::1", 9100) == "http://[::1]:9100/metrics"


def test_worker_metrics_port_is_a_number_or_auto():
    import argparse

    from openrl.observe import metrics
    from openrl.transport.worker import _metrics_port

    assert _metrics_port("auto") == "auto" and _metrics_port("9100") == 9100 and _metrics_port("0") == 0
    with pytest.raises(argparse.ArgumentTypeError, match="'auto'"):
        _metrics_port("any")
    with pytest.raises(ValueError, match="'auto'"):
        metrics.serve("any", host="127.0.0.1")
    assert metrics.serve(0, host="127.0.0.1") == 0  # off
