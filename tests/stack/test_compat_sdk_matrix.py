"""The rest of docs/compatibility.md's 0.25.0 column (issue 13 item 8): every method that page
marks as working (or "not supported") on SDK 0.25.0 and that ``test_compat_sdk.py`` does not
already call. Same rules as that file (whose fixtures and helpers this one imports): nothing
from openrl or conftest, fixed token ids, version differences bridged by feature checks.

Run in the main suite against the session's ``stack`` (pinned SDK) and by
``scripts/test-old-sdk.sh`` under tinker 0.25.0, whose ``openrl serve`` runs with
``OPENRL_PROTO_COMPRESS=1`` so that 0.25.0 sends its forward_backward bodies zstd-compressed
(``test_zstd_bodies`` checks that the SDK was told to; it skips where the server does not
offer compression, as in the main suite, whose ``test_surface.py`` covers zstd for 0.38).
"""

from __future__ import annotations

import math

import httpx
import numpy as np
import pytest
import tinker
import torch
from tinker import types

from test_compat_sdk import BASE_MODEL, LR, SEQ, datum, lp_of, new_client, ready  # noqa: F401
from test_compat_sdk import rest, svc, target  # noqa: F401  (fixtures)
from tolerances import TOL, check_close, check_sampler_trainer  # noqa: E402  (tests/, put on sys.path by test_compat_sdk)


def _train_once(tc) -> None:
    tc.forward_backward([datum(SEQ)], "cross_entropy").result()
    tc.optim_step(types.AdamParams(learning_rate=LR)).result()


def _hand_rl_loss(loss_fn: str, lp, old, adv, cfg: dict) -> float:
    """cispo / dro / gspo, written out independently of the trainer (as in test_e2e_sdk.py and,
    for gspo without ``sequence_ratio_mask``, docs/compatibility.md: the sequence ratio over
    the tokens with a non-zero advantage)."""
    if loss_fn == "gspo":
        s = math.exp(float((lp - old)[adv != 0].mean()))
        lo, hi = cfg["clip_low_threshold"], cfg["clip_high_threshold"]
        return float(-np.minimum(s * adv, min(max(s, lo), hi) * adv).sum())
    if loss_fn == "cispo":
        return float(-(np.clip(np.exp(lp - old), cfg["clip_low_threshold"], cfg["clip_high_threshold"]) * adv * lp).sum())
    return float(-(adv * lp).sum() + 0.5 * cfg["beta"] * ((lp - old) ** 2).sum())


@pytest.mark.parametrize("loss_fn,cfg", [("cispo", {"clip_low_threshold": 0.5, "clip_high_threshold": 1.1}),
                                         ("dro", {"beta": 0.3}),
                                         ("gspo", {"clip_low_threshold": 0.97, "clip_high_threshold": 1.01})])
def test_cispo_dro_gspo(svc, loss_fn, cfg):
    tc = new_client(svc, seed=21)
    n = len(SEQ) - 1
    lp = lp_of(tc.forward([datum(SEQ)], "cross_entropy").result())
    old = (lp + np.linspace(-0.6, 0.6, n)).astype(np.float32).astype(np.float64)
    adv = np.linspace(-1, 1, n).astype(np.float32).astype(np.float64)
    fb = tc.forward_backward([datum(SEQ, logprobs=old.tolist(), advantages=adv.tolist())], loss_fn,
                             loss_fn_config=cfg).result()
    check_close("fwd_vs_fwdbwd", lp_of(fb), lp, TOL.fwd_vs_fwdbwd, loss_fn=loss_fn)
    want = _hand_rl_loss(loss_fn, lp_of(fb), old, adv, cfg)  # the formula on the pass's own logprobs
    assert fb.metrics["loss:sum"] == pytest.approx(want, rel=1e-4, abs=1e-4)


def test_two_d_soft_targets(svc):
    """[T, K] targets and weights (float and negative), dense and (where the SDK has it) CSR:
    [T, K] logprobs back, loss -sum(lp * w), column 0 the 1-D logprobs."""
    tc = new_client(svc, seed=22)
    n, K = len(SEQ) - 1, 3
    lp1 = lp_of(tc.forward([datum(SEQ)], "cross_entropy").result())
    tt = torch.tensor([[SEQ[t + 1], 100 + t, 7] for t in range(n)], dtype=torch.int64)
    w = torch.zeros((n, K), dtype=torch.float32)
    w[:, 0] = 0.75
    w[::2, 1] = -0.25
    encoders = [types.TensorData.from_torch]
    if hasattr(types.TensorData, "from_torch_sparse"):
        encoders.append(types.TensorData.from_torch_sparse)
    for enc in encoders:
        d = types.Datum(model_input=types.ModelInput.from_ints(SEQ[:-1]),
                        loss_fn_inputs={"target_tokens": enc(tt), "weights": enc(w)})
        out = tc.forward([d], "cross_entropy").result()
        lp2 = np.asarray(out.loss_fn_outputs[0]["logprobs"].tolist(), dtype=np.float64).reshape(n, K)
        check_close("repeat_logprob", lp2[:, 0], lp1, TOL.repeat_logprob, what="[T, K] column 0 vs 1-D targets")
        assert out.metrics["loss:sum"] == pytest.approx(float(-(lp2 * w.numpy()).sum()), rel=1e-4)


