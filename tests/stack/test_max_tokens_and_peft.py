"""Through the real SDK and the embedded stack (the session's ``stack``: JetStream pull,
``file://`` storage): an omitted ``max_tokens`` generates until a stop or the context, never a
hidden 16 (issue 17 item 1), and ``<base>:peft:<context>`` model names (issue 13 item 5).

The model's context comes from ``get_server_capabilities`` (4,096 tokens for the offline
model, ``openrl/data/models.toml``); the server cap ``OPENRL_SAMPLER_MAX_TOKENS_CAP`` is left at
its default, 4,096. Nothing is mocked.
"""

from __future__ import annotations

import httpx
import pytest
import tinker
from tinker import types

BASE_MODEL = "Qwen/Qwen3-4B-Instruct-2507"
CAP = 4096


def _prompt(n: int) -> types.ModelInput:
    return types.ModelInput.from_ints([1000 + (7 * i) % 5000 for i in range(n)])


def _datum(n: int) -> types.Datum:
    toks = [1000 + (3 * i) % 5000 for i in range(n + 1)]
    return types.Datum(model_input=types.ModelInput.from_ints(toks[:-1]),
                       loss_fn_inputs={"target_tokens": toks[1:], "weights": [1.0] * n})


@pytest.fixture(scope="module")
def svc(stack, api_key):
    return tinker.ServiceClient(base_url=stack.base_url, api_key=api_key)


@pytest.fixture(scope="module")
def context(svc) -> int:
    """The base model's max_context_length (tokens), as the server reports it."""
    caps = svc.get_server_capabilities()
    return next(m.max_context_length for m in caps.supported_models if m.model_name == BASE_MODEL)


def test_capabilities_report_the_cap(svc, stack, api_key):
    caps = tinker.RestClient(base_url=stack.base_url, api_key=api_key).get_server_capabilities().result()
    assert any(m.model_name == BASE_MODEL for m in caps.supported_models)
    raw = httpx.get(stack.base_url + "/api/v1/get_server_capabilities", headers={"X-API-Key": api_key}).json()
    assert raw["max_tokens_cap"] == CAP


def test_omitted_max_tokens_runs_to_a_stop_and_reports_the_value(svc, stack, api_key, context):
    """max_tokens omitted: a seeded draw runs past 16 tokens to its stop token; the value the
    gateway used, min(cap, context - prompt), comes back in a header. (Running to the end of
    the context with no stop at all: ``test_peft_suffix_caps_the_run_context``, on a 64-token
    context, which keeps it fast on a CPU.)"""
    sampler = svc.create_sampling_client(base_model=BASE_MODEL).result()

    # until a stop: a seeded draw (the same seed draws the same tokens whatever max_tokens and
    # stop are) with stop=[t], t first drawn at position k > 16 of the reference run
    short = _prompt(12)
    ref = list(sampler.sample(short, 1, types.SamplingParams(max_tokens=64, temperature=1.0, seed=5, stop=[]))
               .result().sequences[0].tokens)
    firsts = {t: i for i, t in reversed(list(enumerate(ref)))}
    k = next(i for i in range(17, len(ref)) if firsts[ref[i]] == i)
    seq = sampler.sample(short, 1, types.SamplingParams(temperature=1.0, seed=5, stop=[ref[k]])).result().sequences[0]
    assert list(seq.tokens) == ref[:k + 1] and seq.stop_reason == "stop"

    # the response says what was used: header X-OpenRL-Max-Tokens (the SDK's SampleResponse has no field)
    body = {"sampling_session_id": sampler._sampling_session_id, "seq_id": 10**6, "num_samples": 1,
            "prompt": {"chunks": [{"type": "encoded_text", "tokens": short.to_ints()}]},
            "sampling_params": {"temperature": 1.0, "seed": 5, "stop": [ref[k]]}}  # ends after k + 1 tokens
    r = httpx.post(stack.base_url + "/api/v1/asample", json=body, headers={"X-API-Key": api_key}, timeout=60)
    assert r.status_code == 200, r.text
    assert r.headers["X-OpenRL-Max-Tokens"] == str(min(CAP, context - 12))
    assert r.headers["X-OpenRL-Max-Tokens-Cap"] == str(CAP)


def test_peft_suffix_caps_the_run_context(svc):
    """``<registered name>:peft:64``: the run trains on the registered model, datums and
    prompts are held to 64 tokens (400 naming the field), an omitted max_tokens fills the 64."""
    name = f"{BASE_MODEL}:peft:64"
    tc = svc.create_lora_training_client(base_model=name, rank=4, seed=0).result()
    assert tc.get_info().model_data.model_name == name
    out = tc.forward_backward([_datum(64)], "cross_entropy").result()
    assert out.metrics["loss:sum"] > 0
    with pytest.raises(tinker.BadRequestError) as ei:
        tc.forward_backward([_datum(65)], "cross_entropy").result()
    assert "data[0].model_input" in str(ei.value) and "64" in str(ei.value)
    tc.optim_step(types.AdamParams(learning_rate=1e-3)).result()

    sampler = tc.save_weights_and_get_sampling_client().result()
    seq = sampler.sample(_prompt(10), 1, types.SamplingParams(temperature=0.0, stop=[])).result().sequences[0]
    assert len(seq.tokens) == 54 and seq.stop_reason == "length"
    with pytest.raises(tinker.BadRequestError) as ei:
        sampler.sample(_prompt(10), 1, types.SamplingParams(max_tokens=55)).result()
    assert "sampling_params.max_tokens" in str(ei.value)
    with pytest.raises(tinker.BadRequestError) as ei:
        sampler.sample(_prompt(64), 1, types.SamplingParams(max_tokens=1)).result()
    assert "prompt" in str(ei.value)
    base = svc.create_sampling_client(base_model=name).result()
    assert base.get_base_model() == name


@pytest.mark.parametrize("suffix, words", [(":peft:abc", "positive integer"), (":peft:0", "positive integer"),
                                           (":peft:{above}", "at most {context}")])
def test_bad_peft_suffix_is_a_400_naming_base_model(svc, context, suffix, words):
    suffix, words = suffix.format(above=context + 1), words.format(context=context)
    with pytest.raises(tinker.BadRequestError) as ei:
        svc.create_lora_training_client(base_model=BASE_MODEL + suffix, rank=4).result()
    assert "base_model" in str(ei.value) and words in str(ei.value), str(ei.value)
