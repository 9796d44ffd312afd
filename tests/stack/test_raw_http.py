"""Every route family through raw HTTP, as a client other than the Python SDK speaks it (issue
36): plain ``httpx``, JSON bodies and JSON answers, no ``tinker`` import. Content negotiation:
``retrieve_future`` answers the protobuf results (forward / forward_backward, sample) as JSON
unless ``Accept`` asks for ``application/x-protobuf``, which is what the SDK sends.

Runs against the session's embedded ``stack`` (real gateway, NATS JetStream, trainer and sampler).
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import httpx
import pytest

from conftest import BASE_MODEL

SEQ = [9707, 1879, 11, 419, 374, 264, 1273, 315, 279, 11691, 9128, 13]
JSON = {"Accept": "application/json", "Content-Type": "application/json"}


@pytest.fixture(scope="module")
def http(stack, api_key):
    with httpx.Client(base_url=stack.base_url + "/api/v1", headers={"X-API-Key": api_key, **JSON}, timeout=60) as c:
        yield c


def result(http: httpx.Client, request_id: str, accept: str = "application/json", timeout_s: float = 120) -> httpx.Response:
    """Poll ``retrieve_future`` (long polls) until it answers something other than ``try_again``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        r = http.post("/retrieve_future", json={"request_id": request_id}, headers={"Accept": accept})
        assert r.status_code == 200, r.text
        if "json" not in r.headers["content-type"] or r.json().get("type") != "try_again":
            return r
    raise TimeoutError(request_id)


def ok(r: httpx.Response) -> dict:
    assert r.status_code == 200 and r.headers["content-type"].startswith("application/json"), (r.status_code, r.text)
    return r.json()


def datum(tokens=SEQ) -> dict:
    """A JSON Datum (the SDK's ``types.Datum`` field names): next-token targets, unit weights."""
    n = len(tokens) - 1
    return {"model_input": {"chunks": [{"type": "encoded_text", "tokens": list(tokens[:-1])}]},
            "loss_fn_inputs": {"target_tokens": {"data": list(tokens[1:]), "dtype": "int64", "shape": [n]},
                               "weights": {"data": [1.0] * n, "dtype": "float32", "shape": [n]}}}


@pytest.fixture(scope="module")
def run(http):
    """A session and a training run made with raw JSON: (session_id, model_id)."""
    session = ok(http.post("/create_session", json={"tags": ["raw"], "sdk_version": "curl"}))["session_id"]
    fut = ok(http.post("/create_model", json={"session_id": session, "model_seq_id": 0, "base_model": BASE_MODEL,
                                              "lora_config": {"rank": 4}}))
    assert ok(result(http, fut["request_id"]))["model_id"] == fut["model_id"]
    return session, fut["model_id"]


def test_session_routes(http, run):
    session, model_id = run
    assert ok(http.post("/client/config", json={"sdk_version": "curl"}))["pjwt_auth_enabled"] is False
    assert ok(http.post("/session_heartbeat", json={"session_id": session}))["type"] == "session_heartbeat"
    assert model_id in ok(http.get(f"/sessions/{session}"))["training_run_ids"]
    info = ok(http.post("/get_info", json={"model_id": model_id}))
    assert info["model_data"]["model_name"] == BASE_MODEL and info["lora_rank"] == 4


