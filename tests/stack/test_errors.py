"""Bad input at the edge (invariant 5): every row of docs/errors.md is a case here.

Each case sends one bad request to the embedded stack of ``keyed_stack`` (real gateway,
NATS JetStream, trainer and sampler processes) through the real ``tinker`` SDK where the SDK
can send it, or as raw HTTP with a valid key where the SDK refuses to build the request, and
checks the answer: a 4xx whose JSON body names the field, or a failed future with category
"user" naming it. Meanwhile a healthy run of another key trains and samples in a background
thread; at the end it must have kept working, the run that took the rejections must still
train, and no worker process may have died.
"""

from __future__ import annotations

import re
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import httpx
import numpy as np
import pytest
import tinker
from tinker import types

from conftest import BASE_MODEL
from fixtures_keys import GAP_TIMEOUT_S, MAX_BODY_BYTES
from openrl.edge import proto

DOC = Path(__file__).resolve().parents[2] / "docs" / "errors.md"
CONTEXT = 4096  # max_context_length of the built model in openrl/data/models.toml
PB = {"Content-Type": "application/x-protobuf"}


def datum(tokens: list[int], **inputs) -> types.Datum:
    fn_inputs = {"target_tokens": tokens[1:], **inputs}
    if "weights" not in fn_inputs and not ({"advantages", "logprobs"} & set(inputs)):
        fn_inputs["weights"] = [1.0] * (len(tokens) - 1)
    return types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]), loss_fn_inputs=fn_inputs)


def fb_body(model_id: str, seq_id: int, tokens=(1, 2, 3), loss_fn="cross_entropy", **inputs) -> bytes:
    """A ForwardBackwardRequest as the SDK encodes it (openrl.edge.proto's encoder)."""
    n = len(tokens)
    li = {"target_tokens": np.arange(2, 2 + n), "weights": np.ones(n, np.float32), **inputs}
    return proto.encode_forward_backward_request(model_id, seq_id, [proto.FwdBwdDatum(list(tokens), li)], loss_fn)


def wait_future(http: httpx.Client, request_id: str, timeout_s: float = 120) -> httpx.Response:
    """Poll ``retrieve_future`` until the future is answered."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        r = http.post("/retrieve_future", json={"request_id": request_id}, timeout=60)
        if not (r.headers.get("content-type", "").startswith("application/json") and r.json().get("type") == "try_again"):
            return r
    raise TimeoutError(request_id)


@dataclass
class Ctx:
    stack: Any
    keys: Any
    svc: tinker.ServiceClient
    tc: Any  # TrainingClient of key "user": SDK training cases
    sampler: Any  # its SamplingClient
    state: str  # a saved state of key "user"
    other_state: str  # a saved state of key "other"
    other_sampler_path: str
    http: httpx.Client  # raw, key "user"
    other_http: httpx.Client  # raw, key "other"
    run: str  # a run of key "user" driven only by raw requests
    session: str
    seq: int = 0
    healthy: dict = field(default_factory=dict)

    def next_seq(self) -> int:
        """The raw run's next seq_id (every rejected one is skipped by the gateway)."""
        self.seq += 1
        return self.seq


def _healthy_loop(stack, key: str, stop: threading.Event, out: dict) -> None:
    """Another key's run: forward_backward + optim_step, and a sample every 3 steps."""
    try:
        svc = tinker.ServiceClient(base_url=stack.base_url, api_key=key)
        tc = svc.create_lora_training_client(base_model=BASE_MODEL, rank=4, seed=3).result()
        d = datum([5, 6, 7, 8, 9, 10])
        while not stop.is_set():
            fb = tc.forward_backward([d], "cross_entropy")
            tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
            out.setdefault("losses", []).append(fb.result().metrics["loss:sum"])
            if len(out["losses"]) % 3 == 1:
                sc = tc.save_weights_and_get_sampling_client()
                s = sc.sample(types.ModelInput.from_ints([5, 6]), 1, types.SamplingParams(max_tokens=2)).result()
                out.setdefault("samples", []).append(list(s.sequences[0].tokens))
            stop.wait(0.3)
    except Exception as exc:  # noqa: BLE001 - reported by test_healthy_run_kept_working
        out["error"] = repr(exc)


