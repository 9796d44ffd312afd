"""The whole public surface of the ``tinker`` SDK (0.38.0) against the embedded stack:
every RestClient method, the training features beyond the basic loop (custom losses, gspo,
2-D soft targets, optimizer choice, load_state rules, external weights) and the sampling
options (top-k logprobs, last-N prompt logprobs, several snapshots of one run, base-model
sampling). Each unsupported method is checked to fail at once with a clear message.

The stack here runs with ``OPENRL_PROTO_COMPRESS=1``: ``/client/config`` tells the SDK to
zstd-compress every forward_backward body, so every training call in this module goes over
the compressed path. Nothing is mocked; downloads go over plain HTTP with no API key.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from pathlib import Path

import httpx
import numpy as np
import pytest
import tinker
import torch
from tinker import types

from conftest import BASE_MODEL
from tolerances import TOL, check_close, check_loss, check_sampler_trainer

LR = 1e-2
SEQ = [9707, 1879, 11, 419, 374, 264, 1273, 315, 279, 11691, 9128, 13, 576, 3974, 13876, 38835]


@pytest.fixture(scope="module")
def zstack(request, tmp_path_factory, models_dir):
    """A stack whose gateway advertises ``proto_compress_fwdbwd`` (OPENRL_PROTO_COMPRESS=1); an
    external stack as it is (the zstd offer is then checked only where it is made)."""
    from conftest import EXTERNAL, _make_stack

    if EXTERNAL is not None:
        yield request.getfixturevalue("stack")
        return

    s = _make_stack(tmp_path_factory, models_dir, extra_env={"OPENRL_PROTO_COMPRESS": "1"}).start()
    yield s
    s.stop()


@pytest.fixture(scope="module")
def svc(zstack):
    return tinker.ServiceClient(base_url=zstack.base_url, api_key=zstack.api_key)


@pytest.fixture(scope="module")
def rest(svc):
    return svc.create_rest_client()


def new_client(svc, seed: int = 0, rank: int = 4, **kw):
    return svc.create_lora_training_client(base_model=BASE_MODEL, rank=rank, seed=seed, **kw).result()


def datum(tokens: list[int], **inputs) -> types.Datum:
    fn_inputs = {"target_tokens": tokens[1:], **inputs}
    if "weights" not in fn_inputs and not ({"advantages", "logprobs"} & set(inputs)):
        fn_inputs["weights"] = [1.0] * (len(tokens) - 1)
    return types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]), loss_fn_inputs=fn_inputs)


def lp_of(out: types.ForwardBackwardOutput, i: int = 0) -> np.ndarray:
    return np.asarray(out.loss_fn_outputs[i]["logprobs"].tolist(), dtype=np.float64)


def train_steps(tc, n: int = 1, tokens: list[int] = SEQ) -> None:
    for _ in range(n):
        tc.forward_backward([datum(tokens)], "cross_entropy")
        tc.optim_step(types.AdamParams(learning_rate=LR)).result()


# ------------------------------------------------------------------------------- config


def test_client_config_turns_on_zstd_and_training_works(svc, zstack):
    r = httpx.post(f"{zstack.base_url}/api/v1/client/config", json={"sdk_version": tinker.__version__},
                   headers={"X-API-Key": zstack.api_key})
    if getattr(zstack, "external", False) and zstack.serve_env.get("OPENRL_PROTO_COMPRESS") != "1":
        pytest.skip("external stack: the serve was not started with OPENRL_PROTO_COMPRESS=1")
    assert r.status_code == 200 and r.json()["proto_compress_fwdbwd"] is True
    tc = new_client(svc, seed=1)
    assert tc.holder.get_client_config().proto_compress_fwdbwd is True  # what the SDK will obey
    first = tc.forward_backward([datum(SEQ)], "cross_entropy").result().metrics["loss:sum"]
    tc.optim_step(types.AdamParams(learning_rate=LR)).result()
    second = tc.forward([datum(SEQ)], "cross_entropy").result().metrics["loss:sum"]
    assert math.isfinite(first) and second < first


def test_bad_zstd_body_is_a_user_error(svc, zstack):
    """A body that claims zstd but is not gets a 400 naming the body; runs keep working."""
    tc = new_client(svc, seed=2)
    expected = tc.forward([datum(SEQ)], "cross_entropy").result().metrics["loss:sum"]
    h = {"X-API-Key": zstack.api_key, "Content-Type": "application/x-protobuf", "Content-Encoding": "zstd"}
    bad = httpx.post(f"{zstack.base_url}/api/v1/forward_backward", content=b"not zstd at all", headers=h)
    assert bad.status_code == 400 and "body" in bad.text
    # and the run is not wedged by it
    got = tc.forward([datum(SEQ)], "cross_entropy").result().metrics["loss:sum"]
    check_loss("repeat_logprob", got, expected, TOL.repeat_logprob, len(SEQ) - 1, rel=1e-6)


# --------------------------------------------------------------------------------- REST


@pytest.fixture(scope="module")
def saved(svc):
    """One run with a training-state checkpoint, two sampler checkpoints and an external one."""
    tc = new_client(svc, seed=3, user_metadata={"purpose": "surface"})
    train_steps(tc)
    state = tc.save_state("s1").result().path
    samp = tc.save_weights_for_sampler("w1").result().path
    samp2 = tc.save_weights_for_sampler("w2").result().path
    ext = tc.save_weights_external("e1").result()
    return {"tc": tc, "run": tc.model_id, "state": state, "sampler": samp, "sampler2": samp2, "ext": ext}


def test_checkpoint_listings_newest_first_with_metadata(rest, saved):
    run = saved["run"]
    cps = rest.list_checkpoints(run).result().checkpoints
    paths = [c.tinker_path for c in cps]
    assert paths == [saved["ext"].path, saved["sampler2"], saved["sampler"], saved["state"]]
    types_ = {c.tinker_path: c.checkpoint_type for c in cps}
    assert types_[saved["state"]] == "training" and types_[saved["sampler"]] == "sampler"
    assert types_[saved["ext"].path] == "external"
    for c in cps:
        assert c.size_bytes and c.size_bytes > 0 and c.time is not None and c.expires_at is None
        assert c.checkpoint_id == c.tinker_path.split("/", 3)[3]
    mine = rest.list_user_checkpoints(limit=100).result()
    assert {saved["state"], saved["sampler"]} <= {c.tinker_path for c in mine.checkpoints}
    assert mine.cursor.total_count >= 4
    first = rest.list_user_checkpoints(limit=1, offset=0).result().checkpoints
    assert len(first) == 1


def test_training_runs_list_cursor_and_get(svc, rest, saved):
    other = new_client(svc, seed=4)
    page1 = rest.list_training_runs(limit=1, offset=0).result()
    page2 = rest.list_training_runs(limit=1, offset=1).result()
    assert page1.cursor.total_count >= 2 and page1.cursor.limit == 1
    assert page1.training_runs[0].training_run_id == other.model_id  # newest first
    assert page2.training_runs[0].training_run_id != other.model_id
    run = rest.get_training_run(saved["run"]).result()
    assert run.base_model == BASE_MODEL and run.is_lora and run.lora_rank == 4
    assert run.last_checkpoint.tinker_path == saved["state"]
    assert run.last_sampler_checkpoint.tinker_path == saved["sampler2"]
    assert run.user_metadata == {"purpose": "surface"}
    by_path = rest.get_training_run_by_tinker_path(saved["sampler"]).result()
    assert by_path.training_run_id == saved["run"]
    with pytest.raises(tinker.NotFoundError):
        rest.get_training_run("nope:train:0").result()


def test_weights_info(rest, saved):
    info = rest.get_weights_info_by_tinker_path(saved["state"]).result()
    assert info.base_model == BASE_MODEL and info.is_lora and info.lora_rank == 4


def test_publish_unpublish_ttl_delete(rest, saved):
    path = saved["sampler"]
    rest.publish_checkpoint_from_tinker_path(path).result()
    pub = {c.tinker_path: c.public for c in rest.list_checkpoints(saved["run"]).result().checkpoints}
    assert pub[path] is True
    with pytest.raises(tinker.BadRequestError, match="already public"):
        rest.publish_checkpoint_from_tinker_path(path).result()
    rest.unpublish_checkpoint_from_tinker_path(path).result()
    pub = {c.tinker_path: c.public for c in rest.list_checkpoints(saved["run"]).result().checkpoints}
    assert pub[path] is False
    rest.set_checkpoint_ttl_from_tinker_path(path, 3600).result()
    c = next(c for c in rest.list_checkpoints(saved["run"]).result().checkpoints if c.tinker_path == path)
    assert c.expires_at is not None
    rest.set_checkpoint_ttl_from_tinker_path(path, None).result()
    c = next(c for c in rest.list_checkpoints(saved["run"]).result().checkpoints if c.tinker_path == path)
    assert c.expires_at is None
    # a checkpoint whose TTL has passed is gone from listings and lookups at once
    rest.set_checkpoint_ttl_from_tinker_path(saved["sampler2"], 1).result()
    import time

    time.sleep(1.5)
    assert saved["sampler2"] not in {c.tinker_path for c in rest.list_checkpoints(saved["run"]).result().checkpoints}
    with pytest.raises(tinker.NotFoundError):
        rest.publish_checkpoint_from_tinker_path(saved["sampler2"]).result()
    rest.delete_checkpoint_from_tinker_path(path).result()
    assert path not in {c.tinker_path for c in rest.list_checkpoints(saved["run"]).result().checkpoints}
    with pytest.raises(tinker.NotFoundError):
        rest.delete_checkpoint_from_tinker_path(path).result()


def test_external_weights_urls_download_without_key(rest, saved, zstack):
    """The URLs serve the adapter's exact stored bytes to anyone holding them, until they expire;
    a tampered signature is refused."""
    from safetensors.numpy import load

    for path in (saved["ext"].path,):  # the SDK only asks for external_weights checkpoints
        resp = rest.get_external_weights_urls(path).result()
        assert {"adapter_model.safetensors", "adapter_config.json"} <= set(resp.urls)
        assert resp.expires.timestamp() > __import__("time").time() + 60
        run, kind, name = path[len("tinker://"):].split("/")
        manifest = json.loads((Path(zstack.state_dir) / "storage" / run / kind / name / "manifest.json").read_text())
        for f, url in resp.urls.items():
            r = httpx.get(url)  # no X-API-Key
            assert r.status_code == 200, (f, r.text)
            assert hashlib.sha256(r.content).hexdigest() == manifest["files"][f]["sha256"]
        cfg = json.loads(httpx.get(resp.urls["adapter_config.json"]).content)
        assert cfg["r"] == 4
        tensors = load(httpx.get(resp.urls["adapter_model.safetensors"]).content)
        assert tensors and all(k.startswith("base_model.model.") for k in tensors)
    url = resp.urls["adapter_config.json"]
    assert httpx.get(url.replace("sig=", "sig=0")).status_code == 403
    assert httpx.get(url.split("?")[0]).status_code == 403


def test_sessions_get_sampler_project_and_search(svc, rest, saved):
    sid = saved["tc"].model_id.split(":")[0]
    assert sid in rest.list_sessions(limit=50).result().sessions
    sess = rest.get_session(sid).result()
    assert saved["run"] in sess.training_run_ids
    sampler = saved["tc"].save_weights_and_get_sampling_client().result()
    s = rest.get_sampler(sampler._sampling_session_id).result()
    assert s.base_model == BASE_MODEL and s.model_path.startswith(f"tinker://{saved['run']}/sampler_weights/")
    rest.assign_session_project(sid, "proj-surface").result()
    runs = rest.list_training_runs(limit=50, project_id="proj-surface").result().training_runs
    assert saved["run"] in {r.training_run_id for r in runs}
    assert not rest.list_training_runs(limit=50, project_id="proj-none").result().training_runs
    found = rest.search_sessions(types.SessionSearchRequest(session_id=sid)).result()
    assert [x.session_id for x in found.sessions] == [sid]
    assert found.sessions[0].project_id == "proj-surface" and found.sessions[0].checkpoints_count >= 2
    active = rest.search_sessions(types.SessionSearchRequest(
        project_ids=["proj-surface"], statuses=[types.ActiveSessionStatusQuery()])).result()
    assert sid in {x.session_id for x in active.sessions}


def test_export_session_trace_is_a_timeline_of_the_session(svc, zstack, rest):
    """RestClient.export_session_trace returns a signed URL (no API key needed) of a Chrome
    trace-event JSON that ui.perfetto.dev opens: a process per training run and sampling
    session, a slice per request named by its op, queue time split off, training slices in
    seq_id order, every sample present; a tampered or expired URL is refused (403), an unknown
    session is a 404."""
    other = tinker.ServiceClient(base_url=zstack.base_url, api_key=zstack.api_key)
    tc = new_client(other, seed=21)
    sid = tc.model_id.split(":")[0]
    fbs = [tc.forward_backward([datum(SEQ)], "cross_entropy") for _ in range(2)]
    tc.optim_step(types.AdamParams(learning_rate=1e-3)).result()
    [f.result() for f in fbs]
    sc = tc.save_weights_and_get_sampling_client()
    samples = [sc.sample(types.ModelInput.from_ints(SEQ[:4]), 1, types.SamplingParams(max_tokens=2, seed=i))
               for i in range(3)]
    [s.result() for s in samples]

    url = rest.export_session_trace(sid).result(timeout=60)
    doc = httpx.get(url, timeout=60).json()  # no X-API-Key
    names = {e["pid"]: e["args"]["name"] for e in doc["traceEvents"] if e["ph"] == "M"}
    assert f"training run {tc.model_id}" in names.values(), names
    assert any(n.startswith(f"sampling session {sid}:sample:") for n in names.values()), names
    slices = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    assert all(e["dur"] >= 0 and e["ts"] > 1.7e15 for e in slices)  # unix microseconds
    run_pid = next(p for p, n in names.items() if n == f"training run {tc.model_id}")
    ops = [(e["args"]["seq_id"], e["name"]) for e in sorted(slices, key=lambda e: e["ts"])
           if e["pid"] == run_pid and e["cat"] == "run"]
    assert [op for _, op in ops][:4] == ["create_model", "forward_backward", "forward_backward", "optim_step"], ops
    assert any(e["name"] == "queued" for e in slices)
    assert sum(e["name"] == "sample" and e["cat"] == "run" for e in slices) == 3
    assert all(e["args"]["state"] == "ok" for e in slices if e["pid"] == run_pid)

    assert httpx.get(url.replace("sig=", "sig=0"), timeout=30).status_code == 403
    assert httpx.get(url.split("?")[0] + "?expires=1&sig=00", timeout=30).status_code == 403
    with pytest.raises(tinker.NotFoundError):
        rest.export_session_trace("no-such-session").result(timeout=30)


def test_unsupported_rest_methods_fail_fast_and_clearly(svc, rest, saved):
    with pytest.raises(Exception, match="not supported|JWT"):
        rest.whoami().result(timeout=30)  # needs JWT auth: the SDK refuses before any request


def test_unload_model_future(svc, zstack):
    """Older SDKs POST /unload_model and poll the future for ``{model_id}``."""
    tc = new_client(svc, seed=5)
    h = {"X-API-Key": zstack.api_key}
    r = httpx.post(f"{zstack.base_url}/api/v1/unload_model", json={"model_id": tc.model_id}, headers=h)
    assert r.status_code == 200
    rid = r.json()["request_id"]
    for _ in range(10):
        res = httpx.post(f"{zstack.base_url}/api/v1/retrieve_future", json={"request_id": rid}, headers=h,
                         timeout=60).json()
        if res.get("type") != "try_again":
            break
    assert res.get("model_id") == tc.model_id


# ----------------------------------------------------------------------------- training


def test_forward_backward_custom_dpo_matches_hand_gradient(svc):
    """A DPO-style pairwise loss computed client-side (two calls: forward, then backward with
    weights = -dL/dlogprob) moves the chosen sequence's logprob up relative to the rejected
    one, and its reported loss equals the formula on the forward logprobs."""
    tc = new_client(svc, seed=6)
    chosen, rejected = SEQ, SEQ[:4] + SEQ[4:][::-1]
    data = [datum(chosen), datum(rejected)]
    beta = 0.5

    def dpo(batch, logprobs):
        margin = beta * (logprobs[0].sum() - logprobs[1].sum())
        loss = -torch.nn.functional.logsigmoid(margin)
        return loss, {"dpo_loss": float(loss)}

    before = tc.forward(data, "cross_entropy").result()
    lc, lr_ = lp_of(before, 0).sum(), lp_of(before, 1).sum()
    out = tc.forward_backward_custom(data, dpo).result()
    expected = float(-torch.nn.functional.logsigmoid(torch.tensor(beta * (lc - lr_))))
    # the custom loss's own forward vs this forward; |dL/dlp| <= beta per token
    check_loss("repeat_logprob", out.metrics["dpo_loss"], expected, TOL.repeat_logprob,
               beta * (len(chosen) + len(rejected) - 2))
    tc.optim_step(types.AdamParams(learning_rate=LR)).result()
    after = tc.forward(data, "cross_entropy").result()
    assert lp_of(after, 0).sum() - lp_of(after, 1).sum() > lc - lr_


def test_create_custom_loss_runs_client_side(svc):
    tc = new_client(svc, seed=7)

    def neg_ll(logprobs, weights):
        loss = -(logprobs * weights).sum()
        return loss, {"custom/neg_ll:sum": loss}

    handle = svc.create_custom_loss(neg_ll, {"logprobs": 1, "weights": 1}).result()
    assert handle.loss_id is None  # custom_loss_server_side is off: the loss runs in the client
    out = tc.forward_backward_custom([datum(SEQ)], handle).result()
    ce = tc.forward([datum(SEQ)], "cross_entropy").result().metrics["loss:sum"]
    check_loss("repeat_logprob", out.metrics["custom/neg_ll:sum"], ce, TOL.repeat_logprob, len(SEQ) - 1)


def _gspo_hand(lp, q, adv, mask, lo, hi) -> float:
    m = mask != 0
    s = math.exp(float((lp - q)[m].mean())) if m.any() else 1.0
    return float(-np.minimum(s * adv, np.clip(s, lo, hi) * adv).sum())


@pytest.mark.parametrize("with_mask", [True, False])
def test_gspo_matches_sequence_level_formula(svc, with_mask):
    tc = new_client(svc, seed=8)
    n = len(SEQ) - 1
    lp = lp_of(tc.forward([datum(SEQ)], "cross_entropy").result())
    rng = np.random.default_rng(1)
    prompt = 5
    q = np.where(np.arange(n) < prompt, 0.0, lp + rng.uniform(-0.3, 0.3, n)).astype(np.float32).astype(np.float64)
    adv = np.where(np.arange(n) < prompt, 0.0, 0.7).astype(np.float32).astype(np.float64)
    mask = (np.arange(n) >= prompt).astype(np.float64)
    inputs = {"logprobs": q.tolist(), "advantages": adv.tolist()}
    if with_mask:
        inputs["sequence_ratio_mask"] = mask.tolist()  # without it: the non-zero-advantage tokens
    cfg = {"clip_low_threshold": 0.95, "clip_high_threshold": 1.05}
    fb = tc.forward_backward([datum(SEQ, **inputs)], "gspo", loss_fn_config=cfg).result()
    # the formula on the pass's own logprobs
    want = _gspo_hand(lp_of(fb), q, adv, mask, 0.95, 1.05)
    assert fb.metrics["loss:sum"] == pytest.approx(want, rel=1e-4, abs=1e-5)
    check_close("fwd_vs_fwdbwd", lp_of(fb), lp, TOL.fwd_vs_fwdbwd, loss_fn="gspo")


def test_stable_reinforce_without_provenance_is_refused_clearly(svc):
    """(stable_reinforce itself: tests/stack/test_stable_reinforce.py)"""
    tc = new_client(svc, seed=9)
    n = len(SEQ) - 1
    d = datum(SEQ, logprobs=[0.0] * n, advantages=[1.0] * n)
    with pytest.raises(tinker.BadRequestError, match="stable_reinforce needs provenance") as e:
        tc.forward_backward([d], "stable_reinforce", loss_fn_config={"kl_coeff": 0.1}).result()
    assert "data[0].loss_fn_input_spans" in str(e.value)
    # the run keeps working
    assert math.isfinite(tc.forward([datum(SEQ)], "cross_entropy").result().metrics["loss:sum"])


def test_two_d_soft_targets_float_and_negative_weights(svc):
    """[T, K] targets and weights (torch tensors: the SDK sends them as CSR) give per-cell
    logprobs of shape [T, K] and loss -sum(lp * w); column 0 equals the 1-D logprobs."""
    tc = new_client(svc, seed=10)
    n, K = len(SEQ) - 1, 3
    lp1 = lp_of(tc.forward([datum(SEQ)], "cross_entropy").result())
    tt = torch.tensor([[SEQ[t + 1], 100 + t, 7] for t in range(n)], dtype=torch.int64)
    w = torch.zeros((n, K), dtype=torch.float32)
    w[:, 0] = 0.75
    w[::2, 1] = -0.25  # negative and fractional weights; zeros stay out of the CSR encoding
    d = types.Datum(model_input=types.ModelInput.from_ints(SEQ[:-1]),
                    loss_fn_inputs={"target_tokens": types.TensorData.from_torch(tt),
                                    "weights": types.TensorData.from_torch(w)})
    out = tc.forward_backward([d], "cross_entropy").result()
    lp2 = np.asarray(out.loss_fn_outputs[0]["logprobs"].to_numpy(), dtype=np.float64).reshape(n, K)
    # forward (1-D) vs forward_backward ([T, K] column 0)
    check_close("fwd_vs_fwdbwd", lp2[:, 0], lp1, TOL.fwd_vs_fwdbwd, what="[T, K] column 0 vs 1-D targets")
    assert out.metrics["loss:sum"] == pytest.approx(float(-(lp2 * w.numpy()).sum()), rel=1e-4)
    assert (lp2 <= 0).all() and not np.allclose(lp2[:, 1], lp2[:, 2])


def test_dimuon_optimizer_is_refused_at_create(svc):
    with pytest.raises(tinker.BadRequestError, match="dimuon.*AdamW|not supported"):
        svc.create_lora_training_client(base_model=BASE_MODEL, rank=4,
                                        optimizer=types.DimuonOptimizerConfig()).result()
    adam = svc.create_lora_training_client(base_model=BASE_MODEL, rank=4, optimizer=types.AdamOptimizerConfig()).result()
    assert adam.get_info().model_data.model_name == BASE_MODEL


def test_load_state_only_as_first_request(svc, saved):
    """Hosted-Tinker semantics: an in-place load is accepted as a run's first request only."""
    fresh = new_client(svc, seed=11)
    fresh.load_state(saved["state"]).result()
    want = lp_of(saved["tc"].forward([datum(SEQ)], "cross_entropy").result())
    check_close("save_load", lp_of(fresh.forward([datum(SEQ)], "cross_entropy").result()), want, TOL.save_load,
                what="load_state into a new run")
    with pytest.raises(tinker.BadRequestError, match="first request"):
        fresh.load_state_with_optimizer(saved["state"]).result()
    # the refused seq_id does not hold the run back
    assert math.isfinite(fresh.forward([datum(SEQ)], "cross_entropy").result().metrics["loss:sum"])
    resumed = svc.create_training_client_from_state_with_optimizer(saved["state"]).result()
    check_close("save_load", lp_of(resumed.forward([datum(SEQ)], "cross_entropy").result()), want, TOL.save_load)


