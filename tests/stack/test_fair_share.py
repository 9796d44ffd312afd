"""Tenants sharing the trainer (issue 17 item 5), through the real ``tinker`` SDK and HTTP
against the embedded stack with several keys (``keyed_stack``, tests/fixtures_keys.py).

- Fair packing: key ``user`` floods the trainer with big forward_backward requests while key
  ``other`` sends one small step; ``other``'s request runs in the first pass after it reached
  the trainer's scheduler and the flood is spread over budget-sized passes behind it. Measured
  from the pass composition the trainer writes into its ``trainer pass`` spans
  (``openrl.pass.items``: model_id, seq_id, passes started before the request arrived, tokens,
  owner), never from timings. The queue is built deterministically by pausing the stack's own
  trainer process (SIGSTOP / SIGCONT), as tests/stack/test_load.py does with the sampler.
- Per-key quotas (key ``quota``: 1 run, 3000 tokens per minute, 1 stored byte): a second run,
  a save over the stored bytes, and samples over the token rate answer 429 with
  ``Retry-After`` and ``field: quota.<name>``; other keys are unaffected.
"""

from __future__ import annotations

import json
import os
import signal

import httpx
import tinker
from tinker import types

from conftest import BASE_MODEL
from fixtures_keys import PASS_TOKEN_BUDGET, QUOTA_TOKENS_PER_MIN, skip_unless_own_limits
from nats_helpers import stream_depth, wait_until


def _passes(stack) -> list[tuple[int, list]]:
    f = stack.state_dir / "traces.jsonl"
    out = []
    for line in (f.read_text().splitlines() if f.exists() else []):
        s = json.loads(line)
        if s.get("name") == "trainer pass":
            out.append((int(s["attributes"]["openrl.pass.index"]), json.loads(s["attributes"]["openrl.pass.items"])))
    return sorted(out)


def _datums(n: int, length: int, start: int) -> list[types.Datum]:
    out = []
    for k in range(n):
        toks = [(start + 7 * k + i) % 400 + 10 for i in range(length + 1)]
        out.append(types.Datum(model_input=types.ModelInput.from_ints(toks[:-1]),
                               loss_fn_inputs={"target_tokens": toks[1:], "weights": [1.0] * length}))
    return out


def test_a_flooding_key_does_not_starve_another_keys_small_run(keyed_stack, keys):
    skip_unless_own_limits(keyed_stack, "stops the trainer process (SIGSTOP) and needs keyed_stack's "
                                        f"{PASS_TOKEN_BUDGET}-token pass budget")
    trainer = next(p for p in keyed_stack.procs if "functions.trainer" in p.args)
    a = tinker.ServiceClient(base_url=keyed_stack.base_url, api_key=keys.user)
    b = tinker.ServiceClient(base_url=keyed_stack.base_url, api_key=keys.other)
    ta = a.create_lora_training_client(base_model=BASE_MODEL, rank=4, seed=1).result()
    tb = b.create_lora_training_client(base_model=BASE_MODEL, rank=4, seed=2).result()
    for t in (ta, tb):  # both runs held and their owners known to the trainer
        t.forward_backward(_datums(1, 8, 1), "cross_entropy").result()
    wait_until(lambda: stream_depth(keyed_stack.nats_url, "OPENRL_TRAIN") == 0, 60, "the train queue did not drain")
    n_flood, flood_tokens = 8, 2 * 64  # 8 requests of 128 tokens; the pass budget is 256
    os.kill(trainer.pid, signal.SIGSTOP)  # our own trainer process: everything queues up
    try:
        flood = [ta.forward_backward(_datums(2, 64, 50 + k), "cross_entropy") for k in range(n_flood)]
        wait_until(lambda: stream_depth(keyed_stack.nats_url, "OPENRL_TRAIN") >= n_flood, 60, "the flood was not queued")
        small = tb.forward_backward(_datums(1, 8, 3), "cross_entropy")
        wait_until(lambda: stream_depth(keyed_stack.nats_url, "OPENRL_TRAIN") >= n_flood + 1, 60, "the small request was not queued")
    finally:
        os.kill(trainer.pid, signal.SIGCONT)
    assert small.result().loss_fn_outputs
    assert all(f.result().loss_fn_outputs for f in flood)

    def mine():
        ps = _passes(keyed_stack)
        b_in = [(i, it) for i, items in ps for it in items if it[0] == tb.model_id and it[1] == 2]
        a_seqs = {it[1] for _, items in ps for it in items if it[0] == ta.model_id}
        return (ps, b_in) if b_in and set(range(2, 2 + n_flood)) <= a_seqs else None

    wait_until(lambda: mine() is not None, 60, "the trainer pass spans of both runs")
    ps, [(b_pass, b_item)] = mine()
    by_index = dict(ps)
    assert b_pass == b_item[2] + 1, ps  # the first pass started after B's request arrived
    a_in_b_pass = sum(it[3] for it in by_index[b_pass] if it[0] == ta.model_id)
    assert a_in_b_pass <= PASS_TOKEN_BUDGET  # B did not wait behind A's whole backlog
    a_later = [it[1] for i, items in ps if i > b_pass for it in items if it[0] == ta.model_id]
    assert a_later, f"A's flood should have been queued behind B's request: {ps}"
    a_passes = [i for i, items in ps for it in items if it[0] == ta.model_id and 2 <= it[1] <= 1 + n_flood]
    assert len(set(a_passes)) >= n_flood * flood_tokens // (PASS_TOKEN_BUDGET + flood_tokens)  # spread out
    a_order = [it[1] for _, items in ps for it in items if it[0] == ta.model_id]
    assert a_order == sorted(a_order) and len(a_order) == len(set(a_order))  # seq_id order, each once