@pytest.fixture(scope="module")
def ctx(keyed_stack, keys):
    stop = threading.Event()
    healthy: dict = {}
    t = threading.Thread(target=_healthy_loop, args=(keyed_stack, keys.other, stop, healthy), daemon=True)
    t.start()
    svc = tinker.ServiceClient(base_url=keyed_stack.base_url, api_key=keys.user)
    tc = svc.create_lora_training_client(base_model=BASE_MODEL, rank=4, seed=0).result()
    state = tc.save_state("errs").result().path
    sampler = tc.save_weights_and_get_sampling_client().result()
    other = tinker.ServiceClient(base_url=keyed_stack.base_url, api_key=keys.other)
    otc = other.create_lora_training_client(base_model=BASE_MODEL, rank=4).result()
    other_state = otc.save_state("theirs").result().path
    other_sampler_path = otc.save_weights_for_sampler("theirs-s").result().path
    api = keyed_stack.base_url + "/api/v1"
    http = httpx.Client(base_url=api, headers={"X-API-Key": keys.user}, timeout=60)
    other_http = httpx.Client(base_url=api, headers={"X-API-Key": keys.other}, timeout=60)
    session = http.post("/create_session", json={}).json()["session_id"]
    r = http.post("/create_model", json={"session_id": session, "model_seq_id": 0, "base_model": BASE_MODEL,
                                         "lora_config": {"rank": 4}})
    assert r.status_code == 200, r.text
    assert wait_future(http, r.json()["request_id"]).status_code == 200
    c = Ctx(keyed_stack, keys, svc, tc, sampler, state, other_state, other_sampler_path, http, other_http,
            r.json()["model_id"], session, healthy=healthy)
    yield c
    stop.set()
    t.join(timeout=120)
    http.close()
    other_http.close()


# ----- the cases ---------------------------------------------------------------------------


@dataclass
class Expect:
    kind: str  # "http": a 4xx response; "sdk": an SDK exception; "future": a failed future (category user)
    status: int | type | None
    field: str  # must appear in the body's "field" (http) or in the error message


CASES: dict[str, tuple[Callable[[Ctx], Any], Expect]] = {}


def case(cid: str, kind: str, status, fld: str):
    def deco(fn):
        CASES[cid] = (fn, Expect(kind, status, fld))
        return fn
    return deco


# auth and isolation
@case("no-api-key", "http", 401, "X-API-Key")
def _(c):
    return httpx.post(c.stack.base_url + "/api/v1/create_session", json={})


@case("unknown-api-key", "sdk", tinker.AuthenticationError, "invalid API key")
def _(c):
    tinker.ServiceClient(base_url=c.stack.base_url, api_key="tml-never-configured-0000").create_lora_training_client(
        base_model=BASE_MODEL).result()


@case("other-key-reads-run", "sdk", tinker.NotFoundError, "training_run_id")
def _(c):
    tinker.RestClient(base_url=c.stack.base_url, api_key=c.keys.other).get_training_run(c.tc.model_id).result()


@case("other-key-samples-snapshot", "sdk", tinker.NotFoundError, "model_path")
def _(c):
    c.svc.create_sampling_client(model_path=c.other_sampler_path).result()


@case("other-key-loads-state", "sdk", tinker.NotFoundError, "path")
def _(c):
    c.svc.create_training_client_from_state(c.other_state).result()


@case("other-key-future", "http", 404, "request_id")
def _(c):
    return c.other_http.post("/retrieve_future", json={"request_id": f"{c.run}:0"})


@case("other-key-trains-run", "http", 404, "model_id")
def _(c):
    return c.other_http.post("/forward_backward", content=fb_body(c.run, 1), headers=PB)


# bodies
@case("malformed-json", "http", 400, "body")
def _(c):
    return c.http.post("/create_session", content=b'{"tags": [', headers={"Content-Type": "application/json"})


@case("json-not-an-object", "http", 400, "body")
def _(c):
    return c.http.post("/create_session", content=b"[1, 2]", headers={"Content-Type": "application/json"})


@case("wrong-json-type", "http", 400, "model_seq_id")
def _(c):
    return c.http.post("/create_model", json={"session_id": c.session, "model_seq_id": "zero", "base_model": BASE_MODEL})


@case("oversized-body", "http", 413, "body")
def _(c):
    return c.http.post("/create_session", json={"tags": ["x" * (MAX_BODY_BYTES + 1)]})