# ----------------------------------------------------------------------------- sampling


def test_topk_and_last_n_prompt_logprobs(svc):
    tc = new_client(svc, seed=12)
    train_steps(tc)
    sc = tc.save_weights_and_get_sampling_client().result()
    prompt = types.ModelInput.from_ints(SEQ)
    K, N = 4, 5
    res = sc.sample(prompt, 1, types.SamplingParams(max_tokens=3, temperature=0.0, stop=[]),
                    include_prompt_logprobs=True, topk_prompt_logprobs=K, topk_sample_logprobs=K).result()
    full = res.prompt_logprobs
    assert full[0] is None and all(x is not None for x in full[1:])
    train_lp = lp_of(tc.forward([datum(SEQ)], "cross_entropy").result())
    check_sampler_trainer(full[1:], train_lp, what="prompt_logprobs with topk")
    topk = res.topk_prompt_logprobs
    assert topk[0] is None
    in_topk = []  # (top-k entry of the real next token, its prompt logprob)
    for t in range(1, len(SEQ)):
        ids, lps = zip(*topk[t])
        assert len(ids) == K and list(lps) == sorted(lps, reverse=True)
        assert lps[0] >= full[t] - TOL.sampler_repeat
        if SEQ[t] in ids:
            in_topk.append((lps[ids.index(SEQ[t])], full[t]))
    if in_topk:
        check_close("sampler_repeat", *zip(*in_topk), TOL.sampler_repeat, what="top-k vs prompt logprob")
    seq = res.sequences[0]
    assert len(seq.topk_logprobs) == len(seq.tokens) == 3
    for tok, row in zip(seq.tokens, seq.topk_logprobs):
        assert row[0][0] == tok  # greedy: the top-1
    check_close("sampler_repeat", [row[0][1] for row in seq.topk_logprobs], seq.logprobs, TOL.sampler_repeat,
                what="top-1 vs sampled logprob")
    last = sc.sample(prompt, 1, types.SamplingParams(max_tokens=1), include_prompt_logprobs=True,
                     topk_prompt_logprobs=K, prompt_logprobs_last_n=N).result()
    assert last.prompt_logprobs[:-N] == [None] * (len(SEQ) - N)
    check_close("sampler_repeat", last.prompt_logprobs[-N:], full[-N:], TOL.sampler_repeat, what="last-N prompt logprobs")
    assert all(r is None for r in last.topk_prompt_logprobs[:-N]) and all(last.topk_prompt_logprobs[-N:])


