"""Sampler engine + transformers backend on a tiny random Qwen3 (CPU, seconds)."""

from __future__ import annotations

import asyncio
import math
import random
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import transformers

from functions.sampler.engine import (
    TOPK_MASK_LOGPROB,
    SamplerBackend,
    SamplerEngine,
)
from functions.sampler.backends.hf import HFBackend
from openrl.errors import ServerError, UserError
from openrl.model.lora import LoraSpec, MultiLoRAModel, save_peft_adapter
from openrl.model.logprobs import target_logprobs

from micro_model import write_micro_qwen3  # tests/micro_model.py
from openrl.contract.payloads import Sample
from sample_jobs import changed, sample_job, unchecked_job  # tests/sample_jobs.py

VOCAB = 512
EOS = 0  # "<|endoftext|>" is the tokenizer's first (special) token

# --------------------------------------------------------------------------- fixtures


def _build_tokenizer(directory: Path) -> None:
    """A real byte-level BPE tokenizer with exactly VOCAB tokens, trained offline."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    rng = random.Random(0)
    alpha = "abcdefghijklmnopqrstuvwxyz0123456789 .,\n"
    corpus = ["".join(rng.choice(alpha) for _ in range(200)) for _ in range(400)]
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer)
    assert tok.get_vocab_size() == VOCAB
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>")
    fast.save_pretrained(str(directory))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    """The unit tests' micro model (tests/unit/conftest.py), untied, 128-token context, a sharp
    head (fewer near-ties), with a real tokenizer."""
    d = write_micro_qwen3(tmp_path_factory.mktemp("tiny-qwen3"), max_positions=128, tie=False,
                          sharp_head=True, eos_token_id=EOS)
    _build_tokenizer(d)
    return d


def _make_adapter(model_dir: Path, out: Path, seed: int) -> Path:
    base = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir))
    m = MultiLoRAModel(base)
    m.add_adapter("a", LoraSpec(rank=4, seed=seed))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in m.named_adapter_parameters("a"):
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    save_peft_adapter(m, "a", out)
    return out


@pytest.fixture(scope="module")
def adapter_dirs(model_dir, tmp_path_factory) -> list[Path]:
    root = tmp_path_factory.mktemp("adapters")
    return [_make_adapter(model_dir, root / f"ad{i}", seed=10 + i) for i in range(3)]


def _engine(model_dir: Path, **kw) -> SamplerEngine:
    return SamplerEngine(model_dir, backend="hf", **kw)


def _greedy_reference(model_dir: Path, prompt: list[int], n: int) -> list[int]:
    """Plain greedy loop: full forward each step, no cache, no batching."""
    m = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir)).eval()
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            logits = m(input_ids=torch.tensor([ids])).logits[0, -1]
            ids.append(int(logits.argmax()))
    return ids[len(prompt) :]


PROMPTS = [[5, 17, 33, 101, 7, 250, 11], [300, 2], [42, 43, 44, 45]]


def _greedy(prompt, n=6, **kw) -> Sample:
    return sample_job(list(prompt), max_tokens=n, temperature=0.0, stop=[], **kw)


# --------------------------------------------------------------------------- tests


async def test_backend_satisfies_protocol(model_dir):
    eng = _engine(model_dir)
    assert isinstance(eng.backend, HFBackend)
    assert isinstance(eng.backend, SamplerBackend)
    assert eng.limits.vocab_size == VOCAB and eng.limits.max_context == 128
    assert EOS in eng.limits.eos_token_ids and eng.limits.has_tokenizer
    await eng.close()


async def test_greedy_matches_uncached_loop(model_dir):
    eng = _engine(model_dir)
    for prompt in PROMPTS:
        res = await eng.sample(_greedy(prompt, n=8))
        (seq,) = res.sequences
        assert seq.tokens == _greedy_reference(model_dir, prompt, 8)
        assert seq.stop_reason == "length" and len(seq.logprobs) == 8
        assert res.prompt_logprobs is None and seq.topk is None
    await eng.close()


async def test_concurrent_jobs_batch_and_match_solo(model_dir):
    eng = _engine(model_dir)
    solo = [(await eng.sample(_greedy(p))).sequences[0] for p in PROMPTS]
    solo_steps = eng.backend.steps
    together = await asyncio.gather(*(eng.sample(_greedy(p)) for p in PROMPTS))
    batched_steps = eng.backend.steps - solo_steps
    for s, t in zip(solo, together):
        assert t.sequences[0].tokens == s.tokens
        torch.testing.assert_close(t.sequences[0].logprobs, s.logprobs, atol=1e-5, rtol=0)
    # one prefill + 5 decodes for all three, instead of 3 x (1 + 5)
    assert batched_steps == 6 < solo_steps
    await eng.close()


async def test_continuous_batching_late_joiner(model_dir):
    eng = _engine(model_dir)
    alone = (await eng.sample(_greedy(PROMPTS[1], n=5))).sequences[0].tokens
    long_job = asyncio.ensure_future(eng.sample(_greedy(PROMPTS[0], n=30)))
    while eng.backend.steps < 4:  # let the first job start decoding
        await asyncio.sleep(0.001)
    late = await eng.sample(_greedy(PROMPTS[1], n=5))
    assert not long_job.done()  # it joined a running batch and left it first
    assert late.sequences[0].tokens == alone
    long = (await long_job).sequences[0]
    assert long.tokens == _greedy_reference(model_dir, PROMPTS[0], 30)
    await eng.close()


async def test_seeds(model_dir):
    eng = _engine(model_dir)
    job = sample_job(PROMPTS[0], num_samples=3, max_tokens=8, temperature=1.0, seed=7, stop=[])
    a = await eng.sample(job)
    b = await eng.sample(job)
    assert [s.tokens for s in a.sequences] == [s.tokens for s in b.sequences]
    assert len({tuple(s.tokens) for s in a.sequences}) > 1  # samples differ from each other
    # same seed, batched with other jobs -> same samples
    others = [sample_job(p, num_samples=2, max_tokens=5, temperature=0.8, top_k=20, seed=1) for p in PROMPTS]
    c, *_ = await asyncio.gather(eng.sample(job), *(eng.sample(o) for o in others))
    assert [s.tokens for s in c.sequences] == [s.tokens for s in a.sequences]
    d = await eng.sample(changed(job, seed=8))
    assert [s.tokens for s in d.sequences] != [s.tokens for s in a.sequences]
    # no seed: still valid, independent draws
    e = await eng.sample(changed(job, seed=None))
    assert all(len(s.tokens) == 8 for s in e.sequences)
    await eng.close()


async def test_top_k_one_and_tiny_top_p_are_greedy(model_dir):
    eng = _engine(model_dir)
    greedy = (await eng.sample(_greedy(PROMPTS[0], n=6))).sequences[0].tokens
    for kw in ({"top_k": 1}, {"top_p": 1e-6}):
        job = sample_job(PROMPTS[0], max_tokens=6, temperature=1.5, seed=3, stop=[], num_samples=2, **kw)
        res = await eng.sample(job)
        assert all(s.tokens == greedy for s in res.sequences), kw
    # top_k=5: every sampled token is among the 5 most likely
    job = sample_job(PROMPTS[0], max_tokens=6, temperature=2.0, seed=3, stop=[], top_k=5, topk_sample_logprobs=5)
    seq = (await eng.sample(job)).sequences[0]
    assert all(t in ids for t, ids in zip(seq.tokens, seq.topk[0]))
    await eng.close()


async def test_sampled_logprobs_match_trainer_numerics(model_dir, adapter_dirs):
    eng = _engine(model_dir)
    await eng.ensure_adapter("ad0", adapter_dirs[0])
    for adapter in (None, "ad0"):
        job = sample_job(PROMPTS[0], num_samples=2, max_tokens=10, temperature=1.0, seed=5, stop=[],
                        prompt_logprobs=True, adapter=adapter)
        res = await eng.sample(job)
        P = len(job.prompt_tokens)
        for seq in res.sequences:
            full = job.prompt_tokens + seq.tokens
            ids = torch.tensor([full[:-1]])
            tgt = torch.tensor([full[1:]])
            with torch.no_grad():
                ref = target_logprobs(eng.backend.model, ids, tgt, None, [adapter])[0]
            torch.testing.assert_close(torch.tensor(seq.logprobs), ref[P - 1 :], atol=1e-4, rtol=0)
            assert math.isnan(res.prompt_logprobs[0])
            torch.testing.assert_close(torch.tensor(res.prompt_logprobs[1:]), ref[: P - 1], atol=1e-4, rtol=0)
    await eng.close()


async def test_prompt_logprobs_last_n_and_topk(model_dir):
    eng = _engine(model_dir)
    P = len(PROMPTS[0])
    full = await eng.sample(sample_job(PROMPTS[0], max_tokens=1, prompt_logprobs=True, topk_prompt_logprobs=3))
    assert len(full.prompt_logprobs) == P and math.isnan(full.prompt_logprobs[0])
    assert not any(math.isnan(x) for x in full.prompt_logprobs[1:])
    ids, lps = full.topk_prompt
    assert len(ids) == P and all(len(r) == 3 for r in ids)
    assert ids[0] == [0, 0, 0] and lps[0] == [TOPK_MASK_LOGPROB] * 3
    for t in range(1, P):
        assert lps[t] == sorted(lps[t], reverse=True)
        assert lps[t][0] >= full.prompt_logprobs[t] - 1e-6
    last = await eng.sample(
        sample_job(PROMPTS[0], max_tokens=1, prompt_logprobs=True, topk_prompt_logprobs=3, prompt_logprobs_last_n=2)
    )
    assert all(math.isnan(x) for x in last.prompt_logprobs[: P - 2])
    assert last.prompt_logprobs[P - 2 :] == pytest.approx(full.prompt_logprobs[P - 2 :], abs=1e-6)
    assert last.topk_prompt[1][P - 3] == [TOPK_MASK_LOGPROB] * 3
    assert last.topk_prompt[0][P - 1] == ids[P - 1]
    await eng.close()


async def test_topk_sample_logprobs(model_dir):
    eng = _engine(model_dir)
    seq = (await eng.sample(_greedy(PROMPTS[2], n=4, topk_sample_logprobs=4))).sequences[0]
    ids, lps = seq.topk
    assert len(ids) == len(lps) == 4 and all(len(r) == 4 for r in ids)
    for t, tok in enumerate(seq.tokens):  # greedy: the drawn token is the top-1
        assert ids[t][0] == tok and lps[t][0] == pytest.approx(seq.logprobs[t], abs=1e-6)
    await eng.close()


async def test_target_prompt_ids_and_alt_tokens(model_dir):
    eng = _engine(model_dir)
    p = PROMPTS[0]
    tgt = [[-1, -1] for _ in range(len(p) - 1)]
    tgt[2] = [p[3], 9]
    res = await eng.sample(sample_job(p, max_tokens=1, prompt_logprobs=True, target_prompt_ids=tgt,
                                     prompt_alt_tokens_k=2, seed=1))
    assert res.target_prompt_logprobs[0] == [0.0, 0.0]
    assert res.target_prompt_logprobs[2][0] == pytest.approx(res.prompt_logprobs[3], abs=1e-6)
    alt_ids, alt_lps = res.prompt_alt_tokens
    assert len(alt_ids) == len(p) - 1 and all(len(r) == 2 for r in alt_ids)
    assert all(x <= 0 for r in alt_lps for x in r)
    await eng.close()


async def test_stop_token_ids_and_eos(model_dir):
    eng = _engine(model_dir)
    toks = (await eng.sample(_greedy(PROMPTS[0], n=10))).sequences[0].tokens
    i = 3
    stop_id = toks[i]
    first = toks.index(stop_id)
    seq = (await eng.sample(changed(_greedy(PROMPTS[0], n=10), stop=[stop_id]))).sequences[0]
    assert seq.tokens == toks[: first + 1] and seq.stop_reason == "stop"

    # EOS: stop=None stops at EOS; stop=[] ignores it. Make the greedy token an EOS id.
    backend = HFBackend(model_dir)
    backend.limits = replace(backend.limits, eos_token_ids=frozenset({stop_id}))
    eng2 = SamplerEngine(model_dir, backend=backend)
    seq = (await eng2.sample(sample_job(PROMPTS[0], max_tokens=10, temperature=0.0))).sequences[0]
    assert seq.tokens == toks[: first + 1] and seq.stop_reason == "stop"
    seq = (await eng2.sample(sample_job(PROMPTS[0], max_tokens=10, temperature=0.0, stop=[]))).sequences[0]
    assert seq.tokens == toks and seq.stop_reason == "length"
    # stop strings keep EOS stopping too
    seq = (await eng2.sample(sample_job(PROMPTS[0], max_tokens=10, temperature=0.0, stop=["\x00never"]))).sequences[0]
    assert seq.tokens == toks[: first + 1] and seq.stop_reason == "stop"
    await eng.close()
    await eng2.close()


async def test_stop_strings(model_dir):
    eng = _engine(model_dir)
    tok = eng.backend.tokenizer
    toks = (await eng.sample(_greedy(PROMPTS[0], n=12))).sequences[0].tokens
    texts = [tok.decode(toks[:n]) for n in range(len(toks) + 1)]
    # a stop string completed by the 5th token: its last 2 characters
    stop = texts[5][-2:]
    assert stop.strip() != ""
    n = next(n for n in range(1, len(toks) + 1) if stop in texts[n])
    res = await eng.sample(changed(_greedy(PROMPTS[0], n=12), stop=[stop]))
    seq = res.sequences[0]
    assert seq.tokens == toks[:n] and seq.stop_reason == "stop"
    assert stop in tok.decode(seq.tokens)  # the stop string is kept in the output
    await eng.close()


async def test_max_tokens_default_and_length(model_dir):
    eng = _engine(model_dir, max_tokens_default=3)
    seq = (await eng.sample(sample_job(PROMPTS[1], temperature=0.0, stop=[]))).sequences[0]
    assert len(seq.tokens) == 3 and seq.stop_reason == "length"
    # default is capped at the room left in the context (128)
    seq = (await eng.sample(sample_job([1] * 126, temperature=0.0, stop=[]))).sequences[0]
    assert len(seq.tokens) == 2
    await eng.close()


async def test_adapters_rows_differ_and_match_single_runs(model_dir, adapter_dirs):
    eng = _engine(model_dir)
    await eng.ensure_adapter("k0", adapter_dirs[0])
    await eng.ensure_adapter("k1", adapter_dirs[1])
    jobs = [_greedy(PROMPTS[0], n=6, adapter=a) for a in (None, "k0", "k1")]
    solo = [(await eng.sample(j)).sequences[0].tokens for j in jobs]
    assert solo[0] != solo[1] and solo[1] != solo[2]
    mixed = await asyncio.gather(*(eng.sample(j) for j in jobs + jobs))
    assert [r.sequences[0].tokens for r in mixed] == solo + solo
    # the adapter's numbers are the trainer's (PEFT directory loaded by openrl.model.lora)
    assert solo[1] == _greedy_with_adapter(model_dir, adapter_dirs[0], PROMPTS[0], 6)
    await eng.close()


def _greedy_with_adapter(model_dir, adapter_dir, prompt, n):
    from openrl.model.lora import load_peft_adapter

    m = MultiLoRAModel(transformers.AutoModelForCausalLM.from_pretrained(str(model_dir)).eval())
    load_peft_adapter(m, "x", adapter_dir)
    ids = list(prompt)
    with torch.no_grad(), m.use_adapters(["x"]):
        for _ in range(n):
            ids.append(int(m(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt) :]


async def test_adapter_lru_eviction(model_dir, adapter_dirs):
    eng = _engine(model_dir, adapter_cache_size=2)
    await eng.ensure_adapter("k0", adapter_dirs[0])
    await eng.ensure_adapter("k1", adapter_dirs[1])
    await eng.ensure_adapter("k0", adapter_dirs[0])  # k0 becomes most recently used
    await eng.ensure_adapter("k2", adapter_dirs[2])
    assert eng.loaded_adapters() == ["k0", "k2"]
    assert not eng.backend.model.has_adapter("k1")
    with pytest.raises(ServerError):
        await eng.sample(_greedy(PROMPTS[1], adapter="k1"))
    # loading through sample(adapter_dir=...) works, and a pinned adapter is never evicted
    running = asyncio.ensure_future(eng.sample(_greedy(PROMPTS[0], n=40, adapter="k1"), adapter_dir=adapter_dirs[1]))
    while "k1" not in eng.loaded_adapters():
        await asyncio.sleep(0.001)
    assert eng.loaded_adapters() == ["k2", "k1"]
    await eng.ensure_adapter("k0", adapter_dirs[0])
    await eng.ensure_adapter("k2", adapter_dirs[2])  # k1 is now least recently used, but in use
    assert eng.loaded_adapters() == ["k1", "k2"]
    assert not running.done()
    await running
    await eng.ensure_adapter("k0", adapter_dirs[0])  # k1 released: evicted now
    assert eng.loaded_adapters() == ["k2", "k0"]
    await eng.close()


async def test_cancelled_job_leaves_batch(model_dir):
    eng = _engine(model_dir)
    t = asyncio.ensure_future(eng.sample(_greedy(PROMPTS[0], n=100)))
    while eng.backend.steps < 3:
        await asyncio.sleep(0.001)
    t.cancel()
    res = await eng.sample(_greedy(PROMPTS[1], n=3))
    assert len(res.sequences[0].tokens) == 3
    assert eng.backend._active_rows == 0
    await eng.close()


@pytest.mark.parametrize(
    "changes, field",
    [
        ({"prompt": []}, "prompt.chunks"),
        ({"prompt": [1, VOCAB]}, "prompt.chunks"),
        ({"prompt": [1, -1]}, "prompt.chunks"),
        ({"prompt": [1] * 128}, "prompt.chunks"),
        ({"num_samples": 0}, "num_samples"),
        ({"num_samples": 9}, "num_samples"),
        ({"max_tokens": 0}, "sampling_params.max_tokens"),
        ({"max_tokens": 126}, "sampling_params.max_tokens"),
        ({"temperature": -0.1}, "sampling_params.temperature"),
        ({"temperature": float("nan")}, "sampling_params.temperature"),
        ({"top_p": 0.0}, "sampling_params.top_p"),
        ({"top_p": 1.5}, "sampling_params.top_p"),
        ({"top_k": -2}, "sampling_params.top_k"),
        ({"seed": 1.5}, "sampling_params.seed"),
        ({"stop": [""]}, "sampling_params.stop"),
        ({"stop": [VOCAB]}, "sampling_params.stop"),
        ({"stop": ["a", 1]}, "sampling_params.stop"),
        ({"topk_prompt_logprobs": 21}, "topk_prompt_logprobs"),
        ({"topk_sample_logprobs": -1}, "topk_sample_logprobs"),
        ({"prompt_logprobs_last_n": 2}, "prompt_logprobs_last_n"),  # without prompt_logprobs
        ({"prompt_logprobs": True, "prompt_logprobs_last_n": 3}, "prompt_logprobs_last_n"),  # > P-1
        ({"target_prompt_ids": [[1]]}, "target_prompt_logprobs"),
        ({"target_prompt_ids": [[-1], [-1]]}, "target_prompt_logprobs"),
        ({"prompt_alt_tokens_k": 100}, "prompt_alt_tokens_k"),
    ],
)
async def test_bad_inputs_name_the_field(model_dir, changes, field):
    eng = _engine(model_dir, max_num_samples=8)
    kw = {"prompt": [1, 2, 3], "max_tokens": 2, **changes}
    for build in (sample_job, unchecked_job):  # refused as the payload is parsed, or by the engine itself
        with pytest.raises(UserError) as ei:
            await eng.sample(build(**kw))
        assert ei.value.field == field and ei.value.category == "user"
    await eng.close()


async def test_stop_string_as_plain_str_and_no_tokenizer(model_dir, tmp_path):
    eng = _engine(model_dir)
    res = await eng.sample(sample_job([1, 2], max_tokens=2, stop="zzzzzz"))  # a bare str is accepted
    assert len(res.sequences[0].tokens) <= 2
    await eng.close()
    # a model without a tokenizer refuses stop strings but samples otherwise
    bare = tmp_path / "bare"
    transformers.AutoModelForCausalLM.from_pretrained(str(model_dir)).save_pretrained(str(bare))
    eng = _engine(bare)
    assert not eng.limits.has_tokenizer
    with pytest.raises(UserError) as ei:
        await eng.sample(sample_job([1, 2], max_tokens=2, stop=["x"]))
    assert ei.value.field == "sampling_params.stop"
    assert len((await eng.sample(sample_job([1, 2], max_tokens=2))).sequences[0].tokens) <= 2
    await eng.close()


async def test_single_token_prompt_logprobs(model_dir):
    eng = _engine(model_dir)
    res = await eng.sample(sample_job([7], max_tokens=1, prompt_logprobs=True, topk_prompt_logprobs=2))
    assert len(res.prompt_logprobs) == 1 and math.isnan(res.prompt_logprobs[0])
    assert res.topk_prompt == ([[0, 0]], [[TOPK_MASK_LOGPROB] * 2])
    assert len(res.sequences[0].tokens) == 1
    await eng.close()


async def test_failed_step_fails_its_jobs_and_engine_recovers(model_dir, monkeypatch):
    eng = _engine(model_dir)
    backend = eng.backend
    real = backend._forward
    calls = {"n": 0}

    def flaky(*a, **kw):
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("boom")
        return real(*a, **kw)

    monkeypatch.setattr(backend, "_forward", flaky)
    with pytest.raises(ServerError, match="boom"):
        await eng.sample(_greedy(PROMPTS[0], n=5))
    res = await eng.sample(_greedy(PROMPTS[0], n=5))
    assert res.sequences[0].tokens == _greedy_reference(model_dir, PROMPTS[0], 5)
    await eng.close()


async def test_close_fails_running_jobs(model_dir):
    eng = _engine(model_dir)
    t = asyncio.ensure_future(eng.sample(_greedy(PROMPTS[0], n=100)))
    while eng.backend.steps < 2:
        await asyncio.sleep(0.001)
    await eng.close()
    with pytest.raises(ServerError):
        await t
    with pytest.raises(ServerError):
        await eng.sample(_greedy(PROMPTS[0]))
