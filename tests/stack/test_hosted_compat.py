"""What users copy from hosted Tinker works here (issue 24): datums that carry inputs their loss
does not read, and the smaller divergences other projects' Tinker suites found.

Everything runs through the unmodified ``tinker`` SDK (or raw HTTP where the SDK cannot send
the request) against the session's embedded ``stack`` (real gateway, NATS JetStream, trainer
and sampler processes).
"""

from __future__ import annotations

import numpy as np
import pytest
import tinker
from tinker import types

from conftest import BASE_MODEL

SEQ = [9707, 1879, 11, 419, 374, 264, 1273, 315, 279, 11691, 9128, 13]


@pytest.fixture(scope="module")
def svc(stack, api_key):
    return tinker.ServiceClient(base_url=stack.base_url, api_key=api_key)


@pytest.fixture(scope="module")
def tc(svc):
    return svc.create_lora_training_client(base_model=BASE_MODEL, rank=4, seed=0).result()


def _datum(**inputs) -> types.Datum:
    """One datum of SEQ (inputs SEQ[:-1], targets SEQ[1:]) with ``inputs`` as float32 lists."""
    n = len(SEQ) - 1
    fn_inputs = {"target_tokens": types.TensorData(data=SEQ[1:], dtype="int64", shape=[n])}
    for key, values in inputs.items():
        fn_inputs[key] = types.TensorData(data=[float(v) for v in values], dtype="float32", shape=[n])
    return types.Datum(model_input=types.ModelInput.from_ints(SEQ[:-1]), loss_fn_inputs=fn_inputs)


# ------------------------------------------------ item 1: inputs a loss does not read


def test_cross_entropy_datum_with_rl_fields_as_hosted_tinker_tests_send_it(tc):
    # cooperbench/hosted_tinker's make_cross_entropy_datum: weights plus zero logprobs and
    # advantages, sent to the official API in its reference tests; cross_entropy reads only
    # target_tokens and weights
    n = len(SEQ) - 1
    w = [0.0] * 3 + [1.0] * (n - 3)
    plain = tc.forward([_datum(weights=w)], "cross_entropy").result()
    extra = tc.forward([_datum(weights=w, logprobs=[0.0] * n, advantages=[0.0] * n)], "cross_entropy").result()
    assert extra.metrics["loss:sum"] == plain.metrics["loss:sum"] > 0
    np.testing.assert_array_equal(extra.loss_fn_outputs[0]["logprobs"].to_numpy(),
                                  plain.loss_fn_outputs[0]["logprobs"].to_numpy())