def test_snapshots_of_one_run_served_side_by_side(svc, zstack):
    """Off-policy RL: the sampling client of step k keeps answering with step-k weights while
    training continues and later snapshots are saved and sampled."""
    tc = new_client(svc, seed=13)
    prompt = types.ModelInput.from_ints(SEQ)
    clients, expected = [], []
    for _ in range(3):
        train_steps(tc, 2)
        clients.append(tc.save_weights_and_get_sampling_client().result())
        expected.append(lp_of(tc.forward([datum(SEQ)], "cross_entropy").result()))
    assert not np.allclose(expected[0], expected[2], atol=1e-3)
    for i, (sc, want) in reversed(list(enumerate(zip(clients, expected)))):
        check_sampler_trainer(sc.compute_logprobs(prompt).result()[1:], want, what=f"snapshot {i + 1} of 3")
    # a handle passed to another process gives a client for the same immutable snapshot
    clone = tinker.SamplingClient.from_sampler_handle(clients[0].get_sampler_handle(), api_key=zstack.api_key)
    check_sampler_trainer(clone.compute_logprobs(prompt).result()[1:], expected[0], what="snapshot 1 from a handle")


def test_base_model_sampling_client(svc):
    """A sampling client on the bare base model (no adapter) equals an untrained LoRA run
    (B = 0), and samples."""
    base = svc.create_sampling_client(base_model=BASE_MODEL).result()
    assert base.get_base_model() == BASE_MODEL
    got = np.asarray(base.compute_logprobs(types.ModelInput.from_ints(SEQ)).result()[1:], dtype=np.float64)
    fresh = new_client(svc, seed=14)
    check_sampler_trainer(got, lp_of(fresh.forward([datum(SEQ)], "cross_entropy").result()), what="base model")
    out = base.sample(types.ModelInput.from_ints(SEQ[:4]), 2, types.SamplingParams(max_tokens=4, seed=3)).result()
    assert len(out.sequences) == 2 and all(1 <= len(s.tokens) <= 4 for s in out.sequences)