def test_training_routes_json_bodies_and_results(http, run):
    _, model_id = run
    # forward_backward with a JSON body (the SDK's JSON ForwardBackwardRequest), answered as JSON
    fb = ok(http.post("/forward_backward", json={"model_id": model_id, "seq_id": 1, "forward_backward_input": {
        "data": [datum()], "loss_fn": "cross_entropy"}}))
    out = ok(result(http, fb["request_id"]))
    assert out["metrics"]["loss:sum"] > 0 and out["loss_fn_output_type"]
    lp = out["loss_fn_outputs"][0]["logprobs"]
    assert lp["dtype"] == "float32" and lp["shape"] == [len(SEQ) - 1] and len(lp["data"]) == len(SEQ) - 1
    # the same result as protobuf when Accept asks for it (what the SDK sends)
    pb = result(http, fb["request_id"], accept="application/x-protobuf")
    assert pb.headers["content-type"] == "application/x-protobuf" and pb.content[:1] != b"{"
    step = ok(http.post("/optim_step", json={"model_id": model_id, "seq_id": 2,
                                             "adam_params": {"learning_rate": 1e-2}}))
    assert isinstance(ok(result(http, step["request_id"])), dict)
    # /forward with forward_input: the loss went down after the step
    fw = ok(http.post("/forward", json={"model_id": model_id, "seq_id": 3, "forward_input": {
        "data": [datum()], "loss_fn": "cross_entropy"}}))
    assert ok(result(http, fw["request_id"]))["metrics"]["loss:sum"] < out["metrics"]["loss:sum"]
    save = ok(http.post("/save_weights", json={"model_id": model_id, "seq_id": 4, "path": "raw-state"}))
    assert ok(result(http, save["request_id"]))["path"] == f"tinker://{model_id}/weights/raw-state"
    snap = ok(http.post("/save_weights_for_sampler", json={"model_id": model_id, "seq_id": 5, "path": "raw-snap"}))
    assert ok(result(http, snap["request_id"]))["path"] == f"tinker://{model_id}/sampler_weights/raw-snap"
    # a JSON body that names a bad field: 400 naming it under forward_backward_input
    bad = http.post("/forward_backward", json={"model_id": model_id, "seq_id": 6, "forward_backward_input": {
        "data": [datum(SEQ[:3]) | {"loss_fn_inputs": {"target_tokens": {"data": [1.5, 2], "dtype": "float32"}}}],
        "loss_fn": "cross_entropy"}})
    assert bad.status_code == 400 and bad.json()["field"].startswith("forward_backward_input.data[0]"), bad.text
    # the refused seq_id 6 was skipped: 7 runs
    fb = ok(http.post("/forward_backward", json={"model_id": model_id, "seq_id": 7, "forward_backward_input": {
        "data": [datum()], "loss_fn": "cross_entropy"}}))
    assert ok(result(http, fb["request_id"]))["metrics"]["loss:sum"] > 0


def test_sampling_routes_json_results(http, run):
    session, model_id = run
    path = f"tinker://{model_id}/sampler_weights/raw-snap"
    deadline = time.monotonic() + 120
    while http.post("/weights_info", json={"tinker_path": path}).status_code != 200:  # saved by the test above
        assert time.monotonic() < deadline
        time.sleep(0.5)
    sid = ok(http.post("/create_sampling_session", json={"session_id": session, "sampling_session_seq_id": 0,
                                                         "model_path": path}))["sampling_session_id"]
    assert ok(http.get(f"/samplers/{sid}"))["base_model"] == BASE_MODEL
    fut = ok(http.post("/asample", json={"sampling_session_id": sid, "seq_id": 0, "num_samples": 2,
                                         "prompt": {"chunks": [{"type": "encoded_text", "tokens": SEQ[:4]}]},
                                         "sampling_params": {"max_tokens": 3, "temperature": 1.0, "seed": 3},
                                         "prompt_logprobs": True, "topk_sample_logprobs": 2}))
    assert fut["sample_sequence_ids"] == [f"{fut['request_id']}:0", f"{fut['request_id']}:1"]
    out = ok(result(http, fut["request_id"]))
    assert out["type"] == "sample" and len(out["sequences"]) == 2
    assert [s["sequence_id"] for s in out["sequences"]] == fut["sample_sequence_ids"]
    for s in out["sequences"]:
        assert len(s["tokens"]) == len(s["logprobs"]) <= 3 and s["stop_reason"] in ("stop", "length")
        assert all(len(row) <= 2 for row in s["topk_logprobs"] if row is not None)
    assert out["prompt_logprobs"][0] is None and len(out["prompt_logprobs"]) == 4
    pb = result(http, fut["request_id"], accept="application/x-protobuf")
    assert pb.headers["content-type"] == "application/x-protobuf"


def test_rest_routes(http, run):
    _, model_id = run
    assert ok(http.get("/training_runs", params={"limit": 100}))["cursor"]["total_count"] >= 1
    assert ok(http.get(f"/training_runs/{model_id}"))["training_run_id"] == model_id
    ckpts = ok(http.get(f"/training_runs/{model_id}/checkpoints"))["checkpoints"]
    assert {"weights/raw-state", "sampler_weights/raw-snap"} <= {c["checkpoint_id"] for c in ckpts}
    info = ok(http.post("/weights_info", json={"tinker_path": f"tinker://{model_id}/weights/raw-state"}))
    assert info["base_model"] == BASE_MODEL and info["lora_rank"] == 4
    assert http.put(f"/training_runs/{model_id}/checkpoints/weights/raw-state/ttl",
                    json={"ttl_seconds": 7200}).status_code == 200
    assert ok(http.get("/get_server_capabilities"))["supported_models"]