@case("zstd-bomb", "http", 413, "body")
def _(c):
    import zstandard

    bomb = zstandard.ZstdCompressor().compress(b"\0" * (MAX_BODY_BYTES * 2))
    assert len(bomb) < 10_000
    return c.http.post("/forward_backward", content=bomb, headers={**PB, "Content-Encoding": "zstd"})


@case("oversized-forward-backward", "http", 413, "body")
def _(c):
    n = 600_000  # ~4.8 MB of tokens, targets and weights: over the 2 MiB cap; its seq_id is skipped
    body = fb_body(c.run, c.next_seq(), tokens=[1] * n, target_tokens=np.ones(n, np.int64))
    assert len(body) > MAX_BODY_BYTES
    return c.http.post("/forward_backward", content=body, headers=PB)


@case("zstd-forward-backward-over-the-cap", "http", 413, "body")
def _(c):
    import zstandard

    n = 600_000
    body = fb_body(c.run, c.next_seq(), tokens=[1] * n, target_tokens=np.ones(n, np.int64))
    small = zstandard.ZstdCompressor().compress(body)
    assert len(small) < MAX_BODY_BYTES < len(body)
    return c.http.post("/forward_backward", content=small, headers={**PB, "Content-Encoding": "zstd"})


@case("unsupported-content-encoding", "http", 400, "Content-Encoding")
def _(c):
    return c.http.post("/forward_backward", content=fb_body(c.run, c.seq + 1), headers={**PB, "Content-Encoding": "br"})


@case("malformed-protobuf", "http", 400, "body")
def _(c):
    return c.http.post("/forward_backward", content=b"\xff\xff\xff\xff not protobuf", headers=PB)


@case("text-to-forward-backward", "http", 400, "content-type")
def _(c):
    return c.http.post("/forward_backward", content=b"model_id=x", headers={"Content-Type": "text/plain"})


@case("json-forward-backward-without-input", "http", 400, "forward_backward_input")
def _(c):
    return c.http.post("/forward_backward", json={"model_id": c.run, "seq_id": c.next_seq()})


# ids
@case("unknown-base-model", "sdk", tinker.BadRequestError, "base_model")
def _(c):
    c.svc.create_lora_training_client(base_model="nope/no-such-model", rank=4).result()


@case("lora-rank-zero", "sdk", tinker.BadRequestError, "lora_config.rank")
def _(c):
    c.svc.create_lora_training_client(base_model=BASE_MODEL, rank=0).result()


@case("unknown-session", "http", 404, "session_id")
def _(c):
    return c.http.post("/create_model", json={"session_id": "no-such-session", "model_seq_id": 0, "base_model": BASE_MODEL})


@case("unknown-model", "http", 404, "model_id")
def _(c):
    return c.http.post("/forward_backward", content=fb_body("nope:train:0", 1), headers=PB)


@case("unknown-sampling-session", "http", 404, "sampling_session_id")
def _(c):
    return c.http.post("/asample", json={"sampling_session_id": "nope:sample:0", "seq_id": 0,
                                         "prompt": {"chunks": [{"tokens": [1, 2]}]}})


@case("unknown-future", "http", 404, "request_id")
def _(c):
    return c.http.post("/retrieve_future", json={"request_id": "nope:train:0:1"})


# forward_backward data
@case("token-outside-vocabulary", "sdk", tinker.BadRequestError, r"data\[0\]\.model_input")
def _(c):
    c.tc.forward_backward([datum([1, 10**7, 3])], "cross_entropy").result()


@case("target-outside-vocabulary", "http", 400, "data[0].loss_fn_inputs.target_tokens")
def _(c):
    return c.http.post("/forward_backward", headers=PB, content=fb_body(
        c.run, c.next_seq(), target_tokens=np.array([1, 2, 10**8])))


@case("longer-than-context", "sdk", tinker.BadRequestError, "context of 4096")
def _(c):
    c.tc.forward_backward([datum(list(range(1, CONTEXT + 3)))], "cross_entropy").result()


@case("target-length-mismatch", "sdk", tinker.BadRequestError, "target_tokens")
def _(c):
    bad = types.Datum(model_input=types.ModelInput.from_ints([1, 2, 3, 4]),
                      loss_fn_inputs={"target_tokens": [2, 3], "weights": [1.0, 1.0, 1.0, 1.0]})
    c.tc.forward_backward([bad], "cross_entropy").result()


