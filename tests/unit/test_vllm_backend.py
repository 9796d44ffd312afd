"""The vLLM sampler backend's CPU-side parts: adapter conversion (lm_head LoRA), the
job (the ``sample`` payload) -> SamplingParams mapping, and turning vLLM outputs into SampleResults.

The engine itself needs vLLM and a CUDA GPU; those tests are skipped here with the reason
(they ran on an H200 through bench/sampler_h200.py: docs/benchmarks.md, "H200 (issue 8)").
"""

from __future__ import annotations

import importlib.util
import json
import math
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file
from transformers import Qwen3Config, Qwen3ForCausalLM

from functions.sampler.engine import TOPK_MASK_LOGPROB, SampleResult
from functions.sampler.backends.vllm import (
    check_supported,
    unsupported_field,
    prepare_adapter,
    prompt_fields,
    sampling_kwargs,
    sequence_from_output,
)
from functions.trainer.engine import TrainerEngine
from openrl.errors import ServerError, UserError
from openrl.contract.payloads import Sample
from openrl.model.lora import LoraSpec
from sample_jobs import sample_job  # tests/sample_jobs.py

HAVE_VLLM = importlib.util.find_spec("vllm") is not None and torch.cuda.is_available()


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """Two trainer exports of a tiny Qwen3: with and without the lm_head LoRA."""
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("vllm-adapters")
    cfg = Qwen3Config(vocab_size=128, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=8, tie_word_embeddings=True)
    torch.manual_seed(0)
    base = Qwen3ForCausalLM(cfg)
    base.save_pretrained(str(root / "base"))  # the engine the probe test samples through
    e = TrainerEngine.from_base_model(base)
    e.create_run("full", LoraSpec(rank=4, seed=1))  # train_unembed defaults to True (Tinker)
    e.create_run("body", LoraSpec(rank=4, seed=2, train_unembed=False))
    e.create_run("head", LoraSpec(rank=4, seed=3, train_attn=False, train_mlp=False))
    for n in ("full", "body", "head"):
        e.export_sampler_weights(n, root / n)
    return root


def test_prepare_adapter_keeps_the_whole_adapter(exported):
    """Nothing is dropped any more: vLLM gets the trainer's export as it is, lm_head LoRA
    included, and the info says whether it has one."""
    info = prepare_adapter(exported / "full", max_rank=32)
    assert info["unembed"] and "lm_head" in info["targets"] and info["rank"] == 4
    assert not prepare_adapter(exported / "body")["unembed"]
    assert prepare_adapter(exported / "head")["targets"] == ["lm_head"]


def test_prepare_adapter_errors(exported, tmp_path):
    with pytest.raises(UserError) as ei:
        prepare_adapter(exported / "body", max_rank=2)
    assert ei.value.field == "model_path" and "rank 4" in str(ei.value)
    with pytest.raises(UserError):
        prepare_adapter(tmp_path / "missing")


class _NoUnembedHF:
    """A stand-in for an engine that ignores lm_head LoRA: the real transformers backend
    loading each adapter with its lm_head tensors removed (the behaviour the check guards against)."""

    def __init__(self, model_dir, workdir):
        from functions.sampler.backends.hf import HFBackend

        self.be, self.workdir = HFBackend(model_dir), workdir

    async def load(self, key, d):
        from safetensors.torch import load_file, save_file

        sd = {k: v for k, v in load_file(str(d / "adapter_model.safetensors")).items() if ".lm_head." not in k}
        cfg = json.loads((d / "adapter_config.json").read_text())
        cfg["target_modules"] = [t for t in cfg["target_modules"] if t != "lm_head"]
        out = self.workdir / key.replace("/", "_").replace("#", "_")
        out.mkdir(parents=True, exist_ok=True)
        save_file(sd, str(out / "adapter_model.safetensors"))
        (out / "adapter_config.json").write_text(json.dumps(cfg))
        await self.be.load_adapter(key, out)