def test_copy_weights_into_a_project_and_train_from_the_copy(svc, zstack, rest, saved, monkeypatch):
    """RestClient.copy_weights / ServiceClient.copy_weights: the copy lands in a new run of the
    destination project with the source's kind, name, weights and metadata, its own expiry and
    shared bytes (hard links in file storage); it samples and seeds a new training run with the
    source's logprobs, cannot itself be trained on, and a retry with the same idempotency key
    returns the first copy. Bad fields get a 4xx naming them."""
    copied = rest.copy_weights(saved["state"], destination_project_id="proj-archive", ttl_seconds=7200).result()
    run, kind, name = copied.removeprefix("tinker://").split("/")
    assert (kind, name) == ("weights", "s1") and run != saved["run"]
    assert run in {r.training_run_id for r in rest.list_training_runs(limit=100, project_id="proj-archive").result()
                   .training_runs}
    (ck,) = rest.list_checkpoints(run).result().checkpoints
    assert ck.tinker_path == copied and ck.expires_at is not None and not ck.public
    src_info, info = rest.get_weights_info_by_tinker_path(saved["state"]).result(), \
        rest.get_weights_info_by_tinker_path(copied).result()
    assert (info.base_model, info.lora_rank) == (src_info.base_model, src_info.lora_rank)
    root = Path(zstack.storage.removeprefix("file://"))
    src_dir, dst_dir = root / saved["run"] / "weights" / "s1", root / run / "weights" / "s1"
    for f in src_dir.iterdir():
        if f.name != "manifest.json":
            assert os.path.samefile(f, dst_dir / f.name), f.name  # no bytes duplicated

    # sampler checkpoints of its own: other tests delete the fixture's
    own, own2 = (saved["tc"].save_weights_for_sampler(n).result().path for n in ("cw1", "cw2"))
    monkeypatch.setenv("TINKER_PROJECT_ID", "proj-archive")  # ServiceClient.copy_weights' destination
    samp = svc.copy_weights(own).result()
    assert samp.split("/")[-2:] == ["sampler_weights", "cw1"]
    out = svc.create_sampling_client(model_path=samp).sample(
        types.ModelInput.from_ints(SEQ[:4]), 1, types.SamplingParams(max_tokens=2, seed=1)).result()
    assert len(out.sequences[0].tokens) == 2

    from_copy = svc.create_training_client_from_state(copied).result()
    from_src = svc.create_training_client_from_state(saved["state"]).result()
    check_close("save_load", lp_of(from_copy.forward([datum(SEQ)], "cross_entropy").result()),
                lp_of(from_src.forward([datum(SEQ)], "cross_entropy").result()), TOL.save_load, what="copy_weights")

    h = {"X-API-Key": zstack.api_key}
    api = f"{zstack.base_url}/api/v1"
    r = httpx.post(f"{api}/optim_step", headers=h, json={"model_id": run, "seq_id": 1,
                                                          "adam_params": {"learning_rate": 1e-3}})
    assert r.status_code == 400 and r.json()["field"] == "model_id" and "copy_weights" in r.json()["detail"], r.text
    body = {"source_path": own2, "destination_project_id": "proj-archive"}
    first = httpx.post(f"{api}/copy_weights", headers={**h, "X-Idempotency-Key": "k-1"}, json=body)
    again = httpx.post(f"{api}/copy_weights", headers={**h, "X-Idempotency-Key": "k-1"}, json=body)
    assert first.status_code == 200 and first.json() == again.json(), (first.text, again.text)
    for bad, fld in (({"source_path": "tinker://nope:train:0/weights/x", "destination_project_id": "p"}, "source_path"),
                     ({"source_path": saved["state"]}, "destination_project_id"),
                     ({"source_path": saved["state"], "destination_project_id": "p", "ttl_seconds": 60}, "ttl_seconds"),
                     ({"source_path": saved["state"], "session_id": "x"}, "model_seq_id")):
        r = httpx.post(f"{api}/copy_weights", headers=h, json=bad)
        assert r.status_code in (400, 404) and r.json()["field"] == fld, (bad, r.text)
    r = httpx.post(f"{api}/copy_weights", headers={**h, "X-Tinker-Weights-Access-Token": "t"}, json=body)
    assert r.status_code == 400 and r.json()["field"] == "weights_access_token", r.text