@pytest.mark.parametrize("loss_fn", ["importance_sampling", "ppo"])
def test_rl_datum_with_weights_as_the_losses_page_shows_it(tc, loss_fn):
    # Tinker's losses page builds the RL datum with target_tokens, weights, logprobs and
    # advantages; its documented RL formulas do not read weights, so they mask nothing here
    n = len(SEQ) - 1
    adv = [0.0] * 4 + [1.0, -0.5] * ((n - 4) // 2) + [1.0] * ((n - 4) % 2)
    q = [-1.5] * n
    plain = tc.forward([_datum(logprobs=q, advantages=adv)], loss_fn).result()
    weighted = tc.forward([_datum(weights=[0.0] * 6 + [1.0] * (n - 6), logprobs=q, advantages=adv)], loss_fn).result()
    assert weighted.metrics["loss:sum"] == plain.metrics["loss:sum"] != 0
    # and it trains: forward_backward + optim_step on such a datum
    tc.forward_backward([_datum(weights=[1.0] * n, logprobs=q, advantages=adv)], loss_fn).result()
    tc.optim_step(types.AdamParams(learning_rate=1e-3)).result()


def test_extra_inputs_are_still_checked_and_unknown_keys_refused(tc):
    n = len(SEQ) - 1
    with pytest.raises(tinker.BadRequestError, match=r"data\[0\]\.loss_fn_inputs\.advantages"):
        tc.forward([_datum(weights=[1.0] * n, advantages=[0.0, float("nan")] + [0.0] * (n - 2))],
                   "cross_entropy").result()
    # a key no loss knows (the cookbook's client-side "mask", which its rl/train.py strips)
    with pytest.raises(tinker.BadRequestError, match=r"data\[0\]\.loss_fn_inputs\.mask.*not an input of any loss"):
        tc.forward([_datum(logprobs=[-1.0] * n, advantages=[1.0] * n, mask=[1.0] * n)], "importance_sampling").result()
    # the run still works after the refusals (their seq_ids were skipped)
    assert tc.forward([_datum(weights=[1.0] * n)], "cross_entropy").result().metrics["loss:sum"] > 0


# -------------------------------------------------------- item 2: smaller divergences


@pytest.fixture(scope="module")
def http(stack, api_key):
    import httpx

    with httpx.Client(base_url=stack.base_url + "/api/v1", headers={"X-API-Key": api_key}, timeout=60) as c:
        yield c


def _result(http, request_id: str):
    """Poll ``retrieve_future`` until answered; the SDK's own decoder reads the protobuf."""
    from tinker.proto.response_conv import deserialize_proto_response

    while True:
        r = http.post("/retrieve_future", json={"request_id": request_id}, headers={"Accept": "application/x-protobuf"})
        assert r.status_code == 200, r.text
        if "protobuf" in r.headers["content-type"]:
            return deserialize_proto_response(r.content, types.SampleResponse)
        assert r.json().get("type") == "try_again", r.text


def test_asample_without_a_sampling_session(tc, http):
    # SampleRequest documents sampling_session_id as optional: base_model, or model_path (the
    # base model inferred from it), as SkyRL's and TuFT's servers accept
    path = tc.save_weights_for_sampler("hosted-compat").result().path
    prompt = {"chunks": [{"type": "encoded_text", "tokens": SEQ[:4]}]}
    params = {"max_tokens": 3, "temperature": 0.0, "seed": 7}
    for target in ({"base_model": BASE_MODEL}, {"model_path": path}, {"model_path": path, "base_model": BASE_MODEL}):
        r = http.post("/asample", json={"prompt": prompt, "num_samples": 2, "sampling_params": params, **target})
        assert r.status_code == 200, r.text
        fut = r.json()
        assert len(fut["sample_sequence_ids"]) == 2
        out = _result(http, fut["request_id"])
        assert len(out.sequences) == 2 and all(len(s.tokens) == 3 for s in out.sequences)
    # the snapshot answers as the SDK's sampling client of the same path does (greedy)
    sdk = tc.create_sampling_client(path).sample(types.ModelInput.from_ints(SEQ[:4]), 1,
                                                 types.SamplingParams(max_tokens=3, temperature=0.0, seed=7)).result()
    r = http.post("/asample", json={"prompt": prompt, "sampling_params": params, "model_path": path})
    assert list(_result(http, r.json()["request_id"]).sequences[0].tokens) == list(sdk.sequences[0].tokens)


@pytest.mark.parametrize("body,status,field", [
    ({}, 400, "sampling_session_id"),
    ({"base_model": "nope/no-such-model"}, 400, "base_model"),
    ({"model_path": "tinker://nope:train:0/sampler_weights/x"}, 404, "model_path"),
    ({"model_path": "tinker://a:train:0/optimizer/x"}, 400, "model_path"),
    ({"base_model": BASE_MODEL, "record_stability_info": True}, 400, "record_stability_info"),
])
def test_asample_without_a_session_refuses_clearly(http, body, status, field):
    prompt = {"chunks": [{"type": "encoded_text", "tokens": SEQ[:4]}]}
    r = http.post("/asample", json={"prompt": prompt, "sampling_params": {"max_tokens": 2}, **body})
    assert r.status_code == status, r.text
    assert r.json()["field"] == field and r.json()["category"] == "user"


def test_bare_checkpoint_ids_get_a_400_naming_the_path_form(svc, tc, http):
    rest = svc.create_rest_client()
    tc.save_state("ckpt0").result()
    with pytest.raises(tinker.BadRequestError, match=r"checkpoint_id.*weights/ckpt0"):
        rest.delete_checkpoint(tc.model_id, "ckpt0").result()
    # the archive URL of older SDKs (0.25), publish / ttl / the download URLs: raw, as they send them
    for method, tail in (("GET", "ckpt0/archive"), ("POST", "ckpt0/publish"), ("PUT", "ckpt0/ttl"),
                         ("GET", "ckpt0/external_weights_urls"), ("DELETE", "ckpt0/publish"), ("GET", "ckpt0")):
        r = http.request(method, f"/training_runs/{tc.model_id}/checkpoints/{tail}",
                         json={"ttl_seconds": 60} if method == "PUT" else None)
        assert r.status_code == 400, (method, tail, r.status_code, r.text)
        assert r.json()["field"] == "checkpoint_id" and "weights/ckpt0" in r.json()["detail"], r.text
    # another key's run is still a 404 first, and the checkpoint is still there under its real id
    assert http.delete("/training_runs/nope:train:0/checkpoints/ckpt0").status_code == 404
    assert f"tinker://{tc.model_id}/weights/ckpt0" in {c.tinker_path for c in rest.list_checkpoints(tc.model_id).result().checkpoints}


def test_loss_fn_output_type_is_what_hosted_tinker_sends(tc):
    # the SDK's own tests (tests/test_proto_response_conv.py) model hosted Tinker's answer as
    # "TorchLossReturn"
    n = len(SEQ) - 1
    assert tc.forward([_datum(weights=[1.0] * n)], "cross_entropy").result().loss_fn_output_type == "TorchLossReturn"


def test_gateway_log_records_refusals_at_the_edge(stack, http, api_key):
    import json
    import time
    from pathlib import Path

    from openrl.edge.auth import owner_of

    marker = f"no-such-session-{time.time_ns()}"
    assert http.post("/create_model", json={"session_id": marker, "model_seq_id": 0, "base_model": BASE_MODEL,
                                            "lora_config": {"rank": 4}}).status_code == 404
    import httpx

    assert httpx.post(stack.base_url + "/api/v1/create_session", json={},
                      headers={"X-API-Key": "tml-wrong-" + marker}).status_code == 401
    log = Path(stack.state_dir) / "logs" / "gateway.log"
    deadline = time.monotonic() + 30
    while True:  # the gateway writes the line after it answered
        lines = [json.loads(x) for x in log.read_text().splitlines() if x.startswith("{") and '"refused"' in x]
        mine = [x for x in lines if x.get("http_path") == "/api/v1/create_model" and marker in (x.get("detail") or "")]
        unauth = [x for x in lines if x.get("http_status") == 401]
        if (mine and unauth) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert mine and unauth, lines[-5:]
    rec = mine[-1]
    assert rec["level"] == "info" and rec["service"] == "gateway" and rec["http_method"] == "POST"
    assert rec["http_status"] == 404 and rec["route"] == "/api/v1/create_model" and rec["field"] == "session_id"
    assert rec["key_id"] == owner_of(api_key) and api_key not in json.dumps(rec)
    assert unauth[-1]["key_id"] is None and unauth[-1]["field"] == "X-API-Key" and unauth[-1]["route"] == "unmatched"


def test_non_string_user_metadata_is_listed_as_strings(svc):
    """The SDK sends ``user_metadata: dict[str, Any]`` but its response types read
    ``dict[str, str]``: a run created with a number or a list in its metadata must not make the
    listings that hold it unreadable (they failed in the client's pydantic before)."""
    tc = svc.create_lora_training_client(base_model=BASE_MODEL, rank=4, seed=5,
                                         user_metadata={"n": 3, "tags": ["a", "b"], "name": "x"})
    run_id = tc.model_id
    rc = svc.create_rest_client()
    run = rc.get_training_run(run_id).result()
    assert run.user_metadata == {"n": "3", "tags": '["a", "b"]', "name": "x"}
    assert any(r.training_run_id == run_id for r in rc.list_training_runs(limit=100).result().training_runs)
