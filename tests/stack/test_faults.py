"""Faults (invariants 2, 3, 7): processes of a real embedded stack die mid-request.

Each group builds its own stack (its processes get killed). A request is caught exactly
in the middle of its handling with the test-only hold points of ``openrl/testhooks.py``
(``OPENRL_TEST_HOLD_FILE``): the trainer holds a forward_backward pass after it ran on the
device (gradients in memory, cursor not moved, message not acked); the JetStream binding
holds a sample before handling it. Work consumers use a 3 s ack wait (``OPENRL_ACK_WAIT_S``)
so redeliveries come quickly. Every restarted process gets the command line and
environment the stack started it with.

- trainer SIGKILLed mid forward_backward: the unanswered requests are redelivered and
  applied once on the restored state (logprobs and weights equal an uninterrupted run);
  a run whose answered work was not flushed fails its next requests with category "server".
- a seq_id gap fails after OPENRL_SEQ_GAP_TIMEOUT_S with category "user"; the run goes on.
- gateway SIGKILLed while futures are pending (one resolves while no gateway runs): the SDK
  re-polls and gets every answer; a request sent while it is down is retried by the SDK.
- nats-server SIGKILLed and restarted on its file storage: in-flight and queued requests,
  pending futures and a request sent during the outage are all answered; workers, the
  gateway and its futures-bucket watcher reconnect.
- sampler SIGKILLed mid sample: redelivered to the restarted sampler; same tokens as an
  uninterrupted sample with the same seed.

Nothing is mocked; the SDK is the unmodified ``tinker``.
"""

from __future__ import annotations

import asyncio
import re
import signal
import subprocess
import time
from pathlib import Path

import httpx
import numpy as np
import pytest

from conftest import BASE_MODEL, _make_stack
from test_trainer_resume import _assert_same  # logprobs and weights equal at 1e-6, and it trained
from openrl.edge import proto
from openrl.transport.local_servers import wait_port
from openrl.storage import RUNSTATE_DIR, TinkerPath

tinker = pytest.importorskip("tinker")
from tinker import types  # noqa: E402

ACK_WAIT_S = 3
NATS_DOWN_S = 12  # how long nats-server stays down
GAP_S = 8  # OPENRL_SEQ_GAP_TIMEOUT_S of the trainer-fault stack
LOST_S = 300  # a future not answered after this many seconds is lost (a hang guard, not a speed check)
LR = 1e-2
SEED = 11
RANK = 4
PB = {"Content-Type": "application/x-protobuf"}


# ----- the stack and its processes ----------------------------------------------------


def _fault_stack(tmp_path_factory, models_dir, **env):
    stack = _make_stack(tmp_path_factory, models_dir, extra_env={"OPENRL_ACK_WAIT_S": str(ACK_WAIT_S), **env})
    stack.extra_env["OPENRL_TEST_HOLD_FILE"] = str(stack.state_dir / "hold")
    return stack.start()


def _proc(stack, name: str) -> subprocess.Popen:
    """The live process of ``name``: nats-server, functions.trainer, functions.sampler, functions.gateway."""
    for p in stack.procs:
        if p.poll() is None and any(name in str(a) for a in p.args):
            return p
    raise LookupError(f"no live {name} process: {[(p.args[:3], p.returncode) for p in stack.procs]}")


def _kill(stack, name: str, sig: int = signal.SIGKILL) -> subprocess.Popen:
    p = _proc(stack, name)
    p.send_signal(sig)
    p.wait(timeout=90)
    return p


def _start_again(stack, old: subprocess.Popen, log: str, env: dict) -> subprocess.Popen:
    """Start ``old``'s command line again (same arguments, same environment) in its place."""
    out = open(stack.state_dir / log, "ab")
    new = subprocess.Popen(old.args, env=env, stdout=out, stderr=subprocess.STDOUT)
    stack.procs[stack.procs.index(old)] = new
    return new


def _restart_worker(stack, old: subprocess.Popen, name: str) -> subprocess.Popen:
    return _start_again(stack, old, f"logs/{name}.log", {**stack.env(), "OPENRL_METRICS_HOST": "127.0.0.1"})


def _restart_gateway(stack, old: subprocess.Popen) -> subprocess.Popen:
    new = _start_again(stack, old, "logs/gateway.log", stack.gateway_env(stack.env()))
    stack._wait_healthy()
    return new


# ----- hold points (openrl/testhooks.py) -----------------------------------------------