@case("weights-shape-mismatch", "sdk", tinker.BadRequestError, r"loss_fn_inputs\.weights")
def _(c):
    bad = types.Datum(model_input=types.ModelInput.from_ints([1, 2, 3]),
                      loss_fn_inputs={"target_tokens": [2, 3, 4], "weights": [1.0]})
    c.tc.forward_backward([bad], "cross_entropy").result()


@case("float-target-tokens", "http", 400, "data[0].loss_fn_inputs.target_tokens")
def _(c):
    return c.http.post("/forward_backward", headers=PB, content=fb_body(
        c.run, c.next_seq(), target_tokens=np.array([2.0, 3.0, 4.0], np.float32)))


@case("unknown-dtype", "http", 400, "data[0].loss_fn_inputs.weights")
def _(c):
    msg = proto.ForwardBackwardRequest.FromString(fb_body(c.run, c.next_seq()))
    msg.data[0].loss_fn_inputs["weights"].dtype = 4 + 10  # not a DType value
    return c.http.post("/forward_backward", headers=PB, content=msg.SerializeToString())


@case("unknown-protobuf-field", "http", 400, "data[0].#9")
def _(c):
    msg = proto.ForwardBackwardRequest.FromString(fb_body(c.run, c.next_seq()))
    d = proto.Datum.FromString(msg.data[0].SerializeToString() + bytes([(9 << 3) | 0, 1]))  # field 9: none
    msg.data[0].CopyFrom(d)
    return c.http.post("/forward_backward", headers=PB, content=msg.SerializeToString())


@case("unknown-json-field", "http", 400, "prompt.tokens")
def _(c):
    # a prompt written {"tokens": [...]} instead of {"chunks": [{"type": "encoded_text", "tokens": [...]}]}
    return c.http.post("/asample", json={"sampling_session_id": c.sampler._sampling_session_id, "seq_id": 10**6,
                                         "prompt": {"tokens": [1, 2]}, "sampling_params": {"max_tokens": 1}})


@case("bad-sparse-indices", "http", 400, "data[0].loss_fn_inputs.weights")
def _(c):
    msg = proto.ForwardBackwardRequest.FromString(fb_body(c.run, c.next_seq()))
    t = msg.data[0].loss_fn_inputs["weights"]
    t.Clear()
    t.dtype, t.shape[:] = 1, [3, 2]
    t.sparse_csr.values = np.ones(2, "<f4").tobytes()
    t.sparse_csr.crow_indices = np.array([0, 1, 9, 2], "<i8").tobytes()
    t.sparse_csr.col_indices = np.array([0, 1], "<i8").tobytes()
    return c.http.post("/forward_backward", headers=PB, content=msg.SerializeToString())


@case("empty-data", "http", 400, "data")
def _(c):
    return c.http.post("/forward_backward", headers=PB, content=proto.encode_forward_backward_request(
        c.run, c.next_seq(), [], "cross_entropy"))


@case("nan-advantages", "sdk", tinker.BadRequestError, r"loss_fn_inputs\.advantages")
def _(c):
    d = datum([1, 2, 3, 4], logprobs=[-1.0, -1.0, -1.0], advantages=[0.5, float("nan"), 0.5])
    c.tc.forward_backward([d], "importance_sampling").result()


@case("unknown-loss-input", "sdk", tinker.BadRequestError, r"loss_fn_inputs\.mask")
def _(c):
    # a key no loss knows (the cookbook's client-side "mask"); known keys a loss does not read are
    # accepted (tests/stack/test_hosted_compat.py)
    d = datum([1, 2, 3, 4], logprobs=[-1.0, -1.0, -1.0], advantages=[0.5, 0.5, 0.5], mask=np.ones(3, np.float32))
    c.tc.forward_backward([d], "importance_sampling").result()


@case("unknown-loss-fn", "future", "user", "loss_fn")
def _(c):
    c.tc.forward_backward([datum([1, 2, 3])], "no_such_loss").result()


@case("unknown-loss-fn-config-key", "future", "user", "loss_fn_config.temperature")
def _(c):
    c.tc.forward_backward([datum([1, 2, 3], logprobs=[-1.0, -1.0], advantages=[1.0, 1.0])], "ppo",
                          loss_fn_config={"temperature": 1.0}).result()


