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
    """Every refusal in OpenAI's status and error object (the ``openai`` client's exception class,
    ``.type``, ``.code``, ``.param``), which client libraries branch on."""
    with pytest.raises(openai.AuthenticationError) as ei:
        openai.OpenAI(base_url=stack.base_url + "/v1", api_key="not-needed", max_retries=0).models.list()
    assert (ei.value.type, ei.value.code, ei.value.param) == ("invalid_request_error", "invalid_api_key", "Authorization")
    invalid, unsupported = "invalid_value", "unsupported_parameter"
    cases = [  # (request, exception, param, code)
        (dict(model="nope/no-such-model", prompt="hi"), openai.NotFoundError, "model", "model_not_found"),
        (dict(model="tinker://nope:train:0/sampler_weights/x", prompt="hi"), openai.NotFoundError, "model",
         "model_not_found"),
        (dict(model=BASE_MODEL, prompt="hi", presence_penalty=0.5), openai.BadRequestError, "presence_penalty",
         unsupported),
        (dict(model=BASE_MODEL, prompt="hi", suffix="!"), openai.BadRequestError, "suffix", unsupported),
        (dict(model=BASE_MODEL, prompt="hi", logprobs=50), openai.BadRequestError, "logprobs", invalid),
        (dict(model=BASE_MODEL, prompt="hi", max_tokens=10**6), openai.BadRequestError, "max_tokens", invalid),
        (dict(model=BASE_MODEL, prompt="hi", n=10**4), openai.BadRequestError, "n", invalid),
        (dict(model=BASE_MODEL, prompt="hi", extra_body={"min_p": 0.1}), openai.BadRequestError, "min_p",
         "unknown_parameter"),
    ]
    for kw, exc, fld, code in cases:
        with pytest.raises(exc) as ei:
            oai.completions.create(**kw)
        e = ei.value
        assert (e.param, e.code, e.type) == (fld, code, "invalid_request_error") and e.message, e.body
        assert e.status_code == (404 if exc is openai.NotFoundError else 400)
    with pytest.raises(openai.NotFoundError) as ei:
        oai.models.retrieve("nope/no-such-model")
    assert (ei.value.code, ei.value.param) == ("model_not_found", "model")
    chat = dict(model=BASE_MODEL, messages=[{"role": "user", "content": "hi"}])
    chat_cases = [
        (dict(chat, tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}]), "tools", unsupported),
        (dict(chat, response_format={"type": "json_object"}), "response_format", unsupported),
        (dict(chat, messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]),
         "messages[0].content[0]", unsupported),
        (dict(chat, messages=[]), "messages", invalid),
        (dict(chat, extra_body={"repetition_penalty": 1.1}), "repetition_penalty", "unknown_parameter"),
    ]
    for kw, fld, code in chat_cases:
        with pytest.raises(openai.BadRequestError) as ei:
            oai.chat.completions.create(**kw)
        assert (ei.value.param, ei.value.code, ei.value.type) == (fld, code, "invalid_request_error"), ei.value.body
    # a required parameter left out, and a path that does not exist, through the same client
    with pytest.raises(openai.BadRequestError) as ei:
        oai.post("/completions", body={"model": BASE_MODEL}, cast_to=object)
    assert (ei.value.param, ei.value.code) == ("prompt", "missing_required_parameter")
    with pytest.raises(openai.NotFoundError) as ei:
        oai.post("/no-such-route", body={}, cast_to=object)
    assert ei.value.type == "invalid_request_error" and ei.value.message
    # the docs/errors.md keys are there too, next to OpenAI's error object
    r = httpx.post(stack.base_url + "/v1/completions", json={"model": BASE_MODEL},
                   headers={"Authorization": f"Bearer {oai.api_key}"})
    body = r.json()
    assert r.status_code == 400 and body["field"] == "prompt" and body["category"] == "user"
    assert body["error"] == {"message": body["detail"], "type": "invalid_request_error", "param": "prompt",
                             "code": "missing_required_parameter"}


def test_an_assistant_message_sent_back_as_returned(oai, trained):
    """A client that appends the API's own assistant message (its ``refusal``, ``tool_calls`` ...
    keys null) to the conversation is answered; one with a tool call is refused naming it."""
    _, path = trained
    msgs = [{"role": "user", "content": "What is 2+2?"}]
    r = oai.chat.completions.create(model=path, messages=msgs, max_tokens=3, temperature=0)
    back = r.choices[0].message.model_dump()  # role, content, refusal, annotations, audio, function_call, tool_calls
    again = oai.chat.completions.create(model=path, messages=msgs + [back, {"role": "user", "content": "Sure?"}],
                                        max_tokens=3, temperature=0)
    assert again.choices[0].message.role == "assistant"
    back["tool_calls"] = [{"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]
    with pytest.raises(openai.BadRequestError) as ei:
        oai.chat.completions.create(model=path, messages=msgs + [back], max_tokens=3)
    assert (ei.value.param, ei.value.code) == ("messages[1].tool_calls", "unsupported_parameter")


def test_openai_error_objects_of_the_statuses_not_provoked_above():
    """429 (backpressure, a key's quota) and 5xx in OpenAI's types (no stack needed)."""
    from functions.gateway.errors import openai_error
    from functions.gateway.quotas import QuotaExceeded
    from openrl.errors import Overloaded, ServerError

    e = openai_error(429, {"detail": "full", "category": "server"}, Overloaded("full"))
    assert (e["type"], e["code"], e["param"]) == ("requests", "rate_limit_exceeded", None)
    q = QuotaExceeded("tokens_per_min", "over", retry_after=3)
    e = openai_error(429, {"detail": q.message, "field": q.field}, q)
    assert (e["type"], e["code"], e["param"]) == ("requests", "rate_limit_exceeded", "quota.tokens_per_min")
    e = openai_error(500, {"detail": "boom", "category": "server"}, ServerError("boom"))
    assert (e["type"], e["code"], e["message"]) == ("server_error", None, "boom")