def _hold(stack, name: str) -> None:
    (stack.state_dir / "hold.held").unlink(missing_ok=True)
    (stack.state_dir / "hold").write_text(name + "\n")


def _release(stack) -> None:
    (stack.state_dir / "hold").unlink(missing_ok=True)


def _wait_held(stack, name: str, proc: subprocess.Popen, timeout_s: float = 180) -> None:
    """Wait until ``proc`` reports that it holds a request at hold point ``name``."""
    marker = stack.state_dir / "hold.held"
    deadline = time.monotonic() + timeout_s
    while True:
        if marker.exists() and marker.read_text().split() == [name, str(proc.pid)]:
            return
        assert proc.poll() is None, f"{proc.args[:3]} exited with {proc.returncode}"
        assert time.monotonic() < deadline, f"nothing held at {name}"
        time.sleep(0.05)


# ----- SDK helpers ---------------------------------------------------------------------


def _service(stack):
    return tinker.ServiceClient(base_url=stack.base_url, api_key=stack.api_key)


def _datum(i: int) -> types.Datum:
    toks = [(37 * i + 11 * k) % 5000 + 100 for k in range(24)]
    return types.Datum(model_input=types.ModelInput.from_ints(toks[:-1]),
                       loss_fn_inputs={"target_tokens": toks[1:], "weights": [1.0] * (len(toks) - 1)})


def _submit_step(tc, i: int):
    """forward_backward + optim_step of step ``i``, both submitted (the SDK pipelines them)."""
    fb = tc.forward_backward([_datum(i)], "cross_entropy")
    return fb, tc.optim_step(types.AdamParams(learning_rate=LR))


def _lps(fb) -> np.ndarray:
    return np.asarray(fb.result(timeout=LOST_S).loss_fn_outputs[0]["logprobs"].tolist(), dtype=np.float64)


def _step(tc, i: int) -> np.ndarray:
    fb, opt = _submit_step(tc, i)
    opt.result(timeout=LOST_S)
    return _lps(fb)


def _weights(stack, tc, name: str) -> dict:
    from safetensors.numpy import load_file

    path = TinkerPath.parse(tc.save_weights_for_sampler(name).result(timeout=LOST_S).path)
    return load_file(str(stack.state_dir / "storage" / path.key / "adapter_model.safetensors"))


def _new_run(svc):
    return svc.create_lora_training_client(base_model=BASE_MODEL, rank=RANK, seed=SEED).result(timeout=LOST_S)


def _run_id(tc) -> str:
    return tc.get_info().model_id


def _cursor(stack, run: str) -> int | None:
    import json

    f = stack.state_dir / "storage" / RUNSTATE_DIR / run / "HEAD.json"
    return json.loads(f.read_text())["cursor"] if f.exists() else None


def _raw(stack) -> httpx.Client:
    return httpx.Client(base_url=stack.base_url + "/api/v1", headers={"X-API-Key": stack.api_key}, timeout=60)


def _wait_future(http: httpx.Client, request_id: str, timeout_s: float = 180) -> httpx.Response:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        r = http.post("/retrieve_future", json={"request_id": request_id})
        if not (r.headers.get("content-type", "").startswith("application/json") and r.json().get("type") == "try_again"):
            return r
    raise TimeoutError(request_id)


# ======================================================================================
# trainer crashes and seq_id gaps
# ======================================================================================


@pytest.fixture(scope="module")
def tstack(tmp_path_factory, models_dir):
    """Periodic flushes effectively off (1 h), so the only flush is the one at creation; a
    short restore wait and gap timeout."""
    s = _fault_stack(tmp_path_factory, models_dir, OPENRL_FLUSH_INTERVAL_S="3600", OPENRL_RESTORE_WAIT_S="1",
                     OPENRL_SEQ_GAP_TIMEOUT_S=str(GAP_S))
    yield s
    _release(s)
    s.stop()