def test_errors_and_try_again_are_json(http, run):
    _, model_id = run
    r = http.post("/retrieve_future", json={"request_id": "nope:train:0:1"})
    assert r.status_code == 404 and r.json()["field"] == "request_id"
    # a JSON route given another content type: 400 naming content-type
    r = http.post("/get_info", content=b'{"model_id": "x"}', headers={"Content-Type": "application/x-www-form-urlencoded"})
    assert r.status_code == 400 and r.json()["field"] == "content-type", r.text
    r = http.post("/forward_backward", content=b"x", headers={"Content-Type": "text/plain"})
    assert r.status_code == 400 and r.json()["field"] == "content-type", r.text


# ----------------------------------------------------------- requests without seq_id


def new_run(http, session: str, slot: int) -> str:
    fut = ok(http.post("/create_model", json={"session_id": session, "model_seq_id": slot, "base_model": BASE_MODEL,
                                              "lora_config": {"rank": 4, "seed": 1}}))
    ok(result(http, fut["request_id"]))
    return fut["model_id"]


def test_without_seq_id_the_gateway_numbers_a_run_in_arrival_order(http, run):
    session, numbered_by_client = run
    model_id = new_run(http, session, 10)
    body = {"model_id": model_id, "forward_backward_input": {"data": [datum()], "loss_fn": "cross_entropy"}}
    fb = ok(http.post("/forward_backward", json=body))
    step = ok(http.post("/optim_step", json={"model_id": model_id, "adam_params": {"learning_rate": 1e-2}}))
    fw = ok(http.post("/forward", json={"model_id": model_id, "forward_input": body["forward_backward_input"]}))
    save = ok(http.post("/save_weights", json={"model_id": model_id}))
    assert [f["request_id"] for f in (fb, step, fw, save)] == [f"{model_id}:{n}" for n in (1, 2, 3, 4)]
    before = ok(result(http, fb["request_id"]))["metrics"]["loss:sum"]
    assert ok(result(http, fw["request_id"]))["metrics"]["loss:sum"] < before  # the step ran in between
    assert ok(result(http, save["request_id"]))["path"] == f"tinker://{model_id}/weights/state-4"
    # a request refused at the edge takes no number; one refused after taking it (an in-place
    # load that is not the run's first request) has its number skipped: the next one runs
    bad = http.post("/optim_step", json={"model_id": model_id, "adam_params": {"learning_rate": -1}})
    assert bad.status_code == 400 and bad.json()["field"] == "adam_params.learning_rate"
    load = http.post("/load_weights", json={"model_id": model_id, "path": f"tinker://{model_id}/weights/state-4",
                                            "optimizer": False})
    assert load.status_code == 400 and load.json()["field"] == "seq_id" and "request 5" in load.text, load.text
    nxt = ok(http.post("/forward", json={"model_id": model_id, "forward_input": body["forward_backward_input"]}))
    assert nxt["request_id"] == f"{model_id}:6"
    assert ok(result(http, nxt["request_id"], timeout_s=60))["metrics"]["loss:sum"] > 0
    # one numbering per run: seq_id on this run, or none on a run whose client numbers it, is refused
    r = http.post("/optim_step", json={"model_id": model_id, "seq_id": 7, "adam_params": {}})
    assert r.status_code == 400 and r.json()["field"] == "seq_id" and "numbered by the gateway" in r.text, r.text
    r = http.post("/optim_step", json={"model_id": numbered_by_client, "adam_params": {}})
    assert r.status_code == 400 and r.json()["field"] == "seq_id" and "numbered by its client" in r.text, r.text
    # the refused explicit seq_id 7 was not skipped: the gateway's own 7 runs
    nxt = ok(http.post("/forward", json={"model_id": model_id, "forward_input": body["forward_backward_input"]}))
    assert nxt["request_id"] == f"{model_id}:7"
    assert ok(result(http, nxt["request_id"], timeout_s=60))["metrics"]["loss:sum"] > 0


def test_concurrent_requests_without_seq_id_get_distinct_numbers(http, run, stack, api_key):
    from concurrent.futures import ThreadPoolExecutor

    session, _ = run
    model_id = new_run(http, session, 11)
    body = {"model_id": model_id, "forward_input": {"data": [datum()], "loss_fn": "cross_entropy"}}

    def send(_):
        with httpx.Client(base_url=stack.base_url + "/api/v1", headers={"X-API-Key": api_key}, timeout=60) as c:
            return ok(c.post("/forward", json=body))["request_id"]

    with ThreadPoolExecutor(8) as pool:
        rids = list(pool.map(send, range(16)))
    assert sorted(rids, key=lambda r: int(r.rsplit(":", 1)[1])) == [f"{model_id}:{n}" for n in range(1, 17)]
    losses = {ok(result(http, rid))["metrics"]["loss:sum"] for rid in rids}  # no gap: every one runs
    assert len(losses) == 1  # forward only: the same weights each time