def test_service_client_misc_and_admin_routes(svc, zstack, rest, saved, monkeypatch):
    """The AdminClient routes fail at once with "not supported"; close() finishes the session;
    create_sampling_client(path) and record_stability_info sampling (recorded for
    stable_reinforce, tests/stack/test_stable_reinforce.py) work."""
    with pytest.raises(tinker.BadRequestError, match="not supported"):
        rest.get_audit_log().result(timeout=30)
    with pytest.raises(tinker.BadRequestError, match="not supported"):
        rest.get_current_checkpoint_storage_usage().result(timeout=30)
    assert isinstance(svc.get_console_url(), str)
    # (the sampler checkpoints may be deleted by now: the training state is samplable too)
    sc = saved["tc"].create_sampling_client(saved["state"], record_stability_info=True).result()
    out = sc.sample(types.ModelInput.from_ints(SEQ[:4]), 2, types.SamplingParams(max_tokens=2)).result()
    assert len({s.sequence_id for s in out.sequences}) == 2
    other = tinker.ServiceClient(base_url=zstack.base_url, api_key=zstack.api_key)
    sid = new_client(other, seed=15).model_id.split(":")[0]
    other.close("success").result(timeout=30)
    done = rest.search_sessions(types.SessionSearchRequest(
        session_id=sid, statuses=[types.ClientFinishedSessionStatusQuery(reasons=["success"])])).result()
    assert [s.session_id for s in done.sessions] == [sid]
    assert done.sessions[0].status.type == "client_finished"


