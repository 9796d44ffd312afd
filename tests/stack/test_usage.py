"""Usage per API key (issue 24 item 5): tokens trained / prefilled / sampled, accelerator seconds
of the trainer and the sampler, stored bytes, on ``GET /api/v1/usage``, the gateway's
``/metrics`` and ``openrl status``, isolated per key, against the embedded stack of
``keyed_stack`` (real gateway, NATS JetStream, trainer and sampler processes).

The workers write their totals to the KV bucket every ``OPENRL_USAGE_FLUSH_S`` (10 s), so the
checks wait (bounded) until the counts have arrived; what they then compare is exact.
"""

from __future__ import annotations

import json
import time

import httpx
import pytest
import tinker
from tinker import types

from conftest import BASE_MODEL
from functions.gateway.quotas import STORED_CACHE_S
from openrl.edge.auth import owner_of

SEQ = [9707, 1879, 11, 419, 374, 264, 1273, 315, 279, 11691, 9128, 13]


def _usage(base_url: str, key: str, **params) -> dict:
    r = httpx.get(base_url + "/api/v1/usage", headers={"X-API-Key": key}, params=params, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def _mine(base_url: str, key: str) -> dict:
    [row] = _usage(base_url, key)["owners"]
    assert row["owner"] == owner_of(key)
    return row


def _wait(base_url: str, key: str, want: dict, deadline_s: float = 90.0) -> dict:
    """Poll until every count of ``want`` is reached (the workers flush every 10 s)."""
    end = time.monotonic() + deadline_s
    while True:
        row = _mine(base_url, key)
        if all(row[k] >= v for k, v in want.items()) or time.monotonic() > end:
            return row
        time.sleep(1.0)


def test_usage_per_key_counts_what_the_key_did(keyed_stack, keys):
    base = keyed_stack.base_url
    before = _mine(base, keys.other)
    svc = tinker.ServiceClient(base_url=base, api_key=keys.other)
    tc = svc.create_lora_training_client(base_model=BASE_MODEL, rank=4, seed=0).result()
    d = types.Datum(model_input=types.ModelInput.from_ints(SEQ[:-1]),
                    loss_fn_inputs={"target_tokens": SEQ[1:], "weights": [1.0] * (len(SEQ) - 1)})
    for _ in range(2):
        tc.forward_backward([d, d], "cross_entropy")
        tc.optim_step(types.AdamParams(learning_rate=1e-3)).result()
    tc.forward([d], "cross_entropy").result()  # a forward trains nothing: not counted as trained
    sc = tc.save_weights_and_get_sampling_client()
    res = sc.sample(types.ModelInput.from_ints(SEQ[:5]), 3, types.SamplingParams(max_tokens=4, temperature=1.0,
                                                                                  seed=1)).result()
    sampled = sum(len(s.tokens) for s in res.sequences)
    trained = 2 * 2 * (len(SEQ) - 1)
    want = {"tokens_trained": before["tokens_trained"] + trained,
            "tokens_sampled": before["tokens_sampled"] + sampled,
            "tokens_prefilled": before["tokens_prefilled"] + 5}
    row = _wait(base, keys.other, want)
    assert row["tokens_trained"] == want["tokens_trained"]
    assert row["tokens_sampled"] == want["tokens_sampled"]
    assert row["tokens_prefilled"] == want["tokens_prefilled"]
    assert row["gpu_seconds"]["trainer"] > before["gpu_seconds"]["trainer"]
    assert row["gpu_seconds"]["sampler"] > before["gpu_seconds"]["sampler"]
    assert row["processes"] >= 2  # the trainer's and the sampler's records, summed
    # stored bytes: the key's live checkpoints, as its own listing sizes them
    listed = svc.create_rest_client().list_user_checkpoints(limit=1000).result().checkpoints
    stored = sum(c.size_bytes or 0 for c in listed)
    # the gateway reads stored bytes at most every STORED_CACHE_S (5 s): a row cached before the
    # save may still be served; wait out the cache (a bound on staleness, not a timing assertion)
    row = _wait(base, keys.other, {"stored_bytes": stored}, deadline_s=3 * STORED_CACHE_S)
    assert row["stored_bytes"] == stored > 0

    # isolation: another key sees only its own row; an admin listing all sees both
    user_row = _mine(base, keys.user)
    assert user_row["owner"] != row["owner"]
    everyone = {u["owner"]: u for u in _usage(base, keys.admin, access_scope="all")["owners"]}
    assert everyone[owner_of(keys.other)]["tokens_trained"] >= want["tokens_trained"]
    assert user_row["tokens_trained"] == everyone.get(owner_of(keys.user), user_row)["tokens_trained"]
    assert [u["owner"] for u in _usage(base, keys.other, access_scope="all")["owners"]] == [owner_of(keys.other)]

    # the gateway's /metrics: openrl_key_usage{owner, measure}
    text = httpx.get(base + "/metrics", timeout=60).text
    line = next(x for x in text.splitlines() if x.startswith("openrl_key_usage{")
                and f'owner="{owner_of(keys.other)}"' in x and 'measure="tokens_trained"' in x)
    assert float(line.rsplit(" ", 1)[1]) >= want["tokens_trained"]


def test_openrl_status_shows_the_keys_usage(keyed_stack, keys, capsys):
    from openrl.cli import main

    assert main(["status", "--base-url", keyed_stack.base_url, "--api-key", keys.other, "--json"]) in (0, None)
    out = json.loads(capsys.readouterr().out)
    [row] = out["usage"]["owners"]
    assert row["owner"] == owner_of(keys.other) and {"tokens_trained", "gpu_seconds", "stored_bytes"} <= set(row)