@pytest.fixture(scope="module")
def crash(tstack):
    """Two runs on the trainer when it is SIGKILLed in the middle of a forward_backward:

    - run A: created (flushed at creation, cursor 1), its first forward_backward (seq 1) held
      mid-pass and its optim_step (seq 2) queued behind it: nothing of A was answered after
      the last flush;
    - run B: one step answered (seq 1, 2; cursor 3, not flushed), then seq 3 and 4 in flight.

    Before that, an uninterrupted run with A's seed gives the reference."""
    svc = _service(tstack)
    ref = _new_run(svc)
    ref_lps = [_step(ref, i) for i in range(3)]
    ref_w = _weights(tstack, ref, "ref")

    b = _new_run(svc)
    _step(b, 0)
    a = _new_run(svc)
    run_a, run_b = _run_id(a), _run_id(b)
    assert _cursor(tstack, run_a) == 1 and _cursor(tstack, run_b) == 1  # flushed at creation only

    trainer = _proc(tstack, "functions.trainer")
    _hold(tstack, "computed:forward_backward")
    a_fb, a_opt = _submit_step(a, 0)
    b_fb, b_opt = _submit_step(b, 1)
    _wait_held(tstack, "computed:forward_backward", trainer)
    old = _kill(tstack, "functions.trainer")
    assert old.returncode == -signal.SIGKILL
    _release(tstack)
    _restart_worker(tstack, old, "trainer")
    return {"svc": svc, "ref_lps": ref_lps, "ref_w": ref_w, "a": a, "b": b, "a_fb": a_fb, "a_opt": a_opt,
            "b_fb": b_fb, "b_opt": b_opt, "run_a": run_a, "run_b": run_b}


def test_trainer_killed_mid_forward_backward_applies_it_once(tstack, crash):
    """The held forward_backward and the optim_step behind it are redelivered to the new
    trainer, which restores the run at cursor 1 and applies each exactly once: the
    continued run equals the uninterrupted one (applied twice or not at all, it would not)."""
    a = crash["a"]
    crash["a_opt"].result(timeout=LOST_S)
    lps = [_lps(crash["a_fb"])]
    lps += [_step(a, i) for i in (1, 2)]
    _assert_same(lps, crash["ref_lps"], _weights(tstack, a, "after-crash"), crash["ref_w"])
    log = (tstack.state_dir / "logs" / "trainer.log").read_text()
    assert f"restored run state of {crash['run_a']} at cursor 1" in log


def test_trainer_killed_after_unflushed_work_fails_with_category_server(tstack, crash):
    """Run B's answered step (seq 1, 2) died with the trainer: the new trainer restores B
    at cursor 1 from the creation flush, its in-flight seq 3 and 4 can never run, and they
    fail with category "server" (never "user", never a hang, never applied on stale state)."""
    for fut in (crash["b_fb"], crash["b_opt"]):
        with pytest.raises(tinker.RequestFailedError) as err:
            fut.result(timeout=LOST_S)
        assert err.value.category == types.RequestErrorCategory.Server, err.value
        assert "stopped without flushing" in str(err.value) and "restored at seq_id 1" in str(err.value)
    # the trainer is healthy: run A goes on (its own test checks the numbers)
    assert np.isfinite(_step(crash["a"], 3)).all()


def test_seq_gap_fails_after_the_timeout_and_the_run_goes_on(tstack):
    """A forward_backward whose predecessors never come fails after OPENRL_SEQ_GAP_TIMEOUT_S
    with category "user" naming seq_id; the run's next request (from the SDK) runs."""
    svc = _service(tstack)
    tc = _new_run(svc)
    _step(tc, 0)  # seq 1, 2
    run = _run_id(tc)
    body = proto.encode_forward_backward_request(run, 5, [proto.FwdBwdDatum(
        [1, 2, 3], {"target_tokens": np.arange(2, 5), "weights": np.ones(3, np.float32)})], "cross_entropy")
    with _raw(tstack) as http:
        t0 = time.monotonic()
        r = http.post("/forward_backward", content=body, headers=PB)
        assert r.status_code == 200, r.text
        out = _wait_future(http, r.json()["request_id"]).json()
        waited = time.monotonic() - t0
    assert out["category"] == "user" and "seq_id" in out["error"] and "never arrived" in out["error"], out
    assert waited >= GAP_S - 0.5, waited  # it did wait for the predecessor first
    assert np.isfinite(_step(tc, 1)).all()  # seq 3, 4: the gap left the run's cursor where it was


# ======================================================================================
# gateway, nats-server and sampler restarts
# ======================================================================================


@pytest.fixture(scope="module")
def istack(tmp_path_factory, models_dir):
    s = _fault_stack(tmp_path_factory, models_dir)
    yield s
    _release(s)
    s.stop()


@pytest.fixture(scope="module")
def isvc(istack):
    return _service(istack)