def test_target_prompt_logprobs_and_prompt_alt_tokens(svc):
    """target_prompt_logprobs scores named ids at each prompt position (column 0 = the real next
    token equals prompt_logprobs; -1 cells give 0.0); prompt_alt_tokens_k draws k ids per
    position with their logprobs."""
    base = svc.create_sampling_client(base_model=BASE_MODEL).result()
    P = len(SEQ)
    ids = np.full((P - 1, 3), -1, dtype=np.int64)
    ids[:, 0] = SEQ[1:]
    ids[::2, 1] = 42
    res = base.sample(types.ModelInput.from_ints(SEQ), 1, types.SamplingParams(max_tokens=1),
                      include_prompt_logprobs=True, target_prompt_logprobs=types.TensorData.from_numpy(ids),
                      prompt_alt_tokens_k=2).result()
    tgt = np.asarray(res.target_prompt_logprobs.to_numpy(), dtype=np.float64).reshape(P - 1, 3)
    check_close("sampler_repeat", tgt[:, 0], res.prompt_logprobs[1:], TOL.sampler_repeat,
                what="target_prompt_logprobs column 0 vs prompt_logprobs")
    assert (tgt[:, 2] == 0.0).all() and (tgt[1::2, 1] == 0.0).all() and (tgt[::2, 1] < 0).all()
    alt = res.prompt_alt_tokens
    alt_ids, alt_lps = np.asarray(alt.tokens.to_numpy()), np.asarray(alt.logprobs.to_numpy())
    assert alt_ids.reshape(P - 1, 2).shape == (P - 1, 2) and (alt_lps <= 0).all()