def test_per_key_quotas_answer_429_with_retry_after(keyed_stack, keys):
    svc = tinker.ServiceClient(base_url=keyed_stack.base_url, api_key=keys.quota)
    tc = svc.create_lora_training_client(base_model=BASE_MODEL, rank=4, seed=3).result()  # the key's one run
    http = httpx.Client(base_url=keyed_stack.base_url + "/api/v1", headers={"X-API-Key": keys.quota}, timeout=60)
    try:
        session = tc.model_id.split(":train:")[0]
        r = http.post("/create_model", json={"session_id": session, "model_seq_id": 99, "base_model": BASE_MODEL,
                                             "lora_config": {"rank": 4}})
        assert r.status_code == 429, r.text
        assert r.json()["field"] == "quota.runs" and r.json()["category"] == "user"
        assert int(r.headers["Retry-After"]) > 0
        # a retried create of the existing run is not a new run
        again = http.post("/create_model", json={"session_id": session, "model_seq_id": 0, "base_model": BASE_MODEL,
                                                 "lora_config": {"rank": 4}})
        assert again.status_code == 200, again.text

        # stored bytes (quota 1 byte): the first save passes (nothing stored yet), the next is refused
        tc.save_state("first").result()
        r = http.post("/save_weights", json={"model_id": tc.model_id, "path": "second", "seq_id": 2})
        assert r.status_code == 429, r.text
        assert r.json()["field"] == "quota.stored_bytes" and "bytes" in r.json()["detail"]
        assert int(r.headers["Retry-After"]) > 0

        # tokens per minute: samples of 1001 tokens each (1000-token prompt + max_tokens 1)
        sc = svc.create_sampling_client(base_model=BASE_MODEL).result()
        sid = sc._sampling_session_id
        prompt = {"chunks": [{"tokens": [(7 * i) % 300 + 5 for i in range(1000)]}]}
        codes = []
        for seq in range(QUOTA_TOKENS_PER_MIN // 1001 + 2):
            r = http.post("/asample", json={"sampling_session_id": sid, "seq_id": seq, "num_samples": 1,
                                            "prompt": prompt, "sampling_params": {"max_tokens": 1}})
            codes.append(r.status_code)
        assert codes[: QUOTA_TOKENS_PER_MIN // 1001] == [200] * (QUOTA_TOKENS_PER_MIN // 1001), codes
        assert codes[-1] == 429, codes
        assert r.json()["field"] == "quota.tokens_per_min"
        assert 1 <= int(r.headers["Retry-After"]) <= 60  # the SDK honours Retry-After up to 60 s
        resend = http.post("/asample", json={"sampling_session_id": sid, "seq_id": 0, "num_samples": 1,
                                             "prompt": prompt, "sampling_params": {"max_tokens": 1}})
        assert resend.status_code == 200  # a resend of an admitted request is not charged again
        too_big = http.post("/asample", json={"sampling_session_id": sid, "seq_id": 50, "num_samples": 1,
                                              "prompt": prompt, "sampling_params": {"max_tokens": 3000}})
        assert too_big.status_code == 400 and too_big.json()["field"] == "quota.tokens_per_min"
    finally:
        http.close()
    # another key is not limited by this key's quotas
    other = tinker.ServiceClient(base_url=keyed_stack.base_url, api_key=keys.other)
    other.create_lora_training_client(base_model=BASE_MODEL, rank=4, seed=4).result()