def _future_count(stack, op: str) -> float:
    """Gateway metric: results of ``op`` this replica saw land through its futures-bucket watcher."""
    text = httpx.get(stack.base_url + "/metrics", timeout=30).text
    m = re.search(r'^openrl_future_latency_seconds_count\{op="%s",outcome="ok"\} (\S+)$' % op, text, re.M)
    return float(m.group(1)) if m else 0.0


def test_gateway_restart_keeps_pending_futures(istack, isvc):
    """The gateway is SIGKILLed while a forward_backward is held in the trainer; its result
    lands while no gateway runs, an optim_step is submitted while it is down; the SDK
    re-polls / retries and gets both answers from the new gateway."""
    tc = _new_run(isvc)
    trainer = _proc(istack, "functions.trainer")
    _hold(istack, "computed:forward_backward")
    fb = tc.forward_backward([_datum(0)], "cross_entropy")
    _wait_held(istack, "computed:forward_backward", trainer)
    old = _kill(istack, "functions.gateway")
    opt = tc.optim_step(types.AdamParams(learning_rate=LR))  # the SDK retries its submit
    _release(istack)
    time.sleep(1.0)  # let the held result land while no gateway is up (not required for the test to pass)
    _restart_gateway(istack, old)
    assert len(_lps(fb)) == 23
    assert opt.result(timeout=LOST_S).metrics is not None
    assert np.isfinite(_step(tc, 1)).all()


def test_nats_restart_loses_nothing(istack, isvc):
    """nats-server is SIGKILLed while a forward_backward is held in the trainer (an
    optim_step queued behind it) and restarted on its file storage; a sample is sent while
    it is down. Everything is answered; the gateway's futures-bucket watcher is alive again
    (results reach it: its future-latency metric moves)."""
    tc = _new_run(isvc)
    sc = isvc.create_sampling_client(base_model=BASE_MODEL).result(timeout=LOST_S)
    trainer = _proc(istack, "functions.trainer")
    _hold(istack, "computed:forward_backward")
    fb, opt = _submit_step(tc, 0)
    _wait_held(istack, "computed:forward_backward", trainer)
    old = _kill(istack, "nats-server")
    sample = sc.sample(types.ModelInput.from_ints([5, 6, 7]), 1, types.SamplingParams(max_tokens=3, seed=1))
    time.sleep(NATS_DOWN_S)  # longer than the gateway's JetStream request timeout (10 s)
    _start_again(istack, old, "nats.log", None)
    wait_port(istack.nats_port)
    _release(istack)
    assert len(_lps(fb)) == 23
    opt.result(timeout=LOST_S)
    assert 1 <= len(sample.result(timeout=LOST_S).sequences[0].tokens) <= 3
    before = _future_count(istack, "optim_step")
    assert np.isfinite(_step(tc, 1)).all()
    deadline = time.monotonic() + 90
    while _future_count(istack, "optim_step") <= before:
        assert time.monotonic() < deadline, "the gateway's futures-bucket watcher did not come back"
        time.sleep(0.5)
    assert all(p.poll() is None for p in istack.procs), [(p.args[:3], p.returncode) for p in istack.procs]


def test_sampler_killed_mid_sample_is_answered(istack, isvc):
    """The sampler is SIGKILLed while it holds a sample; the request is redelivered to the
    restarted sampler and the SDK gets the same tokens as an uninterrupted seeded sample."""
    sc = isvc.create_sampling_client(base_model=BASE_MODEL).result(timeout=LOST_S)
    prompt = types.ModelInput.from_ints([11, 12, 13, 14])
    params = types.SamplingParams(max_tokens=6, seed=123)
    ref = sc.sample(prompt, 2, params).result(timeout=LOST_S)
    sampler = _proc(istack, "functions.sampler")
    _hold(istack, "handle:sample")
    fut = sc.sample(prompt, 2, params)
    _wait_held(istack, "handle:sample", sampler)
    old = _kill(istack, "functions.sampler")
    _release(istack)
    _restart_worker(istack, old, "sampler")
    got = fut.result(timeout=LOST_S)
    assert [s.tokens for s in got.sequences] == [s.tokens for s in ref.sequences]