def test_protobuf_body_without_seq_id_is_numbered_too(http, run):
    from openrl.edge import proto
    import numpy as np

    session, _ = run
    model_id = new_run(http, session, 12)
    n = len(SEQ) - 1
    raw = proto.encode_forward_backward_request(model_id, 0, [proto.FwdBwdDatum(
        SEQ[:-1], {"target_tokens": np.array(SEQ[1:]), "weights": np.ones(n, np.float32)})], "cross_entropy")
    fb = ok(http.post("/forward_backward", content=raw, headers={"Content-Type": "application/x-protobuf"}))
    assert fb["request_id"] == f"{model_id}:1"
    assert ok(result(http, fb["request_id"]))["metrics"]["loss:sum"] > 0


def test_asample_without_seq_id_is_a_new_request_each_time(http, run):
    session, _ = run
    sid = ok(http.post("/create_sampling_session", json={"session_id": session, "sampling_session_seq_id": 5,
                                                         "base_model": BASE_MODEL}))["sampling_session_id"]
    req = {"sampling_session_id": sid, "prompt": {"chunks": [{"type": "encoded_text", "tokens": SEQ[:3]}]},
           "sampling_params": {"max_tokens": 2}}
    a, b = ok(http.post("/asample", json=req)), ok(http.post("/asample", json=req))
    assert a["request_id"] != b["request_id"] and all(r["request_id"].startswith(sid + ":") for r in (a, b))
    assert len(ok(result(http, b["request_id"]))["sequences"]) == 1


# ------------------------------------ docs/compatibility.md "Raw HTTP": the curl examples

DOC = Path(__file__).resolve().parents[2] / "docs" / "compatibility.md"


def doc_block() -> str:
    """The bash block of docs/compatibility.md's "## Raw HTTP" section."""
    text = DOC.read_text()
    section = text[text.index("\n## Raw HTTP\n"):]
    return section[section.index("```bash\n") + len("```bash\n"):section.index("\n```\n")]


def commands(block: str) -> list[str]:
    """The block's commands: comment lines dropped, lines joined while a quote is open or a line
    ends with a backslash (as bash reads them)."""
    out, cur = [], ""
    for line in block.splitlines():
        if not cur and (not line.strip() or line.lstrip().startswith("#")):
            continue
        cur = cur + "\n" + line if cur else line
        if cur.endswith("\\"):
            cur = cur[:-1]
            continue
        try:
            shlex.split(cur, comments=True)
        except ValueError:  # an open quote: the command goes on
            continue
        out.append(cur)
        cur = ""
    assert not cur, f"unterminated command: {cur!r}"
    return out


def replay(block: str, env: dict[str, str], send) -> list[list[str]]:
    """Run the block's commands: ``VAR=value`` (``URL`` and ``KEY`` come from ``env``),
    ``VAR=$(curl ... | jq -r .field)`` and ``curl ...``, with ``$VAR`` expanded as bash expands
    it in these commands; ``send(argv)`` performs one curl and returns its JSON answer. Returns
    every curl's argv."""
    env, argvs = dict(env), []
    for cmd in commands(block):
        m = re.fullmatch(r"(\w+)=(.*)", cmd, flags=re.S)
        if m and m.group(1) in ("URL", "KEY"):  # where the server is: the test's own
            continue
        target, jq_path = None, None
        if m:
            target, inner = m.group(1), m.group(2)
            sub = re.fullmatch(r"\$\((curl .*) \| jq -r \.([\w.]+)\)", inner.strip(), flags=re.S)
            assert sub, f"unsupported command substitution: {inner!r}"
            cmd, jq_path = sub.group(1), sub.group(2)
        expanded = re.sub(r"\$(\w+)", lambda v: env[v.group(1)], cmd)
        argv = shlex.split(expanded, comments=True)
        assert argv[0] == "curl", argv
        argvs.append(argv)
        answer = send(argv)
        if target is not None:
            value = answer
            for part in jq_path.split("."):
                value = value[part]
            env[target] = str(value)
    return argvs


