"""Load and backpressure through the real ``tinker`` SDK against the embedded stack.

- 2,000 concurrent ``sample()`` futures (``max_tokens=1``) all answer.
- When the sample queue holds ``OPENRL_MAX_PENDING_SAMPLES`` unanswered requests, the gateway
  answers 429 with ``Retry-After``; the SDK backs off and resends the same seq_id, and every
  request is answered once the queue drains. The queue is filled deterministically by
  pausing the stack's own sampler process (SIGSTOP / SIGCONT); nothing is mocked.

Speed is measured by ``bench/gateway_cpu.py`` (docs/benchmarks.md), not here.
"""

from __future__ import annotations

import os
import signal
import time

import httpx
import tinker
from tinker import types

from conftest import BASE_MODEL
from fixtures_keys import MAX_PENDING_SAMPLES, skip_unless_own_limits
from nats_helpers import stream_depth, wait_until


def test_2000_concurrent_sample_futures_all_answer(stack, api_key):
    svc = tinker.ServiceClient(base_url=stack.base_url, api_key=api_key)
    sc = svc.create_sampling_client(base_model=BASE_MODEL).result()
    prompt, params = types.ModelInput.from_ints([1, 2, 3]), types.SamplingParams(max_tokens=1)
    futs = [sc.sample(prompt, 1, params) for _ in range(2000)]
    results = [f.result() for f in futs]
    assert len(results) == 2000
    assert all(len(r.sequences) == 1 and len(r.sequences[0].tokens) == 1 for r in results)
    assert all(p.poll() is None for p in stack.procs)


def _answer(http: httpx.Client, request_id: str, timeout_s: float = 120) -> httpx.Response:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        r = http.post("/retrieve_future", json={"request_id": request_id}, timeout=60,
                      headers={"Accept": "application/x-protobuf"})  # as the SDK asks for a SampleResponse
        if r.headers.get("content-type", "").startswith("application/x-protobuf") or r.status_code != 200 \
                or r.json().get("type") != "try_again":
            return r
    raise TimeoutError(request_id)


def test_full_queue_answers_429_with_retry_after(keyed_stack, keys):
    skip_unless_own_limits(keyed_stack, "stops the sampler process (SIGSTOP) and needs keyed_stack's "
                                        f"{MAX_PENDING_SAMPLES}-sample queue limit")
    sampler = next(p for p in keyed_stack.procs if "functions.sampler" in p.args)
    svc = tinker.ServiceClient(base_url=keyed_stack.base_url, api_key=keys.user)
    sc = svc.create_sampling_client(base_model=BASE_MODEL).result()
    sid = sc._sampling_session_id
    sc.sample(types.ModelInput.from_ints([1, 2]), 1, types.SamplingParams(max_tokens=1)).result()
    wait_until(lambda: stream_depth(keyed_stack.nats_url, "OPENRL_SAMPLE") == 0, 120, "the sample queue did not drain")
    http = httpx.Client(base_url=keyed_stack.base_url + "/api/v1", headers={"X-API-Key": keys.user}, timeout=60)
    admin = httpx.Client(base_url=keyed_stack.base_url + "/api/v1", headers={"X-API-Key": keys.admin}, timeout=60)

    def post(seq: int) -> httpx.Response:
        return http.post("/asample", json={"sampling_session_id": sid, "seq_id": seq, "num_samples": 1,
                                           "prompt": {"chunks": [{"tokens": [1, 2, 3]}]},
                                           "sampling_params": {"max_tokens": 1}})

    def rejected_so_far() -> int:
        return admin.get("/admin/stats").json()["rejected_429"].get("OPENRL_SAMPLE", 0)

    os.kill(sampler.pid, signal.SIGSTOP)  # our own sampler process: nothing leaves the queue now
    futs = []
    try:
        accepted, rejected = [], []
        for seq in range(10_000, 10_000 + MAX_PENDING_SAMPLES + 8):
            r = post(seq)
            (accepted if r.status_code == 200 else rejected).append((seq, r))
        assert 0 < len(accepted) <= MAX_PENDING_SAMPLES and rejected, (len(accepted), len(rejected))
        for _, r in rejected:
            assert r.status_code == 429, r.text
            assert r.headers["Retry-After"] == "1"
            assert "OPENRL_SAMPLE" in r.json()["detail"]
        # while full: a resend of an accepted seq_id gets its future back, a rejected one stays rejected
        seq0, r0 = accepted[0]
        again = post(seq0)
        assert again.status_code == 200 and again.json()["request_id"] == r0.json()["request_id"]
        assert post(rejected[0][0]).status_code == 429
        # the SDK meets the same 429s and keeps resending
        before = rejected_so_far()
        futs = [sc.sample(types.ModelInput.from_ints([4, 5]), 1, types.SamplingParams(max_tokens=1))
                for _ in range(30)]
        wait_until(lambda: rejected_so_far() >= before + 2, 60, "the SDK's samples were never turned away")
    finally:
        os.kill(sampler.pid, signal.SIGCONT)
    assert len([f.result() for f in futs]) == 30
    for _, r in accepted:
        assert _answer(http, r.json()["request_id"]).headers["content-type"] == "application/x-protobuf"
    for seq, _ in rejected:  # resent after the queue drained: accepted now, and answered
        deadline = time.monotonic() + 60
        while (r := post(seq)).status_code == 429 and time.monotonic() < deadline:
            time.sleep(1)
        assert r.status_code == 200, r.text
        assert _answer(http, r.json()["request_id"]).headers["content-type"] == "application/x-protobuf"
    assert all(p.poll() is None for p in keyed_stack.procs)
    http.close()
    admin.close()
