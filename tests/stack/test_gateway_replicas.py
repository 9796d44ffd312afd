"""Two gateway replicas (issue 17 item 3): two ``python -m functions.gateway`` processes on
the same nats-server, storage and API keys (the embedded stack's gateway plus a second one
started with the same environment, ``Stack.gateway_env``), behind a round-robin proxy
(``tests/proxy_rr.py``): consecutive requests alternate between the replicas, so a future
is created on one and retrieved from the other, a session is created on one and heartbeats
on the other.

- the unmodified ``tinker`` SDK pointed at the proxy trains (forward_backward + optim_step),
  saves state and sampler weights, samples them, lists checkpoints: every answer equals a
  run through a single gateway (logprobs and weights within 1e-6), and both replicas
  answered ``retrieve_future`` calls;
- a future submitted on replica A (raw HTTP) is answered by replica B;
- replica A is SIGKILLed mid-run: the proxy skips it (connection refused) and the run
  continues through B to the same weights as the uninterrupted run.

Nothing is mocked (real processes, NATS, storage, SDK); the proxy is a test helper standing
in for a Kubernetes Service / Knative's activator.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import types as pytypes

import httpx
import numpy as np
import pytest

from conftest import BASE_MODEL, _make_stack
from openrl.transport.local_servers import PortHold
from proxy_rr import RoundRobinProxy
from test_faults import LOST_S, _lps, _new_run, _run_id, _service, _step, _submit_step, _wait_future, _weights
from test_trainer_resume import _assert_same

tinker = pytest.importorskip("tinker")
from tinker import types  # noqa: E402

from tolerances import TOL, check_close  # noqa: E402


@pytest.fixture(scope="module")
def replicas(tmp_path_factory, models_dir):
    """The stack (gateway A), gateway B on another port, the proxy over both."""
    stack = _make_stack(tmp_path_factory, models_dir).start()
    hold_b = PortHold()  # B's port, held until B is gone (uvicorn binds a held port)
    port_b = hold_b.port
    log = open(stack.state_dir / "logs" / "gateway-b.log", "ab")
    gw_b = subprocess.Popen([sys.executable, "-m", "functions.gateway", "--host", "127.0.0.1", "--port", str(port_b)],
                            env=stack.gateway_env(stack.env()), stdout=log, stderr=subprocess.STDOUT)
    url_b = f"http://127.0.0.1:{port_b}"
    import time

    deadline = time.monotonic() + 120
    while True:
        try:
            if httpx.get(url_b + "/api/v1/healthz", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        assert gw_b.poll() is None and time.monotonic() < deadline, "gateway B did not come up"
        time.sleep(0.2)
    proxy = RoundRobinProxy([stack.base_url, url_b]).start()
    # what the test_faults helpers need: the proxy's URL, the key, the storage under state_dir
    front = pytypes.SimpleNamespace(base_url=proxy.url, api_key=stack.api_key, state_dir=stack.state_dir)
    yield pytypes.SimpleNamespace(stack=stack, gw_b=gw_b, url_b=url_b, proxy=proxy, front=front)
    proxy.stop()
    gw_b.terminate()
    gw_b.wait(timeout=30)
    hold_b.close()
    stack.stop()


@pytest.fixture(scope="module")
def reference(replicas):
    """An uninterrupted 4-step run through gateway A alone."""
    tc = _new_run(_service(replicas.stack))
    lps = [_step(tc, i) for i in range(4)]
    return lps, _weights(replicas.stack, tc, "ref")


def test_sdk_through_two_replicas_behaves_as_with_one(replicas, reference):
    proxy, front = replicas.proxy, replicas.front
    n0 = len(proxy.hits)
    svc = _service(front)
    tc = _new_run(svc)
    lps = [_step(tc, i) for i in range(2)]
    state = tc.save_state("mid").result(timeout=LOST_S)
    snap = tc.save_weights_for_sampler("mid-w").result(timeout=LOST_S)
    sc = svc.create_sampling_client(model_path=snap.path).result(timeout=LOST_S)
    prompt, params = types.ModelInput.from_ints([5, 6, 7]), types.SamplingParams(max_tokens=4, seed=3)
    got = [sc.sample(prompt, 1, params).result(timeout=LOST_S).sequences[0].tokens for _ in range(3)]
    assert got[0] == got[1] == got[2] and 1 <= len(got[0]) <= 4  # whichever replica took it
    lps += [_step(tc, i) for i in (2, 3)]
    _assert_same(lps, reference[0], _weights(front, tc, "end"), reference[1])

    rest = tinker.RestClient(base_url=front.base_url, api_key=front.api_key)
    names = {c.checkpoint_id for c in rest.list_checkpoints(_run_id(tc)).result(timeout=LOST_S).checkpoints}
    assert {"weights/mid", "sampler_weights/mid-w", "sampler_weights/end"} <= names, names
    # a second training client from the saved state, created through the other replicas
    tc2 = svc.create_training_client_from_state_with_optimizer(state.path).result(timeout=LOST_S)
    check_close("restore", _step(tc2, 2), reference[0][2], TOL.restore, what="from a saved state, one more step")

    hits = proxy.hits[n0:]
    by = {i: {p for j, _, p in hits if j == i} for i in (0, 1)}
    for i in (0, 1):  # both replicas answered futures and took submits
        assert "/api/v1/retrieve_future" in by[i], (i, by[i])
        assert by[i] & {"/api/v1/forward_backward", "/api/v1/optim_step"}, (i, by[i])
    assert proxy.skips == 0


def test_future_created_on_one_replica_is_answered_by_the_other(replicas):
    tc = _new_run(_service(replicas.front))
    from openrl.edge import proto

    body = proto.encode_forward_backward_request(_run_id(tc), 1, [proto.FwdBwdDatum(
        [1, 2, 3], {"target_tokens": np.arange(2, 5), "weights": np.ones(3, np.float32)})], "cross_entropy")
    hdr = {"X-API-Key": replicas.stack.api_key}
    with httpx.Client(base_url=replicas.stack.base_url + "/api/v1", headers=hdr, timeout=60) as a, \
            httpx.Client(base_url=replicas.url_b + "/api/v1", headers=hdr, timeout=60) as b:
        r = a.post("/forward_backward", content=body, headers={"Content-Type": "application/x-protobuf"})
        assert r.status_code == 200, r.text
        out = _wait_future(b, r.json()["request_id"])
        assert out.status_code == 200, out.text
        assert "error" not in out.text[:200], out.text[:500]


def test_one_replica_killed_mid_run_the_run_continues(replicas, reference):
    """Gateway A is SIGKILLed after two steps with the next step's futures pending; the
    proxy skips A from then on and the run ends through B with the reference weights."""
    proxy, front = replicas.proxy, replicas.front
    svc = _service(front)
    tc = _new_run(svc)
    lps = [_step(tc, i) for i in range(2)]
    fb, opt = _submit_step(tc, 2)
    gw_a = next(p for p in replicas.stack.procs if p.poll() is None and "functions.gateway" in p.args)
    gw_a.send_signal(signal.SIGKILL)
    gw_a.wait(timeout=30)
    skips = proxy.skips
    opt.result(timeout=LOST_S)
    lps.append(_lps(fb))
    lps.append(_step(tc, 3))
    _assert_same(lps, reference[0], _weights(front, tc, "after-kill"), reference[1])
    assert proxy.skips > skips  # requests meant for A went to B
    assert replicas.gw_b.poll() is None