async def test_gateway_retry_republishes_a_request_whose_publish_failed(tmp_path):
    """A request whose future was recorded but whose event never reached the stream (the
    gateway lost NATS between the two writes and answered 500): the SDK's retry publishes
    it again instead of answering with a future nobody will ever resolve; a second retry
    adds no second message (same Nats-Msg-Id)."""
    from functions.gateway.context import Gateway
    from openrl.transport.bus import SAMPLE_STREAM, Bus, FutureRecord
    from openrl.transport.local_servers import PortHold, start_nats

    port_hold = PortHold()  # a free port, held until the server is gone
    port = port_hold.port
    nats = start_nats(tmp_path, port)
    bus = await Bus(f"nats://127.0.0.1:{port}").connect()
    try:
        gw = Gateway(bus=bus, registry=None, storage=None)
        rid, meta = "s1:sample:0:7", {"owner": "o1"}
        assert await bus.future_create(rid, "sample", meta=meta)  # the first attempt got this far
        assert (await bus.js.stream_info(SAMPLE_STREAM)).state.messages == 0
        data = {"prompt_tokens": [1, 2], "base_model": BASE_MODEL}
        assert await gw.submit("sample", rid, "s1:sample:0", data, future_meta=meta) is False  # a duplicate...
        assert (await bus.js.stream_info(SAMPLE_STREAM)).state.messages == 1  # ...published this time
        await gw.submit("sample", rid, "s1:sample:0", data, future_meta=meta)
        assert (await bus.js.stream_info(SAMPLE_STREAM)).state.messages == 1
        await bus.future_put(rid, FutureRecord("ok", "sample", body=b"{}", meta=meta))
        assert await gw.submit("sample", rid, "s1:sample:0", data, future_meta=meta) is False
        assert (await bus.future_get(rid)).state == "ok"  # an answered future is left alone
    finally:
        await bus.close()
        nats.terminate()
        nats.wait(timeout=30)
        port_hold.close()


async def _never_ack(bus, cons: dict, rid: str, max_wait_s: float = 60.0) -> int:
    """Fetch ``cons``'s messages and never ack them (workers that die on every delivery)
    until future ``rid`` is no longer pending; returns how many deliveries were fetched."""
    import asyncio

    dead = await bus.work_consumer(cons["stream"], cons["durable"], cons["filter_subject"])
    delivered, deadline = 0, time.monotonic() + max_wait_s
    while time.monotonic() < deadline and (await bus.future_get(rid)).state == "pending":
        try:
            delivered += len(await dead.fetch(batch=2, timeout=1.5))
        except Exception:  # noqa: BLE001 - nothing to deliver (yet)
            await asyncio.sleep(0.2)
    return delivered


async def test_a_request_no_worker_finishes_fails_its_future(tmp_path):
    """A request that every worker taking it dies on (here: a pull subscription on the
    worker's durable consumer that fetches it and never acks, standing in for workers
    killed max_deliver times, on a real nats-server) reaches max_deliver; the binding's
    DeadLetterWatcher fails its future with category "server" and deletes the message. A
    request whose result landed before its dead letter keeps that result. A dead training
    request's seq_id gets a skip, so the run's later requests are not held back."""
    import json

    from openrl.contract import events
    from openrl.transport.bindings.jetstream import JetStreamWorker
    from openrl.transport.bus import SAMPLE_STREAM, TRAIN_STREAM, Bus, FutureRecord, sample_subject, train_subject
    from openrl.transport.local_servers import PortHold, start_nats
    from openrl.transport.worker import consumer_for

    port_hold = PortHold()  # a free port, held until the server is gone
    port = port_hold.port
    nats = start_nats(tmp_path, port)
    bus = await Bus(f"nats://127.0.0.1:{port}", ack_wait_s=1, max_deliver=2).connect()
    try:
        meta = {"owner": "o1"}
        sampler, trainer = consumer_for("functions.sampler", 0), consumer_for("functions.trainer", 0)
        watchers = [JetStreamWorker(object(), bus, **c).dead_letters for c in (sampler, trainer)]
        for w in watchers:  # the workers' watchers only: run() would handle the messages
            await w.start()

        for rid in ("s1:sample:0:1", "s1:sample:0:2"):
            assert await bus.future_create(rid, "sample", meta=meta)
            ev = events.request_event("sample", rid, "s1:sample:0", {"prompt_tokens": [1, 2]})
            await bus.publish(sample_subject(), *events.to_headers_body(ev), msg_id=rid)
        await bus.future_put("s1:sample:0:2", FutureRecord("ok", "sample", body=b'{"done": 1}', meta=meta))
        assert await _never_ack(bus, sampler, "s1:sample:0:1") == 4  # 2 requests x max_deliver
        rec = await bus.future_get("s1:sample:0:1")
        assert rec.state == "error" and rec.meta["owner"] == meta["owner"] and "t1" in rec.meta, rec
        err = json.loads(rec.body)
        assert err["category"] == "server" and "s1:sample:0:1 (sample)" in err["error"], err
        assert "2 times" in err["error"], err
        kept = await bus.future_get("s1:sample:0:2")
        assert kept.state == "ok" and kept.body == b'{"done": 1}'
        for _ in range(50):
            if (await bus.js.stream_info(SAMPLE_STREAM)).state.messages == 0:
                break
            await asyncio.sleep(0.1)
        assert (await bus.js.stream_info(SAMPLE_STREAM)).state.messages == 0  # dead messages deleted

        rid = "m1:3"
        assert await bus.future_create(rid, "optim_step", meta=meta)
        ev = events.request_event("optim_step", rid, "m1", {"seq_id": 3, "adam_params": {}},
                                  extensions={"trainershard": "0"})
        await bus.publish(train_subject(0, "optim_step"), *events.to_headers_body(ev), msg_id=rid)
        assert await _never_ack(bus, trainer, rid) >= 2
        assert json.loads((await bus.future_get(rid)).body)["category"] == "server"
        skip = await bus.js.get_last_msg(TRAIN_STREAM, train_subject(0, "skip"))
        skip_ev = events.from_headers_body(dict(skip.headers), skip.data)
        assert (events.op_of(skip_ev), skip_ev.get_subject()) == ("skip", "m1")
        assert events.data_json(skip_ev) == {"model_id": "m1", "seq_id": 3}
        for w in watchers:
            await w.stop()
    finally:
        await bus.close()
        nats.terminate()
        nats.wait(timeout=30)
        port_hold.close()