@case("missing-loss-input", "future", "user", "loss_fn_inputs.advantages")
def _(c):
    c.tc.forward_backward([datum([1, 2, 3], logprobs=[-1.0, -1.0])], "importance_sampling").result()


@case("seq-id-far-ahead", "future", "user", "seq_id")
def _(c):
    return c.http.post("/forward_backward", headers=PB, content=fb_body(c.run, c.seq + 1 + 50_000))


# optimizer and checkpoints
@case("nan-learning-rate", "sdk", tinker.BadRequestError, "learning_rate")
def _(c):
    c.tc.optim_step(types.AdamParams(learning_rate=float("nan"))).result()


@case("negative-learning-rate", "sdk", tinker.BadRequestError, "learning_rate")
def _(c):
    c.tc.optim_step(types.AdamParams(learning_rate=-1e-3)).result()


@case("missing-seq-id", "http", 400, "seq_id")
def _(c):
    return c.http.post("/optim_step", json={"model_id": c.run, "adam_params": {"learning_rate": 1e-3}})


@case("seq-id-zero", "http", 400, "seq_id")
def _(c):
    return c.http.post("/optim_step", json={"model_id": c.run, "seq_id": 0, "adam_params": {"learning_rate": 1e-3}})


@case("checkpoint-name-traversal", "sdk", tinker.BadRequestError, "path")
def _(c):
    c.tc.save_state("../../etc").result()


@case("tinker-path-dotdot", "sdk", tinker.BadRequestError, "path")
def _(c):
    c.svc.create_training_client_from_state(f"tinker://{c.tc.model_id}/weights/..").result()


@case("not-a-tinker-path", "http", 400, "tinker_path")
def _(c):
    return c.http.post("/weights_info", json={"tinker_path": "file:///etc/passwd"})


# sampling
@case("num-samples-over-limit", "sdk", tinker.BadRequestError, "num_samples")
def _(c):
    c.sampler.sample(types.ModelInput.from_ints([1, 2]), 129, types.SamplingParams(max_tokens=1)).result()


@case("max-tokens-over-limit", "sdk", tinker.BadRequestError, "max_tokens")
def _(c):
    c.sampler.sample(types.ModelInput.from_ints([1, 2]), 1, types.SamplingParams(max_tokens=10**6)).result()


@case("prompt-plus-max-tokens-over-context", "sdk", tinker.BadRequestError, "sampling_params.max_tokens")
def _(c):
    c.sampler.sample(types.ModelInput.from_ints([1] * 4000), 1, types.SamplingParams(max_tokens=200)).result()


@case("prompt-longer-than-context", "sdk", tinker.BadRequestError, "prompt")
def _(c):
    c.sampler.sample(types.ModelInput.from_ints([1] * (CONTEXT + 1)), 1, types.SamplingParams(max_tokens=1)).result()


@case("prompt-outside-vocabulary", "sdk", tinker.BadRequestError, "prompt")
def _(c):
    c.sampler.sample(types.ModelInput.from_ints([1, 10**7]), 1, types.SamplingParams(max_tokens=1)).result()


@case("negative-temperature", "sdk", tinker.BadRequestError, "temperature")
def _(c):
    c.sampler.sample(types.ModelInput.from_ints([1, 2]), 1, types.SamplingParams(max_tokens=1, temperature=-1)).result()


@case("top-p-over-one", "sdk", tinker.BadRequestError, "top_p")
def _(c):
    c.sampler.sample(types.ModelInput.from_ints([1, 2]), 1, types.SamplingParams(max_tokens=1, top_p=2.0)).result()


@case("image-chunk", "sdk", tinker.BadRequestError, r"prompt\.chunks\[0\]")
def _(c):
    c.sampler.sample(types.ModelInput(chunks=[types.ImageChunk(data=b"\x89PNG", format="png", expected_tokens=4)]),
                     1, types.SamplingParams(max_tokens=1)).result()


@case("topk-too-wide", "future", "user", "topk_sample_logprobs")
def _(c):
    c.sampler.sample(types.ModelInput.from_ints([1, 2]), 1, types.SamplingParams(max_tokens=1),
                     topk_sample_logprobs=1000).result()


@case("negative-sample-seq-id", "http", 400, "seq_id")
def _(c):
    sid = c.sampler._sampling_session_id
    return c.http.post("/asample", json={"sampling_session_id": sid, "seq_id": -1,
                                         "prompt": {"chunks": [{"tokens": [1]}]}})


