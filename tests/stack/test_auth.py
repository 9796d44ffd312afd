"""API keys and isolation between keys (invariant 6), through the real ``tinker`` SDK against
the embedded stack of ``keyed_stack`` (keys: ``user``, ``other``, ``admin``), plus the key
configuration rules of :mod:`openrl.edge.auth`.
"""

from __future__ import annotations

import os
import subprocess
import sys

import httpx
import numpy as np
import pytest
import tinker
from tinker import types

from conftest import BASE_MODEL
from openrl.edge import proto
from openrl.edge.auth import AuthConfigError, AuthError, KeyRing, load_keys, owner_of, parse_entry


def client(stack, key: str) -> tinker.ServiceClient:
    return tinker.ServiceClient(base_url=stack.base_url, api_key=key)


def raw(stack, key: str | None = None) -> httpx.Client:
    headers = {"X-API-Key": key} if key else {}
    return httpx.Client(base_url=stack.base_url + "/api/v1", headers=headers, timeout=30)


# ----- key configuration (no stack) -------------------------------------------------------


def test_key_entries_names_admin_and_hashes(tmp_path):
    f = tmp_path / "keys"
    hashed = "tml-hashed-key-0123456789"
    import hashlib

    f.write_text("# the team's keys\n\ntml-alice-0123456789\nbob: tml-bob-0123456789\n"
                 f"admin ops: sha256:{hashlib.sha256(hashed.encode()).hexdigest()}\n")
    ring = load_keys({"OPENRL_API_KEYS_FILE": str(f), "OPENRL_API_KEYS": "admin tml-root-0123456789, tml-x-0123456789"})
    assert len(ring.entries) == 5
    assert ring.check("tml-bob-0123456789").name == "bob"
    assert not ring.check("tml-alice-0123456789").admin
    assert ring.check(hashed).admin and ring.check(hashed).name == "ops"
    assert ring.check("tml-root-0123456789").admin
    # the owner id is sha256(key)[:16], whatever form the entry took
    assert ring.check(hashed).owner == owner_of(hashed) == hashlib.sha256(hashed.encode()).hexdigest()[:16]
    for bad in (None, "", "tml-unknown-0123456789", "tml-alice-012345678"):
        with pytest.raises(AuthError, match="X-API-Key"):
            ring.check(bad)


@pytest.mark.parametrize("entry,msg", [
    ("alice-0123456789", "must start with 'tml-'"),
    ("tml-short", "at least 8"),
    ("sha256:abcd", "64 hex"),
    ("admin a: b: tml-0123456789", "expected"),
])
def test_malformed_key_entries_are_refused(entry, msg):
    with pytest.raises(AuthConfigError, match=msg):
        parse_entry(entry, "test")


def test_no_keys_refuses_unless_insecure_any_key(tmp_path):
    with pytest.raises(AuthConfigError, match="no API keys configured"):
        load_keys({})
    with pytest.raises(AuthConfigError, match="OPENRL_API_KEYS_FILE"):
        load_keys({"OPENRL_API_KEYS_FILE": str(tmp_path / "missing")})
    ring = load_keys({"OPENRL_INSECURE_ANY_KEY": "1"})
    assert ring.allow_any
    a, b = ring.check("tml-anything-1"), ring.check("tml-anything-2")
    assert a.owner != b.owner and not a.admin  # still one owner per key
    with pytest.raises(AuthError):
        ring.check("not-a-tml-key")