async def test_gateway_dead_letter_sink_fails_the_future_and_skips_the_seq_id(keyed_stack):
    """Knative's deadLetterSink path: a request event POSTed to the gateway's
    ``/events/dead-letter`` (binary mode, with the internal token) fails its pending future
    with category "server" and, for a training request, submits a skip for its seq_id; a
    future that already has a result keeps it. Real gateway and nats-server; the futures
    are read from the bucket with the real bus client."""
    import json

    from openrl.contract import events
    from openrl.transport.bus import Bus, FutureRecord

    bus = await Bus(keyed_stack.nats_url).connect()
    try:
        meta = {"owner": "o1"}
        cases = {"dl-run:7": ("optim_step", "dl-run", {"seq_id": 7}), "dl-s:sample:0:1": ("sample", "dl-s", {}),
                 "dl-s:sample:0:2": ("sample", "dl-s", {})}
        for rid, (op, _, _) in cases.items():
            assert await bus.future_create(rid, op, meta=meta)
        await bus.future_put("dl-s:sample:0:2", FutureRecord("ok", "sample", body=b'{"done": 1}', meta=meta))
        async with httpx.AsyncClient(base_url=keyed_stack.base_url, timeout=30) as c:
            for rid, (op, subject, data) in cases.items():
                ev = events.request_event(op, rid, subject, data, extensions={"trainershard": "0"})
                headers, body = events.to_headers_body(ev)
                r = await c.post("/events/dead-letter", content=body,
                                 headers={**headers, "X-OpenRL-Internal-Token": keyed_stack._internal_token})
                assert r.status_code == 202, r.text
        for rid in ("dl-run:7", "dl-s:sample:0:1"):
            rec = await bus.future_get(rid)
            assert rec.state == "error" and rec.meta["owner"] == meta["owner"] and "t1" in rec.meta, rec
            assert json.loads(rec.body)["category"] == "server"
        assert (await bus.future_get("dl-s:sample:0:2")).body == b'{"done": 1}'
        assert await bus.future_get("dl-run:7:skip") is not None  # the skip was submitted
        assert await bus.future_get("dl-s:sample:0:1:skip") is None  # samples hold no seq_id
    finally:
        await bus.close()


def test_docs_faults_section_names_every_test():
    """docs/errors.md "Faults" names each test of this file, and only tests that exist."""
    doc = (Path(__file__).parents[2] / "docs" / "errors.md").read_text()
    section = doc.split("\n## Faults\n", 1)[1].split("\n## ", 1)[0]
    named = set(re.findall(r"`(test_[a-z0-9_]+)`", section))
    here = set(re.findall(r"^(?:async )?def (test_[a-z0-9_]+)\(", Path(__file__).read_text(), flags=re.M))
    assert named == here - {"test_docs_faults_section_names_every_test"}
