"""The OpenAI-compatible endpoint (functions/gateway/routes_openai.py) through the real
``openai`` client against the embedded stack: models, completions, chat completions (plain and
streamed), logprobs, n, seed, stop, a trained snapshot as the model, and clear refusals."""

from __future__ import annotations

import math

import httpx
import numpy as np
import openai
import pytest
import tinker
from tinker import types

from conftest import BASE_MODEL

SEQ = [9707, 1879, 11, 419, 374, 264, 1273, 315, 279, 11691, 9128, 13]


@pytest.fixture(scope="module")
def oai(stack, api_key):
    return openai.OpenAI(base_url=stack.base_url + "/v1", api_key=api_key, max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def svc(stack, api_key):
    return tinker.ServiceClient(base_url=stack.base_url, api_key=api_key)


@pytest.fixture(scope="module")
def trained(svc):
    """A run trained a few steps on SEQ, and its sampler snapshot's path."""
    tc = svc.create_lora_training_client(base_model=BASE_MODEL, rank=4, seed=0).result()
    d = types.Datum(model_input=types.ModelInput.from_ints(SEQ[:-1]),
                    loss_fn_inputs={"target_tokens": SEQ[1:], "weights": [1.0] * (len(SEQ) - 1)})
    for _ in range(3):
        tc.forward_backward([d], "cross_entropy")
        tc.optim_step(types.AdamParams(learning_rate=5e-2)).result()
    return tc, tc.save_weights_for_sampler("oai").result().path


def test_models_lists_base_models_and_the_callers_snapshots(oai, trained):
    _, path = trained
    ids = [m.id for m in oai.models.list().data]
    assert BASE_MODEL in ids and path in ids
    assert oai.models.retrieve(BASE_MODEL).id == BASE_MODEL
    assert oai.models.retrieve(path).id == path


def test_completion_greedy_matches_the_sdk_sampler(oai, svc, trained):
    tc, path = trained
    for model in (BASE_MODEL, path):
        r = oai.completions.create(model=model, prompt=SEQ[:5], max_tokens=6, temperature=0, logprobs=3)
        sdk = svc.create_sampling_client(model_path=path) if model == path else \
            svc.create_sampling_client(base_model=BASE_MODEL)
        s = sdk.sample(types.ModelInput.from_ints(SEQ[:5]), 1, types.SamplingParams(max_tokens=6, temperature=0.0)).result()
        tok = tc.get_tokenizer()
        c = r.choices[0]
        assert r.usage.prompt_tokens == 5 and r.usage.completion_tokens == len(s.sequences[0].tokens)
        assert c.text == tok.decode(s.sequences[0].tokens, skip_special_tokens=True)
        assert c.logprobs.token_logprobs == pytest.approx(s.sequences[0].logprobs, abs=1e-5)
        assert len(c.logprobs.top_logprobs) == len(c.logprobs.tokens) and all(len(t) <= 3 for t in c.logprobs.top_logprobs)
        # greedy: each token is the top-1 of its row
        for lp, top in zip(c.logprobs.token_logprobs, c.logprobs.top_logprobs):
            assert lp == pytest.approx(max(top.values()), abs=1e-5)
        assert c.finish_reason in ("stop", "length")


def test_completion_text_prompts_n_seed_and_echo_scores(oai, trained):
    tc, path = trained
    tok = tc.get_tokenizer()
    r = oai.completions.create(model=path, prompt=["Hello world", "The answer is"], max_tokens=4, n=2, seed=11,
                               temperature=1.0)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    again = oai.completions.create(model=path, prompt=["Hello world", "The answer is"], max_tokens=4, n=2, seed=11,
                                   temperature=1.0)
    assert [c.text for c in r.choices] == [c.text for c in again.choices]  # seed: the same draws
    # echo + max_tokens=0: the prompt's own logprobs, as lm-eval's loglikelihood asks them,
    # equal the SDK's compute_logprobs of the same snapshot
    ids = tok.encode("Hello world, this is", add_special_tokens=False)
    e = oai.completions.create(model=path, prompt=ids, max_tokens=0, echo=True, logprobs=1)
    lp = e.choices[0].logprobs
    assert lp.tokens == [tok.decode([i]) for i in ids] and lp.token_logprobs[0] is None
    want = tc.create_sampling_client(path).compute_logprobs(types.ModelInput.from_ints(ids)).result()
    assert lp.token_logprobs[1:] == pytest.approx(want[1:], abs=1e-5)
    assert e.choices[0].text == tok.decode(ids) and e.usage.completion_tokens == 0


def test_stop_strings_are_cut_from_the_text(oai, trained):
    tc, path = trained
    tok = tc.get_tokenizer()
    free = oai.completions.create(model=path, prompt=SEQ[:5], max_tokens=8, temperature=0)
    text = free.choices[0].text
    if len(text) < 3:
        pytest.skip(f"the greedy completion {text!r} is too short to hold a stop string")
    stop = text[1:3]
    cut = oai.completions.create(model=path, prompt=SEQ[:5], max_tokens=8, temperature=0, stop=[stop])
    assert cut.choices[0].text == text[: text.find(stop)] and cut.choices[0].finish_reason == "stop"
    assert tok is not None


def test_chat_completion_plain_and_streamed(oai, trained):
    tc, path = trained
    msgs = [{"role": "system", "content": "You are helpful."}, {"role": "user", "content": "What is 2+2?"}]
    r = oai.chat.completions.create(model=path, messages=msgs, max_tokens=6, temperature=0, logprobs=True,
                                    top_logprobs=2)
    c = r.choices[0]
    assert c.message.role == "assistant" and r.usage.completion_tokens > 0
    assert len(c.logprobs.content) == r.usage.completion_tokens
    assert all(len(t.top_logprobs) == 2 and math.isfinite(t.logprob) for t in c.logprobs.content)
    # the prompt is the chat template's: the SDK sampling the same tokens greedily agrees
    tok = tc.get_tokenizer()
    prompt = tok.encode(tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True), add_special_tokens=False)
    assert r.usage.prompt_tokens == len(prompt)
    s = tc.create_sampling_client(path).sample(types.ModelInput.from_ints(prompt), 1,
                                               types.SamplingParams(max_tokens=6, temperature=0.0)).result()
    assert c.message.content == tok.decode(s.sequences[0].tokens, skip_special_tokens=True)
    chunks = list(oai.chat.completions.create(model=path, messages=msgs, max_tokens=6, temperature=0, stream=True,
                                              stream_options={"include_usage": True}))
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == c.message.content
    assert chunks[-1].usage.completion_tokens == r.usage.completion_tokens
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason] == [c.finish_reason]


