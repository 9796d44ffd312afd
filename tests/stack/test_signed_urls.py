"""Signed download URLs and the internal event token (issue 17 item 6).

Against the gateway of ``keyed_stack`` (the real embedded stack, ``file://`` storage, so the
gateway's own HMAC-signed ``/download`` routes serve the files; see
``functions/gateway/routes_download.py``):

* a URL from ``external_weights_urls`` / ``archive`` serves the file without a key, any number
  of times until it expires (reusable by design, like a cloud signed URL: "replay" before the
  expiry is allowed and documented; after it, refused);
* a tampered URL (signature, file, checkpoint, run, or a later ``expires``) answers 403 naming
  ``sig``; an expired one (signed with the real secret, read from the stack's NATS KV bucket,
  so only the time is wrong) answers 403 naming ``expires``;
* the internal token of ``/events/*`` (``OPENRL_INTERNAL_TOKEN``) is compared as sha256
  digests with ``hmac.compare_digest`` and appears in no log: not in the gateway process's
  log file, nor in the DEBUG records of an in-process app (the real app on the stack's NATS)
  that took a bad and a good token, in the header and in ``?token=``.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import time
from urllib.parse import parse_qs, urlsplit

import httpx
import pytest

from conftest import BASE_MODEL
from functions.gateway.routes_download import ARCHIVE, sign


def _wait(http: httpx.Client, request_id: str) -> dict:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        r = http.post("/retrieve_future", json={"request_id": request_id}, timeout=60)
        body = r.json()
        if body.get("type") != "try_again":
            return body
    raise TimeoutError(request_id)


@pytest.fixture(scope="module")
def ck(keyed_stack, keys):
    """A saved checkpoint of key "user" and one of key "other": (run, kind, name) each, the
    HTTP client of "user", and the stack's download secret (from its NATS KV bucket)."""
    api = keyed_stack.base_url + "/api/v1"
    out = {}
    for who, key in (("user", keys.user), ("other", keys.other)):
        http = httpx.Client(base_url=api, headers={"X-API-Key": key}, timeout=60)
        session = http.post("/create_session", json={}).json()["session_id"]
        r = http.post("/create_model", json={"session_id": session, "model_seq_id": 0, "base_model": BASE_MODEL,
                                             "lora_config": {"rank": 4}}).json()
        _wait(http, r["request_id"])
        r = http.post("/save_weights", json={"model_id": r["model_id"], "path": f"signed-{who}", "seq_id": 1}).json()
        path = _wait(http, r["request_id"])["path"]
        out[who] = (tuple(path[len("tinker://"):].split("/")), http)
    # the first URL request creates the secret; then read it as a second replica would
    (run, kind, name), http = out["user"]
    urls = http.get(f"/training_runs/{run}/checkpoints/{kind}/{name}/external_weights_urls").json()["urls"]

    async def secret() -> bytes:
        from openrl.transport.bus import Bus

        bus = Bus(keyed_stack.nats_url)
        await bus.connect()
        try:
            return str((await bus.meta_get("config", "download_secret"))["secret"]).encode()
        finally:
            await bus.close()

    yield {"user": out["user"][0], "other": out["other"][0], "http": http, "urls": urls,
           "secret": asyncio.run(secret()), "base": keyed_stack.base_url}
    for _, h in out.values():
        h.close()


def _query(url: str) -> tuple[str, int, str]:
    u = urlsplit(url)
    q = parse_qs(u.query)
    return u.path, int(q["expires"][0]), q["sig"][0]


def _refused(url: str, field: str) -> None:
    r = httpx.get(url)
    assert r.status_code == 403, (url, r.status_code, r.text[:200])
    assert r.json()["field"] == field and r.json()["category"] == "user", r.json()


def test_url_serves_the_file_until_it_expires_and_may_be_reused(ck):
    url = ck["urls"]["adapter_config.json"]
    first, second = httpx.get(url), httpx.get(url)  # no X-API-Key; the same URL twice
    assert first.status_code == second.status_code == 200, first.text
    assert first.content == second.content and b'"r"' in first.content


def test_tampered_urls_are_refused(ck):
    base, (run, kind, name), (orun, okind, oname) = ck["base"], ck["user"], ck["other"]
    url = ck["urls"]["adapter_config.json"]
    path, expires, sig = _query(url)
    flipped = ("0" if sig[0] != "0" else "1") + sig[1:]
    _refused(f"{base}{path}?expires={expires}&sig={flipped}", "sig")
    _refused(f"{base}{path}?expires={expires}&sig={sig.upper()}", "sig")
    _refused(f"{base}{path}?expires={expires + 3600}&sig={sig}", "sig")  # a later expiry, same signature
    _refused(f"{base}{path}?expires={expires}", "sig")  # no signature at all
    other_file = next(f for f in ck["urls"] if f != "adapter_config.json")
    _refused(f"{base}/download/{run}/{kind}/{name}/{other_file}?expires={expires}&sig={sig}", "sig")
    _refused(f"{base}/download/{orun}/{okind}/{oname}/adapter_config.json?expires={expires}&sig={sig}", "sig")


