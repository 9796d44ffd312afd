"""SDK-version compatibility subset: the calls a Tinker user makes, written so that the same
file runs under the pinned ``tinker`` (0.38.0) and under older protobuf-era releases (e.g.
0.25.0). The server code is the same for every SDK version.

Two ways to run it:

* in the main suite (``pytest tests/stack/test_compat_sdk.py``): against the session's embedded
  ``stack`` fixture, with the SDK of the main venv;
* from ``scripts/test-old-sdk.sh VERSION``: a second venv holds ``tinker==VERSION`` (and no
  openrl); the script starts ``openrl serve`` from the main venv and runs this file with
  ``pytest --noconftest`` and ``OPENRL_COMPAT_BASE_URL`` / ``OPENRL_COMPAT_API_KEY`` set.

So this file imports nothing from openrl or conftest (only tests/tolerances.py, which needs
nothing else), and uses fixed token ids (no tokenizer).
Differences between SDK versions are bridged by :func:`ready` (0.38 returns futures of clients
where 0.25 returns the clients) and by feature checks (``hasattr``), never by version numbers.
"""

from __future__ import annotations

import json
import math
import os
import tarfile
import io
import sys
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import tinker
from tinker import types

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ (not on sys.path with --noconftest)
from tolerances import TOL, check_close, check_loss, check_sampler_trainer  # noqa: E402

BASE_MODEL = "Qwen/Qwen3-4B-Instruct-2507"
SEQ = [9707, 1879, 11, 419, 374, 264, 1273, 315, 279, 11691, 9128, 13, 576, 3974, 13876, 38835]
LR = 1e-2


@pytest.fixture(scope="module")
def target(request) -> tuple[str, str]:
    """(base_url, api_key): the external stack named by the environment, else the ``stack`` fixture."""
    url = os.environ.get("OPENRL_COMPAT_BASE_URL")
    if url:
        return url, os.environ["OPENRL_COMPAT_API_KEY"]
    stack = request.getfixturevalue("stack")
    return stack.base_url, stack.api_key


@pytest.fixture(scope="module")
def svc(target):
    return tinker.ServiceClient(base_url=target[0], api_key=target[1])


@pytest.fixture(scope="module")
def rest(svc):
    return svc.create_rest_client()


def ready(x):
    """The client itself: 0.38 returns futures from client-creating calls, 0.25 the clients."""
    return x.result() if hasattr(type(x), "result") else x


def new_client(svc, seed: int):
    return ready(svc.create_lora_training_client(base_model=BASE_MODEL, rank=4, seed=seed))


def datum(tokens, **inputs) -> types.Datum:
    fn_inputs = {"target_tokens": tokens[1:], **inputs}
    if not inputs:
        fn_inputs["weights"] = [1.0] * (len(tokens) - 1)
    return types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]), loss_fn_inputs=fn_inputs)


def lp_of(out, i: int = 0) -> np.ndarray:
    return np.asarray(out.loss_fn_outputs[i]["logprobs"].tolist(), dtype=np.float64)


def test_version_under_test():
    print(f"tinker SDK {tinker.__version__}")
    assert tinker.__version__


def test_train_then_sample_matches_training_logprobs(svc):
    tc = new_client(svc, seed=1)
    first = tc.forward_backward([datum(SEQ)], "cross_entropy").result().metrics["loss:sum"]
    tc.optim_step(types.AdamParams(learning_rate=LR)).result()
    out = tc.forward([datum(SEQ)], "cross_entropy").result()
    assert out.metrics["loss:sum"] < first
    sc = ready(tc.save_weights_and_get_sampling_client())
    res = sc.sample(types.ModelInput.from_ints(SEQ), 1, types.SamplingParams(max_tokens=4, temperature=0.0),
                    include_prompt_logprobs=True, topk_prompt_logprobs=3).result()
    got = np.asarray(res.prompt_logprobs[1:], dtype=np.float64)
    check_sampler_trainer(got, lp_of(out), what="prompt_logprobs with topk")
    assert res.prompt_logprobs[0] is None and len(res.topk_prompt_logprobs[1]) == 3
    assert 1 <= len(res.sequences[0].tokens) <= 4
    check_sampler_trainer(sc.compute_logprobs(types.ModelInput.from_ints(SEQ)).result()[1:], lp_of(out),
                          what="compute_logprobs")