def test_refusals_name_the_field(oai, stack):
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=stack.base_url + "/v1", api_key="not-needed", max_retries=0).models.list()
    cases = [
        (dict(model="nope/no-such-model", prompt="hi"), openai.BadRequestError, "model"),
        (dict(model="tinker://nope:train:0/sampler_weights/x", prompt="hi"), openai.NotFoundError, "model"),
        (dict(model=BASE_MODEL, prompt="hi", presence_penalty=0.5), openai.BadRequestError, "presence_penalty"),
        (dict(model=BASE_MODEL, prompt="hi", logprobs=50), openai.BadRequestError, "logprobs"),
        (dict(model=BASE_MODEL, prompt="hi", max_tokens=10**6), openai.BadRequestError, "max_tokens"),
        (dict(model=BASE_MODEL, prompt="hi", n=10**4), openai.BadRequestError, "n"),
    ]
    for kw, exc, fld in cases:
        with pytest.raises(exc) as ei:
            oai.completions.create(**kw)
        assert ei.value.body["param"] == fld and ei.value.body["message"], ei.value.body
    with pytest.raises(openai.BadRequestError) as ei:
        oai.chat.completions.create(model=BASE_MODEL, messages=[{"role": "user", "content": "hi"}],
                                    tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}])
    assert ei.value.body["param"] == "tools"
    # the docs/errors.md shape is there too
    r = httpx.post(stack.base_url + "/v1/completions", json={"model": BASE_MODEL},
                   headers={"Authorization": f"Bearer {oai.api_key}"})
    assert r.status_code == 400 and r.json()["field"] == "prompt" and r.json()["category"] == "user"
