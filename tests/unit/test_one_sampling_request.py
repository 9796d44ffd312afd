"""One sampling request (issue 35 item 2): the ``sample`` event's payload (openrl/contract/payloads.py
``Sample``) is the sampler's job from the event to the backend, so a new sampling parameter is a
field of the wire model, of the payload and of the one backend that honours it.

Proved here: what the backends read of a job is the payload's own fields (or a read-only view the
payload itself defines), and exactly those that shape the sampling, no translation table between
them; and a ``Sample`` goes through ``to_data()`` / ``parse`` (the event) into the engine and on to
the backend unchanged, but for the values the engine resolves."""

from __future__ import annotations

import asyncio
import sys
import types
from pathlib import Path
from types import SimpleNamespace

import pytest
from pydantic import BaseModel

from functions.sampler.backends import vllm_convert
from functions.sampler.backends.hf import HFBackend
from functions.sampler.engine import ModelLimits, SampleResult, SamplerEngine
from micro_model import write_micro_qwen3  # tests/micro_model.py
from openrl.contract.payloads import Sample, SamplingParams
from sample_jobs import RecordingBackend, sample_job  # tests/sample_jobs.py

#: the event's data format: every key a fully set ``sample`` payload carries (unchanged names)
EVENT_KEYS = {"prompt_tokens", "base_model", "model_path", "num_samples", "sampling_params", "sampling_session_id",
              "seq_id", "prompt_logprobs", "topk_prompt_logprobs", "topk_sample_logprobs", "prompt_logprobs_last_n",
              "target_prompt_logprobs", "prompt_alt_tokens_k", "record_stability_info"}
PARAM_KEYS = {"max_tokens", "temperature", "top_p", "top_k", "seed", "stop"}
#: fields that address the request, not the sampling: the sampler Function reads them (the engine of
#: ``base_model``, the request id, the stability records), no backend does
NOT_FOR_BACKENDS = {"base_model", "sampling_session_id", "seq_id", "record_stability_info"}


def _views(cls) -> set[str]:
    """The read-only views (properties) a payload class defines on its own fields."""
    return {n for c in cls.__mro__ if c not in BaseModel.__mro__ for n, v in vars(c).items() if isinstance(v, property)}


#: the field each view is computed from
VIEW_OF = {"target_prompt_ids": "target_prompt_logprobs", "sampling_params.stop_list": "sampling_params.stop"}


class _Reads:
    """Stands for a job (or its ``sampling_params``) and records every attribute a backend reads."""

    def __init__(self, target, log: set[str], prefix: str = ""):
        object.__setattr__(self, "_t", target)
        object.__setattr__(self, "_log", log)
        object.__setattr__(self, "_prefix", prefix)

    def __getattr__(self, name):
        self._log.add(self._prefix + name)
        v = getattr(self._t, name)
        return _Reads(v, self._log, "sampling_params.") if isinstance(v, SamplingParams) else v


def _jobs(engine: SamplerEngine) -> list[Sample]:
    """Validated jobs that between them ask for everything a sampler can do."""
    return [engine.validate(j) for j in (
        sample_job([5, 9, 13, 2], num_samples=2, max_tokens=3, temperature=0.7, top_p=0.9, top_k=5, seed=1,
                   stop=[7], topk_sample_logprobs=2),
        sample_job([5, 9, 13, 2, 7], max_tokens=1, temperature=0.0, stop="x", prompt_logprobs=True,
                   topk_prompt_logprobs=2, prompt_logprobs_last_n=2, prompt_alt_tokens_k=1,
                   target_prompt_ids=[[1, -1], [2, 3], [4, -1], [5, 6]]),
    )]


def _install_vllm_stand_in(monkeypatch) -> None:
    """The three vLLM names ``VLLMBackend.sample`` imports (vLLM needs a CUDA GPU)."""
    mods = {"vllm": types.ModuleType("vllm"), "vllm.inputs": types.ModuleType("vllm.inputs"),
            "vllm.sampling_params": types.ModuleType("vllm.sampling_params")}
    mods["vllm"].SamplingParams = lambda **kw: SimpleNamespace(**kw)
    mods["vllm.inputs"].TokensPrompt = lambda **kw: SimpleNamespace(**kw)
    mods["vllm.sampling_params"].RequestOutputKind = SimpleNamespace(FINAL_ONLY=2)
    for name, mod in mods.items():
        monkeypatch.setitem(sys.modules, name, mod)