def test_expired_urls_are_refused(ck):
    """Signed with the real secret: the valid-expiry control is served, the expired one is not."""
    base, (run, kind, name) = ck["base"], ck["user"]
    what = f"{run}/{kind}/{name}/adapter_config.json"
    later, past = int(time.time()) + 600, int(time.time()) - 1
    ok = httpx.get(f"{base}/download/{what}?expires={later}&sig={sign(ck['secret'], what, later)}")
    assert ok.status_code == 200, ok.text
    _refused(f"{base}/download/{what}?expires={past}&sig={sign(ck['secret'], what, past)}", "expires")
    arch = f"{run}/{kind}/{name}"
    ok = httpx.get(f"{base}/download-archive/{arch}.tar?expires={later}&sig={sign(ck['secret'], f'{arch}/{ARCHIVE}', later)}")
    assert ok.status_code == 200 and ok.content[257:262] == b"ustar", ok.text[:200]
    _refused(f"{base}/download-archive/{arch}.tar?expires={past}&sig={sign(ck['secret'], f'{arch}/{ARCHIVE}', past)}",
             "expires")


def test_archive_url_tampered_is_refused(ck):
    (run, kind, name), (orun, okind, oname) = ck["user"], ck["other"]
    url = ck["http"].get(f"/training_runs/{run}/checkpoints/{kind}/{name}/archive").json()["url"]
    assert httpx.get(url).status_code == 200
    path, expires, sig = _query(url)
    _refused(f"{ck['base']}{path}?expires={expires}&sig={sig[::-1]}", "sig")
    _refused(f"{ck['base']}/download-archive/{orun}/{okind}/{oname}.tar?expires={expires}&sig={sig}", "sig")


# ----- the internal token ----------------------------------------------------------------

BAD = "bad-token-" + hashlib.sha256(b"x").hexdigest()[:16]


def _events_requests(post, token: str) -> list[int]:
    """POST /events/result and /events/dead-letter with no token, a bad one and ``token``, in
    the header and in ``?token=``: the statuses."""
    out = []
    for path in ("/events/result", "/events/dead-letter"):
        out.append(post(path, headers={}).status_code)
        for tok in (BAD, token):
            out.append(post(path, headers={"X-OpenRL-Internal-Token": tok}).status_code)
            out.append(post(f"{path}?token={tok}", headers={}).status_code)
    return out


def test_internal_token_is_checked_and_never_logged_by_the_gateway(keyed_stack):
    token = keyed_stack._internal_token
    assert token

    def post(path, headers):
        return httpx.post(keyed_stack.base_url + path, content=b"not a cloudevent", headers=headers, timeout=60)

    # no token, bad header, good header, bad query, good query (per sink): 401s and 400s (not a CloudEvent)
    assert _events_requests(post, token) == [401, 401, 401, 400, 400] * 2
    r = post("/events/result", {"X-OpenRL-Internal-Token": BAD})
    assert r.json()["field"] == "X-OpenRL-Internal-Token" and BAD not in r.text and token not in r.text
    log = (keyed_stack.state_dir / "logs" / "gateway.log").read_text()
    assert token not in log and BAD not in log


def test_internal_token_compared_in_constant_time_and_not_in_debug_logs(keyed_stack, models_dir, caplog,
                                                                        monkeypatch):
    """The real app in-process (its NATS is the stack's), every logger at DEBUG: neither token
    appears in any record of the server side (the test client's httpx log, which prints the
    ``?token=`` URLs it sends, is the sender's and left out), and every check went through ``hmac.compare_digest`` on digests."""
    from fastapi.testclient import TestClient

    from functions.gateway.app import create_app
    from openrl.edge import auth
    from openrl.model.registry import ModelRegistry

    calls = []
    real = hmac.compare_digest

    def spy(a, b):
        calls.append((a, b))
        return real(a, b)

    monkeypatch.setattr(auth.hmac, "compare_digest", spy)
    token = "internal-" + hashlib.sha256(b"secret").hexdigest()
    keys = auth.KeyRing([auth.parse_entry(keyed_stack.api_key, "test")], internal_token=token)
    app = create_app(nats_url=keyed_stack.nats_url, storage_url=keyed_stack.storage,
                     registry=ModelRegistry.load(None, models_dir=models_dir), keys=keys)
    caplog.set_level(logging.DEBUG)
    with TestClient(app) as client:
        statuses = _events_requests(lambda p, headers: client.post(p, content=b"x", headers=headers), token)
    assert statuses == [401, 401, 401, 400, 400] * 2
    # the records of the server side (the test client's own httpx logger prints the URLs it sends)
    server = "\n".join(f"{r.name} {r.getMessage()} {r.__dict__}" for r in caplog.records if not r.name.startswith("httpx"))
    assert server and token not in server and BAD not in server
    # 8 checks with a token (2 sinks x {bad, good} x {header, query}), each digest against digest
    digests = [(a, b) for a, b in calls if len(a) == len(b) == 32]
    assert len(digests) >= 8 and all(isinstance(a, bytes) for a, _ in digests)
    assert not any(token.encode() in (a, b) or token in (a, b) for a, b in calls)