def test_gcs_checkpoints_get_v4_signed_urls_or_fall_back():
    """On gs:// storage the download URLs are GCS V4 signed URLs when the credentials can sign
    (a service-account key signs locally, no network), and None (→ the gateway's own signed
    route) when they cannot (anonymous credentials, as with the emulator)."""
    from datetime import timedelta

    pytest.importorskip("cryptography")
    pytest.importorskip("google.cloud.storage")
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import rsa
    from google.auth.credentials import AnonymousCredentials
    from google.cloud import storage as gcs
    from google.oauth2 import service_account

    from functions.gateway.routes_download import _gcs_signed_urls
    from openrl.storage import TinkerPath
    from openrl.storage.gcs import GCSStorage

    pem = rsa.generate_private_key(public_exponent=65537, key_size=2048).private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()).decode()
    creds = service_account.Credentials.from_service_account_info({
        "type": "service_account", "project_id": "p", "private_key_id": "k", "private_key": pem,
        "client_email": "openrl@p.iam.gserviceaccount.com", "client_id": "1",
        "token_uri": "https://oauth2.googleapis.com/token"})
    path = TinkerPath.parse("tinker://s:train:0/external_weights/e1")
    signer = GCSStorage("bkt", "ckpt", client=gcs.Client(project="p", credentials=creds))
    urls = _gcs_signed_urls(signer, path, ["adapter_config.json"], timedelta(seconds=600))
    url = urls["adapter_config.json"]
    assert url.startswith("https://storage.googleapis.com/bkt/ckpt/s%3Atrain%3A0/external_weights/e1/adapter_config.json?")
    assert "X-Goog-Algorithm=GOOG4-RSA-SHA256" in url and "X-Goog-Expires=600" in url
    anon = GCSStorage("bkt", "ckpt", client=gcs.Client(project="p", credentials=AnonymousCredentials()))
    assert _gcs_signed_urls(anon, path, ["adapter_config.json"], timedelta(seconds=600)) is None