@pytest.mark.parametrize("loss_fn,cfg", [("importance_sampling", None), ("ppo", {"clip_low_threshold": 0.9,
                                                                                  "clip_high_threshold": 1.1})])
def test_rl_losses(svc, loss_fn, cfg):
    tc = new_client(svc, seed=2)
    n = len(SEQ) - 1
    lp = lp_of(tc.forward([datum(SEQ)], "cross_entropy").result())
    old = (lp + np.linspace(-0.3, 0.3, n)).astype(np.float32).astype(np.float64)
    adv = np.linspace(-1, 1, n).astype(np.float32).astype(np.float64)
    fb = tc.forward_backward([datum(SEQ, logprobs=old.tolist(), advantages=adv.tolist())], loss_fn,
                             loss_fn_config=cfg).result()
    check_close("fwd_vs_fwdbwd", lp_of(fb), lp, TOL.fwd_vs_fwdbwd, loss_fn=loss_fn)
    r = np.exp(lp_of(fb) - old)  # the formula on the pass's own logprobs
    if loss_fn == "ppo":
        want = -np.minimum(r * adv, np.clip(r, 0.9, 1.1) * adv).sum()
    else:
        want = -(r * adv).sum()
    assert fb.metrics["loss:sum"] == pytest.approx(float(want), rel=1e-4, abs=1e-4)


def test_custom_loss(svc):
    tc = new_client(svc, seed=3)

    def loss(data, logprobs):
        total = sum((-lp).sum() for lp in logprobs)
        return total, {"nll": float(total)}

    out = tc.forward_backward_custom([datum(SEQ)], loss).result()
    ce = tc.forward([datum(SEQ)], "cross_entropy").result().metrics["loss:sum"]
    # the custom loss's own forward vs this forward: the same datum and weights
    check_loss("repeat_logprob", out.metrics["nll"], ce, TOL.repeat_logprob, len(SEQ) - 1)


def test_checkpoints_resume_and_rest(svc, rest):
    tc = new_client(svc, seed=4)
    tc.forward_backward([datum(SEQ)], "cross_entropy")
    tc.optim_step(types.AdamParams(learning_rate=LR)).result()
    want = lp_of(tc.forward([datum(SEQ)], "cross_entropy").result())
    state = tc.save_state("c1").result().path
    samp = tc.save_weights_for_sampler("c1").result().path
    resumed = ready(svc.create_training_client_from_state(state))
    check_close("save_load", lp_of(resumed.forward([datum(SEQ)], "cross_entropy").result()), want, TOL.save_load)
    fresh = new_client(svc, seed=5)
    fresh.load_state(state).result()  # accepted as the run's first request
    check_close("save_load", lp_of(fresh.forward([datum(SEQ)], "cross_entropy").result()), want, TOL.save_load,
                what="load_state into a new run")
    run_id = state.split("/")[2]
    cps = rest.list_checkpoints(run_id).result().checkpoints
    assert [c.tinker_path for c in cps] == [samp, state]  # newest first
    run = rest.get_training_run(run_id).result()
    assert run.base_model == BASE_MODEL and run.last_checkpoint.tinker_path == state
    assert rest.get_weights_info_by_tinker_path(state).result().lora_rank == 4
    rest.publish_checkpoint_from_tinker_path(samp).result()
    assert next(c for c in rest.list_checkpoints(run_id).result().checkpoints if c.tinker_path == samp).public
    rest.unpublish_checkpoint_from_tinker_path(samp).result()
    rest.set_checkpoint_ttl_from_tinker_path(samp, 3600).result()
    assert next(c for c in rest.list_checkpoints(run_id).result().checkpoints if c.tinker_path == samp).expires_at
    page = rest.list_training_runs(limit=1).result()
    assert page.cursor.total_count >= 1 and len(page.training_runs) == 1
    assert run_id.split(":")[0] in rest.list_sessions(limit=100).result().sessions
    assert run_id in rest.get_session(run_id.split(":")[0]).result().training_run_ids
    # the weights can be downloaded: external-weights URLs (new SDKs) or a checkpoint archive (old)
    if hasattr(tc, "save_weights_external"):
        ext = tc.save_weights_external("x1").result().path
        urls = rest.get_external_weights_urls(ext).result().urls
        cfg = json.loads(urllib.request.urlopen(urls["adapter_config.json"]).read())
    else:
        url = rest.get_checkpoint_archive_url_from_tinker_path(samp).result().url
        with tarfile.open(fileobj=io.BytesIO(urllib.request.urlopen(url).read())) as tar:
            assert {"adapter_model.safetensors", "adapter_config.json"} <= set(tar.getnames())
            cfg = json.loads(tar.extractfile("adapter_config.json").read())
    assert cfg["r"] == 4
    rest.delete_checkpoint_from_tinker_path(samp).result()
    assert samp not in {c.tinker_path for c in rest.list_checkpoints(run_id).result().checkpoints}