def test_gateway_process_refuses_to_start_without_keys(tmp_path):
    env = {k: v for k, v in os.environ.items()
           if k not in ("OPENRL_API_KEYS", "OPENRL_API_KEYS_FILE", "OPENRL_INSECURE_ANY_KEY")}
    env.update(OPENRL_HOME=str(tmp_path), OPENRL_STORAGE=(tmp_path / "s").as_uri(),
               OPENRL_NATS_URL="nats://127.0.0.1:9")  # never reached: it must stop before connecting
    # port 0: it stops before it binds anything, and would bind any free port if it did not
    r = subprocess.run([sys.executable, "-m", "functions.gateway", "--port", "0"], env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode != 0
    assert "no API keys configured" in r.stderr


def test_internal_token():
    ring = KeyRing([], allow_any=True, internal_token="s3cret")
    ring.check_internal("s3cret")
    for bad in (None, "", "S3cret"):
        with pytest.raises(AuthError, match="X-OpenRL-Internal-Token"):
            ring.check_internal(bad)
    KeyRing([], allow_any=True).check_internal(None)  # no token configured: open


def test_embedded_key_file_is_private_and_passed_to_the_gateway(tmp_path):
    from openrl.transport.embedded import Stack, api_key

    key = api_key(tmp_path)
    assert key.startswith("tml-") and len(key) > 20
    assert (tmp_path / "api_key").stat().st_mode & 0o077 == 0
    assert api_key(tmp_path) == key  # generated once
    s = Stack(state_dir=tmp_path)
    s._internal_token = "t"
    env = s.gateway_env({"OPENRL_API_KEYS": "admin tml-extra-0123456789"})
    ring = load_keys(env)
    assert ring.check(key).owner == owner_of(key)
    assert ring.check("tml-extra-0123456789").admin
    assert ring.has_internal_token


# ----- the running gateway ----------------------------------------------------------------


def test_missing_or_wrong_key_is_401_naming_the_header(keyed_stack, keys):
    with raw(keyed_stack) as c:
        for method, path in (("POST", "/create_session"), ("POST", "/client/config"), ("GET", "/training_runs"),
                             ("POST", "/retrieve_future"), ("GET", "/no/such/route")):
            r = c.request(method, path, json={})
            assert r.status_code == 401, (path, r.text)
            assert r.json()["field"] == "X-API-Key" and "X-API-Key" in r.json()["detail"]
        assert c.get("/healthz").json() == {"status": "ok"}  # probes need no key
    with raw(keyed_stack, "tml-not-a-configured-key-123") as c:
        r = c.post("/create_session", json={})
        assert r.status_code == 401 and "invalid API key" in r.json()["detail"]
    with raw(keyed_stack, keys.other) as c:
        assert c.post("/create_session", json={}).status_code == 200


def test_sdk_with_a_wrong_key_gets_authentication_error(keyed_stack):
    svc = client(keyed_stack, "tml-not-a-configured-key-456")
    with pytest.raises(tinker.AuthenticationError):
        svc.create_lora_training_client(base_model=BASE_MODEL, rank=4).result()


def test_event_sinks_need_the_internal_token(keyed_stack):
    with httpx.Client(base_url=keyed_stack.base_url, timeout=30) as c:
        for path in ("/events/result", "/events/dead-letter"):
            assert c.post(path, content=b"{}").status_code == 401
            assert c.post(path, content=b"{}", headers={"X-OpenRL-Internal-Token": "wrong"}).status_code == 401
            # the right token passes auth and reaches the route (which rejects a non-CloudEvent)
            r = c.post(path, content=b"{}", headers={"X-OpenRL-Internal-Token": keyed_stack._internal_token})
            assert r.status_code == 400, r.text
            # a Trigger URI cannot carry headers: GKE's carry the token in the query instead
            assert c.post(path, content=b"{}", params={"token": "wrong"}).status_code == 401
            r = c.post(path, content=b"{}", params={"token": keyed_stack._internal_token})
            assert r.status_code == 400, r.text


@pytest.fixture(scope="module")
def owned(keyed_stack, keys):
    """A run of ``user`` with a saved state, a sampler snapshot and a sampling session."""
    svc = client(keyed_stack, keys.user)
    tc = svc.create_lora_training_client(base_model=BASE_MODEL, rank=4, seed=0).result()
    d = types.Datum(model_input=types.ModelInput.from_ints([1, 2, 3]),
                    loss_fn_inputs={"target_tokens": [2, 3, 4], "weights": [1.0, 1.0, 1.0]})
    fb = tc.forward_backward([d], "cross_entropy")
    fb.result()
    state = tc.save_state("mine").result().path
    sampler_path = tc.save_weights_for_sampler("mine-s").result().path
    sc = tc.save_weights_and_get_sampling_client().result()
    sc.sample(types.ModelInput.from_ints([1, 2]), 1, types.SamplingParams(max_tokens=1)).result()
    session_id = tc.model_id.split(":")[0]
    return {"svc": svc, "tc": tc, "run": tc.model_id, "state": state, "sampler_path": sampler_path,
            "sampling_session": sc._sampling_session_id, "session": session_id,
            "future": f"{tc.model_id}:1"}


def test_other_key_cannot_see_or_touch_the_run(keyed_stack, keys, owned):
    run = owned["run"]
    svc2 = client(keyed_stack, keys.other)
    rest2 = svc2.create_rest_client()
    with pytest.raises(tinker.NotFoundError):
        rest2.get_training_run(run).result()
    with pytest.raises(tinker.NotFoundError):
        rest2.list_checkpoints(run).result()
    with pytest.raises(tinker.NotFoundError):
        rest2.get_weights_info_by_tinker_path(owned["state"]).result()
    with pytest.raises(tinker.NotFoundError):
        rest2.delete_checkpoint_from_tinker_path(owned["state"]).result()
    with pytest.raises(tinker.NotFoundError):
        rest2.publish_checkpoint_from_tinker_path(owned["state"]).result()
    with pytest.raises(tinker.NotFoundError):
        rest2.get_sampler(owned["sampling_session"]).result()
    with pytest.raises(tinker.NotFoundError):
        rest2.get_session(owned["session"]).result()
    with pytest.raises(tinker.NotFoundError):
        svc2.create_sampling_client(model_path=owned["sampler_path"]).sample(
            types.ModelInput.from_ints([1]), 1, types.SamplingParams(max_tokens=1)).result()
    with pytest.raises(tinker.NotFoundError):
        svc2.create_training_client_from_state(owned["state"]).result()
    assert run not in {r.training_run_id for r in rest2.list_training_runs(limit=100).result().training_runs}
    assert not [c for c in rest2.list_user_checkpoints().result().checkpoints if run in c.tinker_path]
    assert owned["session"] not in rest2.list_sessions().result().sessions

    # the routes the SDK only reaches with the owner's own ids, sent raw with the other key
    body = proto.encode_forward_backward_request(
        model_id=run, seq_id=99, loss_fn="cross_entropy",
        data=[proto.FwdBwdDatum(tokens=[1, 2], loss_fn_inputs={"target_tokens": np.array([2, 3]),
                                                               "weights": np.array([1.0, 1.0])})])
    with raw(keyed_stack, keys.other) as c:
        probes = [
            c.post("/retrieve_future", json={"request_id": owned["future"]}),
            c.post("/get_info", json={"model_id": run}),
            c.post("/forward_backward", content=body, headers={"Content-Type": "application/x-protobuf"}),
            c.post("/optim_step", json={"model_id": run, "seq_id": 99, "adam_params": {"learning_rate": 0.1}}),
            c.post("/save_weights", json={"model_id": run, "seq_id": 99, "path": "stolen"}),
            c.post("/asample", json={"sampling_session_id": owned["sampling_session"], "seq_id": 5,
                                     "prompt": {"chunks": [{"tokens": [1]}]}}),
            c.post("/create_model", json={"session_id": owned["session"], "model_seq_id": 7, "base_model": BASE_MODEL}),
            c.post("/weights_info", json={"tinker_path": owned["state"]}),
            c.put(f"/training_runs/{run}/checkpoints/weights/mine/ttl", json={"ttl_seconds": 1}),
            c.delete(f"/training_runs/{run}/checkpoints/weights/mine"),
            c.post("/session_heartbeat", json={"session_id": owned["session"]}),
            c.post("/save_weights_external", json={"model_id": run, "path": "x", "seq_id": 99}),
            c.post("/load_weights", json={"model_id": run, "seq_id": 1, "path": owned["state"]}),
            c.post("/unload_model", json={"model_id": run}),
            c.post(f"/sessions/{owned['session']}/finish", json={"reason": {"type": "success"}}),
            c.get(f"/sessions/{owned['session']}/trace_export"),
            c.put(f"/sessions/{owned['session']}/project", json={"project_id": "p"}),
            c.get(f"/training_runs/{run}/checkpoints/weights/mine/external_weights_urls"),
            c.get(f"/training_runs/{run}/checkpoints/weights/mine/archive"),
            c.post(f"/training_runs/{run}/checkpoints/weights/mine/publish"),
        ]
        assert owned["session"] not in c.post("/sessions/search", json={}).text
    for r in probes:
        assert r.status_code in (404, 410), (r.request.url, r.status_code, r.text)
    # and nothing of the owner's changed
    rest1 = owned["svc"].create_rest_client()
    ids = {c.checkpoint_id for c in rest1.list_checkpoints(run).result().checkpoints}
    assert {"weights/mine", "sampler_weights/mine-s"} <= ids
    assert all(not c.public and c.expires_at is None for c in rest1.list_checkpoints(run).result().checkpoints)
    assert owned["tc"].forward([types.Datum(model_input=types.ModelInput.from_ints([1, 2]),
                                            loss_fn_inputs={"target_tokens": [2, 3]})], "cross_entropy").result()


def test_admin_lists_every_key_but_only_when_asked(keyed_stack, keys, owned):
    run = owned["run"]
    other_tc = client(keyed_stack, keys.other).create_lora_training_client(base_model=BASE_MODEL, rank=4).result()
    admin = client(keyed_stack, keys.admin).create_rest_client()
    assert admin.list_training_runs(limit=100).result().training_runs == []  # owned: nothing of its own
    every = {r.training_run_id for r in admin.list_training_runs(limit=100, access_scope="accessible").result().training_runs}
    assert {run, other_tc.model_id} <= every
    assert admin.get_training_run(run, access_scope="accessible").result().training_run_id == run
    with raw(keyed_stack, keys.admin) as c:
        assert c.get(f"/training_runs/{run}").status_code == 404  # reads need the scope too
        ckpts = c.get("/checkpoints", params={"access_scope": "all", "limit": 1000}).json()["checkpoints"]
        assert owned["state"] in {x["tinker_path"] for x in ckpts}
        assert owned["session"] in c.get("/sessions", params={"access_scope": "all", "limit": 1000}).json()["sessions"]
        assert c.get("/admin/stats").status_code == 200
    # a user key asking for everything still sees only its own
    with raw(keyed_stack, keys.other) as c:
        runs = c.get("/training_runs", params={"access_scope": "all", "limit": 1000}).json()["training_runs"]
        own = c.get("/training_runs", params={"limit": 1000}).json()["training_runs"]
        # the same as its own listing (other tests of the session may have given this key runs too)
        assert {r["training_run_id"] for r in runs} == {r["training_run_id"] for r in own}
        assert other_tc.model_id in {r["training_run_id"] for r in runs} and run not in {r["training_run_id"] for r in runs}
        assert c.get("/admin/stats").status_code == 403


def test_insecure_any_key_gateway_in_process(keyed_stack, tmp_path):
    """A gateway app built with OPENRL_INSECURE_ANY_KEY semantics (in this process, on the
    keyed stack's NATS): any tml- key works, the SDK is warned, other keys are refused."""
    from fastapi.testclient import TestClient

    from functions.gateway.app import create_app
    from openrl.model.registry import ModelRegistry

    app = create_app(nats_url=keyed_stack.nats_url, storage_url=keyed_stack.storage,
                     registry=ModelRegistry.load(None, models_dir=keyed_stack.state_dir / "models"),
                     keys=KeyRing([], allow_any=True))
    with TestClient(app) as c:
        r = c.post("/api/v1/create_session", json={}, headers={"X-API-Key": "tml-anything-at-all"})
        assert r.status_code == 200 and "ANY tml- API key" in r.json()["warning_message"]
        assert c.post("/api/v1/create_session", json={}, headers={"X-API-Key": "sk-nope"}).status_code == 401