def curl_to_httpx(argv: list[str]) -> tuple[str, str, dict, bytes | None]:
    """(method, url, headers, body) of the curl flags the examples use: -s, -H, -d, -X."""
    method, url, headers, body, i = None, None, {}, None, 1
    while i < len(argv):
        a = argv[i]
        if a == "-s":
            i += 1
        elif a in ("-H", "-d", "-X"):
            v = argv[i + 1]
            if a == "-H":
                k, _, hv = v.partition(":")
                headers[k.strip()] = hv.strip()
            elif a == "-d":
                body = v.encode()
            else:
                method = v
            i += 2
        else:
            assert url is None and a.startswith("http"), f"unexpected curl argument {a!r}"
            url, i = a, i + 1
    return method or ("POST" if body is not None else "GET"), url, headers, body


def test_compatibility_md_curl_examples_run(stack, api_key):
    block = doc_block()
    families = {"create_session", "create_model", "forward_backward", "retrieve_future", "asample",
                "save_weights", "save_weights_for_sampler", "optim_step"}
    answers: dict[str, list[dict]] = {}

    def send(argv):
        method, url, headers, body = curl_to_httpx(argv)
        route = url.rsplit("/api/v1/", 1)[1]
        deadline = time.monotonic() + 180
        while True:
            r = httpx.request(method, url, headers=headers, content=body, timeout=60)
            assert r.status_code == 200 and r.headers["content-type"].startswith("application/json"), \
                (route, r.status_code, r.text)
            out = r.json()
            if route != "retrieve_future" or out.get("type") != "try_again":
                break
            assert time.monotonic() < deadline, argv  # as the doc says: repeat on try_again
        assert "error" not in out, (route, out)
        answers.setdefault(route, []).append(out)
        return out

    argvs = replay(block, {"URL": stack.base_url, "KEY": api_key}, send)
    assert families <= set(answers), sorted(answers)
    fb, save, sample = answers["retrieve_future"]
    assert fb["metrics"]["loss:sum"] > 0 and fb["loss_fn_outputs"][0]["logprobs"]["shape"] == [5]
    assert save["path"].endswith("/sampler_weights/step-1")
    assert len(sample["sequences"]) == 2 and all(0 < len(s["tokens"]) <= 8 for s in sample["sequences"])
    # bash reads the block as this test does: the same argv for every curl (curl and jq stubbed)
    if shutil.which("bash") is None:
        pytest.skip("no bash to compare the parse with")
    stub = ('curl() { printf "%s\\037" "$@" >> "$ARGV_LOG"; printf "\\036" >> "$ARGV_LOG"; '
            "echo '{\"session_id\": \"S\", \"model_id\": \"M\", \"request_id\": \"R\"}'; }\n"
            "jq() { python3 -c 'import json,sys; print(json.load(sys.stdin)[sys.argv[1][1:]])' \"$2\"; }\n")
    lines = [ln for ln in block.splitlines() if not re.match(r"(URL|KEY)=", ln)]
    with tempfile.NamedTemporaryFile("r") as log:
        r = subprocess.run(["bash", "-euo", "pipefail", "-c", stub + "\n".join(lines)], capture_output=True, text=True,
                           env={**os.environ, "URL": "http://h", "KEY": "k", "ARGV_LOG": log.name}, timeout=60)
        assert r.returncode == 0, r.stderr
        by_bash = [rec.split("\x1f")[:-1] for rec in log.read().split("\x1e")[:-1]]
    canned = {"session_id": "S", "model_id": "M", "request_id": "R"}
    by_test = replay(block, {"URL": "http://h", "KEY": "k"}, lambda argv: canned)
    assert [a[1:] for a in by_test] == by_bash
    assert len(argvs) == len(by_bash)


def test_session_search_reasons_filter(http):
    """``statuses: [{"type": "client_finished", "reasons": [...]}]`` filters by the finish reason
    (the key was dropped before unknown keys were refused)."""
    sid = ok(http.post("/create_session", json={"display_name": "reasons-filter"}))["session_id"]
    assert http.post(f"/sessions/{sid}/finish", json={"reason": {"type": "errored"}}).status_code == 200

    def found(reasons):
        q = {"type": "client_finished", **({"reasons": reasons} if reasons else {})}
        out = ok(http.post("/sessions/search", json={"session_id": sid, "statuses": [q]}))
        return [s["session_id"] for s in out["sessions"]]

    assert found(None) == [sid] and found(["errored", "interrupted"]) == [sid] and found(["success"]) == []
    r = http.post("/sessions/search", json={"owner": {"type": "own", "owner_urns": ["x"]}, "colour": 1})
    assert r.status_code == 400 and r.json()["field"] == "colour"