def test_unembed_check_sees_an_engine_that_applies_lm_head_lora_and_one_that_ignores_it(exported, tmp_path):
    """The vLLM backend's start-up check (functions/sampler/backends/unembed_check.py) through
    the real transformers backend, which applies the lm_head LoRA exactly: applied. Through the
    same backend loading adapters without their lm_head tensors: not applied. The probe changes
    only lm_head's two tensors."""
    import asyncio

    from functions.sampler.backends.hf import HFBackend
    from functions.sampler.backends.unembed_check import (
        MIN_EFFECT,
        PROBE_LOGIT,
        check_unembed,
        unembed_applied,
        write_unembed_probe,
    )

    probe, tokens = write_unembed_probe(exported / "full", tmp_path / "probe")
    a, b = load_file(str(exported / "full" / "adapter_model.safetensors")), load_file(str(probe / "adapter_model.safetensors"))
    changed = sorted(k for k in a if not torch.equal(a[k], b[k]))
    assert changed == ["base_model.model.lm_head.lora_A.weight", "base_model.model.lm_head.lora_B.weight"]
    cfg = json.loads((exported / "full" / "adapter_config.json").read_text())
    B = b["base_model.model.lm_head.lora_B.weight"]
    assert len(set(tokens)) == cfg["r"] and torch.count_nonzero(B) == cfg["r"]
    assert float(B.abs().max()) * cfg["lora_alpha"] / cfg["r"] == pytest.approx(PROBE_LOGIT)

    async def run(engine_ignores: bool):
        if engine_ignores:
            stub = _NoUnembedHF(exported / "base", tmp_path / "stripped")
            be, load = stub.be, stub.load
        else:
            be = HFBackend(exported / "base")
            load = be.load_adapter
        try:
            await load("snap", exported / "full")
            return await check_unembed(be.sample, load, be.unload_adapter, "snap", exported / "full",
                                       tmp_path / ("w1" if engine_ignores else "w0"), 128)
        finally:
            await be.close()

    applied, summary = asyncio.run(run(False))
    assert applied, summary
    ignored, summary = asyncio.run(run(True))
    assert not ignored and "up to 0 nats" in summary, summary
    assert unembed_applied([(1, -2.0)], [(1, -2.0 - MIN_EFFECT / 2)])[0] is False
    assert unembed_applied([(1, -2.0)], [(3, -0.1)]) == (True, float("inf"))
    with pytest.raises(ValueError):
        unembed_applied([], [])


def _job(**kw) -> Sample:
    base = dict(prompt=[5, 6, 7, 8], max_tokens=4)
    base.update(kw)
    return sample_job(**base)


def test_sampling_kwargs_mapping():
    from functions.sampler.stops import resolve_stop

    eos = frozenset({2})
    kw = sampling_kwargs(_job(), *resolve_stop(None, eos))
    assert kw["stop_token_ids"] == [2] and kw["ignore_eos"] and kw["stop"] is None and not kw["detokenize"]
    assert kw["top_k"] == 0 and kw["logprobs"] == 0 and kw["max_tokens"] == 4
    kw = sampling_kwargs(_job(stop=[], top_k=-1), *resolve_stop([], eos))
    assert kw["stop_token_ids"] == [] and kw["ignore_eos"]  # stop=[]: not even EOS
    kw = sampling_kwargs(_job(stop=[9, 3], top_k=5, topk_sample_logprobs=3), *resolve_stop([9, 3], eos))
    assert kw["stop_token_ids"] == [2, 3, 9] and kw["top_k"] == 5 and kw["logprobs"] == 3
    kw = sampling_kwargs(_job(stop=["\n\nUser:"]), *resolve_stop(["\n\nUser:"], eos))
    assert kw["stop"] == ["\n\nUser:"] and kw["detokenize"] and kw["stop_token_ids"] == [2]


def test_unsupported_fields_are_user_errors():
    check_supported(_job(prompt_logprobs=True, topk_prompt_logprobs=2))
    assert unsupported_field(_job(prompt_logprobs=True)) is None
    assert unsupported_field(_job(target_prompt_ids=[[1], [2], [3]])) == "target_prompt_logprobs"
    with pytest.raises(UserError) as ei:
        check_supported(_job(target_prompt_ids=[[1], [2], [3]]))
    assert ei.value.field == "target_prompt_logprobs"
    with pytest.raises(UserError) as ei:
        check_supported(_job(prompt_alt_tokens_k=2))
    assert ei.value.field == "prompt_alt_tokens_k"


def _lp(v: float, rank: int):
    return SimpleNamespace(logprob=v, rank=rank, decoded_token=None)