@dataclass(frozen=True)
class Promise:
    """What a row's "response" column of docs/errors.md promises."""

    status: int | None  # the HTTP status; None for a failed future
    fields: tuple[str, ...]  # the field named (any one of them); empty when the row names none


def doc_promises() -> dict[str, Promise]:
    """Each row of docs/errors.md's table: ``id -> Promise`` parsed from its response column
    ("400, field `x`", "404, field `a` / `b`", "failed future, category user, `x`",
    "401 `AuthenticationError` (...)": a status and no field)."""
    out = {}
    for cid, resp in re.findall(r"^\| `([a-z0-9-]+)` \|[^|]*\|[^|]*\| (.*) \|$", DOC.read_text(), flags=re.M):
        if resp.startswith("failed future"):
            out[cid] = Promise(None, tuple(re.findall(r"`([^`]+)`", resp)[-1:]))
            continue
        status = re.match(r"(\d{3})", resp)
        named = re.search(r"field ((?:`[^`]+`(?: / )?)+)", resp)
        out[cid] = Promise(int(status.group(1)) if status else None,
                           tuple(re.findall(r"`([^`]+)`", named.group(1))) if named else ())
    return out


PROMISES = doc_promises()


def _keeps_promise(cid: str, status: int | None, body: dict | None, error: str | None) -> None:
    """The answer has the status and names the field that docs/errors.md's row promises: the
    4xx body's ``field`` exactly, or the failed future's error starting with ``<field>:``."""
    p = PROMISES[cid]
    assert status == p.status, (cid, status, p)
    if not p.fields:
        return
    if p.status is None:
        assert error is not None and any(error.startswith(f + ":") for f in p.fields), (cid, error, p)
    else:
        assert isinstance(body, dict) and body.get("field") in p.fields and body.get("category") == "user", \
            (cid, body, p)


def _check(c: Ctx, cid: str, expect: Expect, fn) -> None:
    if expect.kind == "sdk":
        with pytest.raises(expect.status, match=expect.field) as ei:
            fn(c)
        _keeps_promise(cid, ei.value.status_code, ei.value.body, None)
    elif expect.kind == "http":
        r = fn(c)
        assert r.status_code == expect.status, r.text
        body = r.json()
        assert body["detail"] and expect.field in body["field"], body
        _keeps_promise(cid, r.status_code, body, None)
    else:
        try:
            r = fn(c)
        except tinker.RequestFailedError as exc:
            assert exc.category == "user" and expect.field in str(exc), exc
            _keeps_promise(cid, None, None, _future_error(exc))
            return
        assert isinstance(r, httpx.Response) and r.status_code == 200, getattr(r, "text", r)
        out = wait_future(c.http, r.json()["request_id"]).json()
        assert out["category"] == "user" and expect.field in out["error"], out
        _keeps_promise(cid, None, None, out["error"])


def _future_error(exc: "tinker.RequestFailedError") -> str:
    """The ``error`` string of the failed future behind an SDK ``RequestFailedError`` (the SDK
    words it "Request failed: <error> for self.request_id=...")."""
    msg = exc.message
    return msg[len("Request failed: "):].split(" for self.request_id=", 1)[0] if msg.startswith("Request failed: ") else msg


@pytest.mark.parametrize("cid", list(CASES))
def test_bad_input(ctx, cid):
    fn, expect = CASES[cid]
    _check(ctx, cid, expect, fn)


def test_doc_promises_parse_every_row():
    """Every case's row promises a status or a failed future, and all but the auth row a field."""
    assert set(CASES) <= set(PROMISES)
    assert all(PROMISES[c].fields for c in CASES if c != "unknown-api-key"), \
        [c for c in CASES if not PROMISES[c].fields]
    assert PROMISES["token-outside-vocabulary"] == Promise(400, ("data[0].model_input",))
    assert PROMISES["tinker-path-dotdot"] == Promise(400, ("tinker_path", "path"))
    assert PROMISES["missing-loss-input"] == Promise(None, ("data[0].loss_fn_inputs.advantages",))


# ----- not one request: timeouts, and what must still work afterwards ------------------


