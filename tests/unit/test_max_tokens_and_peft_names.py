"""An omitted ``max_tokens`` (issue 17 item 1) and ``<base>:peft:<context>`` model names
(issue 13 item 5), below the gateway: the sampler engine on both backends' paths and the
registry's name parser.

The HF backend runs for real on the micro model (128-token context). vLLM needs a CUDA GPU,
so its part is the real job -> ``vllm.SamplingParams`` mapping (``sampling_kwargs``) fed the
job the engine validated; the stand-in backend only records that job.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from functions.sampler.backends.vllm import sampling_kwargs
from functions.sampler.engine import ModelLimits, SamplerEngine
from functions.sampler.stops import resolve_stop
from micro_model import write_micro_qwen3  # tests/micro_model.py
from openrl.contract.payloads import Sample
from sample_jobs import RecordingBackend, sample_job  # tests/sample_jobs.py
from openrl.errors import UserError
from openrl.model.registry import ModelRegistry, split_peft_suffix

CONTEXT = 128


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return write_micro_qwen3(tmp_path_factory.mktemp("micro-ctx"), max_positions=CONTEXT)


# --------------------------------------------------------------------------- omitted max_tokens


async def test_omitted_max_tokens_runs_to_the_end_of_the_context(model_dir):
    """No hidden 16: with stop=[] (no stop, not even EOS) an omitted max_tokens fills the
    context; a configured cap bounds it."""
    eng = SamplerEngine(model_dir, backend="hf")
    try:
        prompt = [3 + i % 50 for i in range(CONTEXT - 40)]
        seq = (await eng.sample(sample_job(prompt, temperature=0.0, stop=[]))).sequences[0]
        assert len(seq.tokens) == 40 and seq.stop_reason == "length"
    finally:
        await eng.close()
    capped = SamplerEngine(model_dir, backend="hf", max_tokens_default=25)
    try:
        seq = (await capped.sample(sample_job([5, 6, 7], temperature=0.0, stop=[]))).sequences[0]
        assert len(seq.tokens) == 25 and seq.stop_reason == "length"
        assert capped.validate(sample_job([1] * (CONTEXT - 4))).sampling_params.max_tokens == 4  # room < cap
    finally:
        await capped.close()


async def test_vllm_gets_the_room_left_for_an_omitted_max_tokens():
    limits = ModelLimits(vocab_size=1000, max_context=2048, eos_token_ids=frozenset({2}), has_tokenizer=False)
    backend = RecordingBackend(limits)
    eng = SamplerEngine(Path("unused"), backend=backend)
    await eng.sample(sample_job(list(range(10, 58))))
    job = backend.jobs[-1]
    kw = sampling_kwargs(job, *resolve_stop(job.sampling_params.stop, limits.eos_token_ids))
    assert kw["max_tokens"] == 2048 - 48
    await SamplerEngine(Path("unused"), backend=backend, max_tokens_default=300).sample(sample_job([5]))
    job = backend.jobs[-1]
    assert sampling_kwargs(job, *resolve_stop(job.sampling_params.stop, limits.eos_token_ids))["max_tokens"] == 300


# --------------------------------------------------------------------------- :peft:<context>


@pytest.mark.parametrize("name, expected", [
    ("Qwen/Qwen3-0.6B", ("Qwen/Qwen3-0.6B", None)),
    ("Qwen/Qwen3-0.6B:peft:64", ("Qwen/Qwen3-0.6B", 64)),
    ("Qwen/Qwen3.6-35B-A3B:peft:262144", ("Qwen/Qwen3.6-35B-A3B", 262144)),
    ("a:peft:b:peft:7", ("a:peft:b", 7)),  # the last suffix counts
])
def test_split_peft_suffix(name, expected):
    assert split_peft_suffix(name) == expected


@pytest.mark.parametrize("raw", ["", "x", "-5", "+5", "0", "1.5", " 64", "64 ", "1e3", "٣", "9" * 5000])
def test_split_peft_suffix_rejects_malformed_context(raw):
    with pytest.raises(UserError) as ei:
        split_peft_suffix(f"Qwen/Qwen3-0.6B:peft:{raw}")
    assert ei.value.field == "base_model"
    with pytest.raises(UserError):
        split_peft_suffix(":peft:64")  # no base name


def test_registry_resolves_the_suffix_to_the_entry_with_a_capped_context(tmp_path):
    reg = ModelRegistry.from_dict(
        {"models": {"m/base": {"path": "tiny", "max_context_length": 4096, "dtype": "float32"}}},
        models_dir=tmp_path)
    base = reg.resolve("m/base")
    e = reg.resolve("m/base:peft:64")
    assert e.name == "m/base:peft:64" and e.max_context_length == 64
    assert (e.path, e.tokenizer_id, e.dtype, e.trainable) == (base.path, base.tokenizer_id, "float32", True)
    assert reg.resolve("m/base:peft:4096").max_context_length == 4096
    assert "m/base:peft:64" not in reg and reg.names() == ["m/base"]  # nothing registered by resolving
    for bad, words in (("m/base:peft:4097", "at most 4096"), ("other:peft:64", "unknown base model"),
                       ("m/base:peft:abc", "positive integer")):
        with pytest.raises(UserError) as ei:
            reg.resolve(bad)
        assert ei.value.field == "base_model" and words in str(ei.value), str(ei.value)