def test_zstd_bodies(svc, target):
    offered = httpx.post(f"{target[0]}/api/v1/client/config", json={"sdk_version": tinker.__version__},
                         headers={"X-API-Key": target[1]}).json().get("proto_compress_fwdbwd")
    if not offered:
        pytest.skip("the server does not offer zstd bodies (scripts/test-old-sdk.sh serves with OPENRL_PROTO_COMPRESS=1)")
    tc = new_client(svc, seed=23)
    holder = tc.holder
    cfg = holder.get_client_config() if hasattr(holder, "get_client_config") else holder._client_config
    assert cfg.proto_compress_fwdbwd is True  # what the SDK obeys: it zstd-compresses forward_backward bodies
    first = tc.forward_backward([datum(SEQ)], "cross_entropy").result().metrics["loss:sum"]
    tc.optim_step(types.AdamParams(learning_rate=LR)).result()
    assert tc.forward([datum(SEQ)], "cross_entropy").result().metrics["loss:sum"] < first


def test_capabilities_info_and_optimizer_state(svc):
    caps = svc.get_server_capabilities()
    assert any(m.model_name == BASE_MODEL and m.max_context_length for m in caps.supported_models)
    tc = new_client(svc, seed=24)
    assert tc.get_info().model_data.model_name == BASE_MODEL
    tok = tc.get_tokenizer()  # offline: get_info's tokenizer_id is a local directory
    assert tok.decode(tok.encode("hello world")) == "hello world"
    _train_once(tc)
    state = tc.save_state("opt").result().path
    # with the optimizer: one more identical step on the original and on each copy gives the same weights
    resumed = ready(svc.create_training_client_from_state_with_optimizer(state))
    fresh = new_client(svc, seed=25)
    fresh.load_state_with_optimizer(state).result()  # accepted as the run's first request
    for c in (tc, resumed, fresh):
        _train_once(c)
    want = lp_of(tc.forward([datum(SEQ)], "cross_entropy").result())
    for c in (resumed, fresh):
        check_close("save_load", lp_of(c.forward([datum(SEQ)], "cross_entropy").result()), want, TOL.save_load,
                    what="one more step after loading with the optimizer")


def test_snapshots_side_by_side_and_training_client_sampler(svc):
    """Two snapshots of one run sampled at once (off-policy RL), one through
    ``TrainingClient.create_sampling_client``: each scores the prompt as its own weights did."""
    tc = new_client(svc, seed=26)
    p1 = tc.save_weights_for_sampler("snap1").result().path
    lp_before = lp_of(tc.forward([datum(SEQ)], "cross_entropy").result())
    _train_once(tc)
    _train_once(tc)
    p2 = tc.save_weights_for_sampler("snap2").result().path
    lp_after = lp_of(tc.forward([datum(SEQ)], "cross_entropy").result())
    s1, s2 = ready(tc.create_sampling_client(p1)), ready(svc.create_sampling_client(model_path=p2))
    prompt = types.ModelInput.from_ints(SEQ)
    f1, f2 = s1.compute_logprobs(prompt), s2.compute_logprobs(prompt)
    check_sampler_trainer(f1.result()[1:], lp_before, what="snapshot 1 of 2")
    check_sampler_trainer(f2.result()[1:], lp_after, what="snapshot 2 of 2")
    assert not np.allclose(lp_before, lp_after, atol=1e-3)


def test_more_rest_methods(svc, rest):
    tc = new_client(svc, seed=27)
    state = tc.save_state("r1").result().path
    samp = tc.save_weights_for_sampler("r1").result().path
    run_id = state.split("/")[2]
    assert rest.get_training_run_by_tinker_path(state).result().training_run_id == run_id
    mine = rest.list_user_checkpoints(limit=1000).result().checkpoints
    assert {state, samp} <= {c.tinker_path for c in mine}
    session_id = run_id.split(":")[0]
    project = f"compat-{session_id[:8]}"
    rest.assign_session_project(session_id, project).result()
    in_project = {r.training_run_id for r in rest.list_training_runs(limit=100, project_id=project).result().training_runs}
    assert run_id in in_project and all(r.startswith(session_id + ":") for r in in_project)  # the session's runs
    sc = ready(svc.create_sampling_client(model_path=samp))
    sid = next(s for s in rest.get_session(session_id).result().sampler_ids)
    got = rest.get_sampler(sid).result()
    assert got.base_model == BASE_MODEL and sc.get_base_model() == BASE_MODEL
    ckpt_id = "/".join(samp.split("/")[3:])  # "sampler_weights/r1"
    rest.delete_checkpoint(run_id, ckpt_id).result()
    assert samp not in {c.tinker_path for c in rest.list_checkpoints(run_id).result().checkpoints}


def test_unsupported_rest_methods_fail_fast(rest):
    with pytest.raises(tinker.BadRequestError, match="not supported"):
        rest.get_audit_log().result(timeout=30)
    with pytest.raises(tinker.BadRequestError, match="not supported"):
        rest.get_billing_usage("2026-01-01", "2026-02-01").result(timeout=30)
    with pytest.raises(Exception, match="not supported|JWT"):
        rest.whoami().result(timeout=30)  # reads a JWT; this server uses plain API keys