def test_sequence_from_output():
    # position 1: the sampled token (7) is not in the top-2, vLLM adds it as an extra entry
    out = SimpleNamespace(
        index=0, token_ids=[4, 7], finish_reason="stop",
        logprobs=[{4: _lp(-0.1, 1), 9: _lp(-2.5, 2)}, {1: _lp(-0.5, 1), 3: _lp(-1.0, 2), 7: _lp(-3.0, 5)}],
    )
    s = sequence_from_output(out, 2)
    assert s.tokens == [4, 7] and s.logprobs == [-0.1, -3.0] and s.stop_reason == "stop"
    assert s.topk == ([[4, 9], [1, 3]], [[-0.1, -2.5], [-0.5, -1.0]])
    s = sequence_from_output(SimpleNamespace(index=0, token_ids=[4], finish_reason="length",
                                             logprobs=[{4: _lp(-0.1, 1)}]), 3)
    assert s.topk == ([[4, 0, 0]], [[-0.1, TOPK_MASK_LOGPROB, TOPK_MASK_LOGPROB]]) and s.stop_reason == "length"
    with pytest.raises(ServerError):
        sequence_from_output(SimpleNamespace(index=0, token_ids=[4], finish_reason="abort", logprobs=[{4: _lp(0, 1)}]), 0)
    with pytest.raises(ServerError):
        sequence_from_output(SimpleNamespace(index=0, token_ids=[4], finish_reason="stop", logprobs=None), 0)


def test_prompt_fields_last_n_and_topk():
    job = _job(prompt_logprobs=True, topk_prompt_logprobs=1, prompt_logprobs_last_n=2)
    plp = [None, {6: _lp(-1.0, 1)}, {7: _lp(-2.0, 3), 1: _lp(-0.2, 1)}, {8: _lp(-0.3, 1)}]
    res = SampleResult(sequences=[])
    prompt_fields(res, job, plp)
    assert math.isnan(res.prompt_logprobs[0]) and math.isnan(res.prompt_logprobs[1])
    assert res.prompt_logprobs[2:] == [-2.0, -0.3]
    ids, lps = res.topk_prompt
    assert ids == [[0], [0], [1], [8]] and lps[2:] == [[-0.2], [-0.3]] and lps[1] == [TOPK_MASK_LOGPROB]
    with pytest.raises(ServerError):
        prompt_fields(SampleResult(sequences=[]), job, None)


@pytest.mark.skipif(not HAVE_VLLM, reason="vLLM and a CUDA GPU are not available here: the engine runs only on "
                    "the GPU machine (bench/sampler_h200.py drives VLLMBackend there)")
def test_vllm_backend_engine(tmp_path):  # pragma: no cover - GPU only
    import asyncio

    from functions.sampler.backends.vllm import VLLMBackend

    cfg = Qwen3Config(vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=64, tie_word_embeddings=True)
    cfg.architectures = ["Qwen3ForCausalLM"]
    Qwen3ForCausalLM(cfg).to(torch.bfloat16).save_pretrained(tmp_path / "m")
    b = VLLMBackend(tmp_path / "m", device="cuda", max_batch_rows=8, max_context=256, gpu_memory_utilization=0.3)

    async def go():
        r = await b.sample(_job(max_tokens=5, stop=[]))
        await b.close()
        return r

    r = asyncio.run(go())
    assert len(r.sequences[0].tokens) == 5


def test_load_adapter_times_its_parts(exported, monkeypatch):
    """VLLMBackend.load_adapter records the check and the engine call apart
    (``openrl_sampler_adapter_load_part_seconds``). vLLM's AsyncLLM needs a CUDA GPU: a stand-in
    engine takes ``add_lora`` here, and a stand-in ``vllm.lora.request`` module gives the request
    type; the real engine runs in the GPU conformance run."""
    import asyncio
    import sys
    import types

    from functions.sampler.backends.vllm import VLLMBackend
    from openrl.observe import metrics

    mod = types.ModuleType("vllm.lora.request")
    mod.LoRARequest = lambda **kw: SimpleNamespace(**kw)
    for name in ("vllm", "vllm.lora"):
        monkeypatch.setitem(sys.modules, name, sys.modules.get(name) or types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "vllm.lora.request", mod)
    added = []

    class Engine:
        async def add_lora(self, req):
            await asyncio.sleep(0.05)
            added.append(req)
            return True

    be = VLLMBackend.__new__(VLLMBackend)
    be.engine, be._ids, be._requests, be._next_id = Engine(), {}, {}, 1
    be.max_lora_rank, be.unembed_lora, be._unembed_keys, be.preload = 32, "fallback", set(), False

    def total(part):
        return metrics.ADAPTER_LOAD_PART_SECONDS.labels(part)._sum.get()

    before = {p: total(p) for p in ("check", "engine")}
    asyncio.run(be.load_adapter("k1", exported / "body"))
    asyncio.run(be.load_adapter("k1", exported / "body"))  # loaded: not again
    assert [r.lora_name for r in added] == ["k1"] and be._ids == {"k1": 1}
    assert total("engine") - before["engine"] >= 0.04  # the stand-in's 0.05 s sleep
    assert total("check") - before["check"] > 0