class _Engine:
    """vLLM's ``AsyncLLM.generate`` stand-in: one token per output, prompt logprobs of the prompt ids."""

    async def generate(self, prompt, sp, rid, lora_request=None):
        lp = SimpleNamespace(logprob=-1.0, rank=1, decoded_token=None)
        outs = [SimpleNamespace(index=i, token_ids=[4], finish_reason="length", logprobs=[{4: lp}])
                for i in range(sp.n)]
        plp = [None] + [{t: lp} for t in prompt.prompt_token_ids[1:]]
        yield SimpleNamespace(finished=True, outputs=outs, prompt_logprobs=plp)


async def test_backends_read_the_payload_fields_and_nothing_else(tmp_path, monkeypatch):
    from functions.sampler.backends.vllm import VLLMBackend

    hf = HFBackend(write_micro_qwen3(tmp_path / "m", max_positions=64))
    hf.tokenizer = SimpleNamespace(decode=lambda ids, **kw: "")  # stop strings: the micro model has no tokenizer
    engine = SamplerEngine(Path("unused"), backend=hf)
    engine.limits = ModelLimits(hf.limits.vocab_size, hf.limits.max_context, hf.limits.eos_token_ids, True)
    reads: set[str] = set()
    try:
        for job in _jobs(engine):  # the transformers backend, for real
            await hf.sample(_Reads(job, reads))
    finally:
        await hf.close()
    _install_vllm_stand_in(monkeypatch)  # the vLLM backend and its conversions, on stand-ins
    vb = VLLMBackend.__new__(VLLMBackend)
    vb.engine, vb._closed, vb._requests, vb._unembed_keys, vb.unembed_lora = _Engine(), False, {}, set(), "keep"
    vb.limits = engine.limits
    for job in _jobs(engine):
        rec = _Reads(job, reads)
        vllm_convert.route_reason(rec, set(), "keep")
        if vllm_convert.unsupported_field(job) is None:
            res = await vb.sample(rec)
            assert len(res.sequences) == job.num_samples
        else:
            vllm_convert.prompt_fields(SampleResult(sequences=[]), rec, [None] + [{t: SimpleNamespace(
                logprob=-1.0, rank=1, decoded_token=None)} for t in job.prompt_tokens[1:]])
    fields = set(Sample.model_fields) | {f"sampling_params.{f}" for f in SamplingParams.model_fields}
    views = _views(Sample) | {f"sampling_params.{v}" for v in _views(SamplingParams)}
    assert set(VIEW_OF) == views
    assert reads <= fields | views, f"read but not the payload's: {sorted(reads - fields - views)}"
    read = {VIEW_OF.get(r, r) for r in reads} - {"sampling_params"}
    want = (fields - NOT_FOR_BACKENDS - {"sampling_params"})
    assert read == want, f"never read: {sorted(want - read)}"


@pytest.mark.parametrize("stop, max_tokens", [([5, 6], 7), ("\n\nUser:", None)])
def test_a_sample_reaches_the_backend_as_it_was_sent(stop, max_tokens):
    sent = Sample(prompt_tokens=[3, 1, 4, 1, 5], base_model="b", model_path="tinker://r/sampler_weights/s",
                  num_samples=2, sampling_params=SamplingParams(max_tokens=max_tokens, temperature=0.5, top_p=0.9,
                                                                top_k=7, seed=11, stop=stop),
                  sampling_session_id="sess", seq_id=3, prompt_logprobs=True, topk_prompt_logprobs=2,
                  topk_sample_logprobs=1, prompt_logprobs_last_n=2,
                  target_prompt_logprobs={"data": [1, -1, 2, 3, 4, -1, 5, 6], "dtype": "int64", "shape": [4, 2]},
                  prompt_alt_tokens_k=1, record_stability_info=True)
    data = sent.to_data()
    assert set(data) == EVENT_KEYS and set(data["sampling_params"]) == PARAM_KEYS  # the event's format
    got = Sample.parse(data)  # the sampler Function's side of the event
    assert got == sent and got.to_data() == data
    assert got.target_prompt_ids == [[1, -1], [2, 3], [4, -1], [5, 6]]
    backend = RecordingBackend(ModelLimits(vocab_size=100, max_context=64, eos_token_ids=frozenset({2}),
                                           has_tokenizer=True))
    engine = SamplerEngine(Path("unused"), backend=backend)
    asyncio.run(engine.sample(got.model_copy(update={"model_path": None})))
    job = backend.jobs[-1]
    resolved = {"max_tokens": max_tokens or 64 - 5, "stop": [stop] if isinstance(stop, str) else stop}
    assert job.sampling_params == sent.sampling_params.model_copy(update=resolved)
    assert job == sent.model_copy(update={"model_path": None, "sampling_params": job.sampling_params})
    assert job.target_prompt_ids == got.target_prompt_ids
    assert Sample.parse(job.to_data()) == job  # still a valid event