def test_sampling_sessions(svc, rest):
    base = ready(svc.create_sampling_client(base_model=BASE_MODEL))
    out = base.sample(types.ModelInput.from_ints(SEQ[:4]), 2, types.SamplingParams(max_tokens=3, seed=1)).result()
    assert len(out.sequences) == 2
    tc = new_client(svc, seed=6)
    path = tc.save_weights_for_sampler("s1").result().path
    sc = ready(svc.create_sampling_client(model_path=path))
    assert sc.get_base_model() == BASE_MODEL
    lp = sc.compute_logprobs(types.ModelInput.from_ints(SEQ)).result()
    assert lp[0] is None and all(math.isfinite(x) for x in lp[1:])


def test_session_trace_export(svc, rest):
    """export_session_trace (same poll protocol since 0.25): a key-less URL of the session's
    timeline, with a slice per request of its training run."""
    tc = new_client(svc, seed=7)
    tc.forward_backward([datum(SEQ)], "cross_entropy").result()
    url = rest.export_session_trace(tc.model_id.split(":")[0]).result()
    doc = json.loads(urllib.request.urlopen(url).read())
    ops = {e["name"] for e in doc["traceEvents"] if e["ph"] == "X"}
    assert {"create_model", "forward_backward"} <= ops, ops


def test_bad_input_is_a_clear_user_error(svc):
    tc = new_client(svc, seed=7)
    bad = types.Datum(model_input=types.ModelInput.from_ints([10**7, 1]),
                      loss_fn_inputs={"target_tokens": [1, 2], "weights": [1.0, 1.0]})
    with pytest.raises(Exception, match="vocabulary") as e:
        tc.forward_backward([bad], "cross_entropy").result()
    assert "400" in str(e.value) or "user" in str(getattr(e.value, "category", "")).lower()
    assert math.isfinite(tc.forward([datum(SEQ)], "cross_entropy").result().metrics["loss:sum"])


def test_several_samples_with_topk_prompt_logprobs_answer(svc):
    """num_samples=2 with prompt logprobs and their top-K: both sequences and one set of prompt
    logprobs come back (on the H200 this request once got no answer within 60 s while other
    requests shared the vLLM batch; the vLLM backend now sends one request per sample)."""
    tc = new_client(svc, seed=2)
    sc = ready(tc.save_weights_and_get_sampling_client())
    res = sc.sample(types.ModelInput.from_ints(SEQ), 2, types.SamplingParams(max_tokens=4, temperature=1.0),
                    include_prompt_logprobs=True, topk_prompt_logprobs=3).result(timeout=120)
    assert len(res.sequences) == 2 and all(1 <= len(s.tokens) <= 4 for s in res.sequences)
    assert res.prompt_logprobs[0] is None and len(res.prompt_logprobs) == len(SEQ)
    assert all(len(row) == 3 for row in res.topk_prompt_logprobs[1:])