def test_seq_gap_timeout_fails_the_waiting_request(ctx):
    """A seq_id whose predecessor never arrives fails after OPENRL_SEQ_GAP_TIMEOUT_S with
    category "user" naming seq_id; the predecessor still runs when it comes."""
    h = ctx.http
    r = h.post("/create_model", json={"session_id": ctx.session, "model_seq_id": 1, "base_model": BASE_MODEL,
                                      "lora_config": {"rank": 4}})
    run = r.json()["model_id"]
    assert wait_future(h, r.json()["request_id"]).status_code == 200
    t0 = time.monotonic()
    late = h.post("/forward_backward", content=fb_body(run, 2), headers=PB)
    assert late.status_code == 200, late.text
    out = wait_future(h, late.json()["request_id"]).json()
    waited = time.monotonic() - t0
    assert out["category"] == "user" and "seq_id" in out["error"] and "never arrived" in out["error"], out
    assert GAP_TIMEOUT_S - 0.5 <= waited < GAP_TIMEOUT_S + 30, waited
    first = h.post("/forward_backward", content=fb_body(run, 1), headers=PB)
    res = wait_future(h, first.json()["request_id"])  # answered as JSON: no Accept for protobuf
    assert res.headers["content-type"] == "application/json" and "loss:sum" in res.json()["metrics"], res.text


def test_raw_run_still_trains_after_every_rejection(ctx):
    """Every rejected seq_id of the raw run was skipped at the edge: the next one runs and
    returns a loss. (Had one not been skipped, this request would wait for the missing seq_id
    and fail after the gap timeout with a JSON error, category "user", instead.)"""
    r = ctx.http.post("/forward_backward", content=fb_body(ctx.run, ctx.next_seq()), headers=PB)
    assert r.status_code == 200, r.text
    res = wait_future(ctx.http, r.json()["request_id"])
    assert res.headers["content-type"] == "application/json" and "loss:sum" in res.json()["metrics"], res.text
    assert ctx.seq > 5  # the cases above did consume seq_ids of this run


def test_sdk_run_still_trains_and_samples(ctx):
    fb = ctx.tc.forward_backward([datum([1, 2, 3, 4])], "cross_entropy")
    ctx.tc.optim_step(types.AdamParams(learning_rate=1e-3)).result()
    assert np.isfinite(fb.result().metrics["loss:sum"])
    out = ctx.sampler.sample(types.ModelInput.from_ints([1, 2]), 2, types.SamplingParams(max_tokens=2)).result()
    assert len(out.sequences) == 2


def test_healthy_run_kept_working_and_no_worker_died(ctx):
    deadline = time.monotonic() + 60
    while len(ctx.healthy.get("losses", [])) < 4 and "error" not in ctx.healthy and time.monotonic() < deadline:
        time.sleep(0.5)
    assert "error" not in ctx.healthy, ctx.healthy["error"]
    losses = ctx.healthy.get("losses", [])
    assert len(losses) >= 4 and all(np.isfinite(losses)), losses
    # it learned its one example (Adam at lr 1e-2 may overshoot later, so not the last step)
    assert min(losses[1:]) < losses[0], losses
    assert ctx.healthy.get("samples")
    assert all(p.poll() is None for p in ctx.stack.procs), [(p.args[:3], p.returncode) for p in ctx.stack.procs]


# Rows of docs/errors.md that are tests of their own rather than CASES entries.
OTHER_ROWS = {
    "seq-gap": "tests/stack/test_errors.py::test_seq_gap_timeout_fails_the_waiting_request",
    "queue-full": "tests/stack/test_load.py::test_full_queue_answers_429_with_retry_after",
    "quota-runs": "tests/stack/test_fair_share.py::test_per_key_quotas_answer_429_with_retry_after",
    "quota-tokens-per-min": "tests/stack/test_fair_share.py::test_per_key_quotas_answer_429_with_retry_after",
    "quota-stored-bytes": "tests/stack/test_fair_share.py::test_per_key_quotas_answer_429_with_retry_after",
}


def test_docs_table_lists_every_case():
    """docs/errors.md and the cases here are the same set (at least 30 rows)."""
    ids = re.findall(r"^\| `([a-z0-9-]+)` \|", DOC.read_text(), flags=re.M)
    assert len(ids) == len(set(ids)) >= 30
    assert set(ids) == set(CASES) | set(OTHER_ROWS)
    root = DOC.parents[1]
    for ref in OTHER_ROWS.values():
        path, name = ref.split("::")
        assert f"def {name}(" in (root / path).read_text(), ref
