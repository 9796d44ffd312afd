"""RoutedBackend (functions/sampler/backends/routed.py): jobs the primary backend cannot serve
exactly go to a secondary transformers backend, started on first need.

vLLM needs a CUDA GPU, so the primary here is a stand-in: the real transformers backend
with the vLLM backend's routing rule (``route_reason``: ``unsupported_field`` plus the
``"lm_head LoRA"`` fallback) and its refusal (``check_supported``) — the same functions the
vLLM backend calls. The secondary is the real transformers backend. The vLLM side itself
runs in the GPU conformance run (bench/gpu_conformance.py).
"""

from __future__ import annotations

import pytest
import torch

from functions.sampler.backends.hf import HFBackend
from functions.sampler.backends.routed import RoutedBackend
from functions.sampler.backends.vllm_convert import check_supported, route_reason
from functions.sampler.engine import SamplerEngine
from openrl.errors import ServerError, UserError
from openrl.model.lora import LoraSpec, MultiLoRAModel, save_peft_adapter

from micro_model import write_micro_qwen3
from sample_jobs import sample_job  # tests/sample_jobs.py


class VLLMLike(HFBackend):
    """The transformers backend with the vLLM backend's routing rule (``vllm_convert.route_reason``,
    the function ``VLLMBackend.route_reason`` calls) and its refusal (``check_supported``):
    ``unembed_adapters`` are the loaded adapters with an lm_head LoRA, ``mode`` the
    ``unembed_lora`` mode ("fallback" plays a vLLM that ignores lm_head LoRA)."""

    name = "vllm"

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.unembed_adapters: set[str] = set()
        self.mode = "keep"
        self.served = 0

    def route_reason(self, job):
        return route_reason(job, self.unembed_adapters, self.mode)

    async def sample(self, job):
        check_supported(job)
        if self.route_reason(job) is not None:
            raise AssertionError(f"a job to route ({self.route_reason(job)}) reached the primary")
        self.served += 1
        return await super().sample(job)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_micro_qwen3(tmp_path_factory.mktemp("micro"), max_positions=128)


@pytest.fixture(scope="module")
def adapter_dir(model_dir, tmp_path_factory):
    from transformers import AutoModelForCausalLM

    m = MultiLoRAModel(AutoModelForCausalLM.from_pretrained(str(model_dir)))
    m.add_adapter("a", LoraSpec(rank=4, seed=3))  # train_unembed: lm_head LoRA included
    with torch.no_grad():
        for p in m.adapter_parameters("a"):
            p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    d = tmp_path_factory.mktemp("adapter")
    save_peft_adapter(m, "a", d)
    return d


def _routed(model_dir, fail_secondary: bool = False):
    built = []

    def make():
        built.append(1)
        if fail_secondary:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 8.00 GiB")
        return HFBackend(model_dir)

    return RoutedBackend(VLLMLike(model_dir), make), built


async def test_fields_without_vllm_equivalent_run_on_the_secondary(model_dir):
    rb, built = _routed(model_dir)
    ref = HFBackend(model_dir)
    try:
        p = [5, 9, 13, 2, 7]
        plain = sample_job(p, max_tokens=3, seed=4)
        await rb.sample(plain)
        assert rb.primary.served == 1 and not built and rb.name == "vllm"
        job = sample_job(p, max_tokens=1, seed=1, prompt_logprobs=True, prompt_alt_tokens_k=2,
                        target_prompt_ids=[[1, 2], [3, -1], [4, 5], [6, 7]])
        got, want = await rb.sample(job), await ref.sample(job)
        assert got.sequences[0].tokens == want.sequences[0].tokens
        assert got.prompt_logprobs[1:] == pytest.approx(want.prompt_logprobs[1:], abs=1e-6)
        assert rb.routed == {"target_prompt_logprobs": 1} and len(built) == 1 and rb.name == "vllm+hf"
        await rb.sample(sample_job(p, max_tokens=1, prompt_alt_tokens_k=1, seed=2))
        assert rb.routed["prompt_alt_tokens_k"] == 1 and len(built) == 1  # built once
        assert rb.primary.served == 1
    finally:
        await rb.close()
        await ref.close()


async def test_an_unembed_adapter_in_fallback_mode_is_served_whole_by_the_secondary(model_dir, adapter_dir):
    rb, built = _routed(model_dir)
    ref = HFBackend(model_dir)
    try:
        await rb.load_adapter("snap", adapter_dir)
        await ref.load_adapter("snap", adapter_dir)
        rb.primary.unembed_adapters.add("snap")
        rb.primary.mode = "fallback"
        job = sample_job([3, 1, 4, 1, 5], max_tokens=4, seed=9, prompt_logprobs=True, adapter="snap")
        got, want = await rb.sample(job), await ref.sample(job)
        assert got.sequences[0].tokens == want.sequences[0].tokens
        assert got.sequences[0].logprobs == pytest.approx(want.sequences[0].logprobs, abs=1e-6)
        assert rb.routed == {"lm_head LoRA": 1} and "snap" in rb._in_secondary
        await rb.unload_adapter("snap")
        assert "snap" not in rb._in_secondary and not rb._secondary.model.has_adapter("snap")
    finally:
        await rb.close()
        await ref.close()


async def test_a_secondary_that_cannot_start_fails_the_routed_job_with_its_error(model_dir):
    rb, built = _routed(model_dir, fail_secondary=True)
    try:
        job = sample_job([1, 2, 3], max_tokens=1, prompt_alt_tokens_k=1)
        for _ in range(2):
            with pytest.raises(ServerError) as ei:
                await rb.sample(job)
            assert "prompt_alt_tokens_k" in str(ei.value) and "OutOfMemoryError" in str(ei.value)
        assert len(built) == 1  # remembered, not retried on every job
        res = await rb.sample(sample_job([1, 2, 3], max_tokens=2, seed=0))  # the primary still serves
        assert len(res.sequences[0].tokens) == 2
    finally:
        await rb.close()


async def test_the_engine_validates_against_the_primary_then_routes(model_dir):
    """Through SamplerEngine (what the sampler Function calls): a routed job is validated as
    usual (a bad value is still a UserError naming the field), then served."""
    rb, _ = _routed(model_dir)
    eng = SamplerEngine(model_dir, backend=rb)
    try:
        with pytest.raises(UserError) as ei:
            await eng.sample(sample_job([1, 2, 3], max_tokens=1, prompt_alt_tokens_k=10_000))
        assert ei.value.field == "prompt_alt_tokens_k"
        res = await eng.sample(sample_job([1, 2, 3], max_tokens=1, prompt_alt_tokens_k=2, seed=3))
        assert res.sequences and rb.routed == {"prompt_alt_tokens_k": 1}
    finally:
        await eng.close()


async def test_prompt_logprobs_of_an_unembed_adapter_go_to_the_secondary(model_dir, adapter_dir):
    """vLLM 0.24 applies an lm_head LoRA to sampled tokens but not to prompt logprobs
    (vllm-project/vllm#51594): with the "keep" mode, sampling such an adapter stays on the
    primary, its prompt logprobs (compute_logprobs, topk_prompt_logprobs) are served, exactly,
    by the secondary; an adapter without lm_head LoRA stays on the primary for both."""
    rb, built = _routed(model_dir)
    ref = HFBackend(model_dir)
    try:
        for k in ("snap", "body"):
            await rb.load_adapter(k, adapter_dir)
            await ref.load_adapter(k, adapter_dir)
        rb.primary.unembed_adapters.add("snap")  # "body" plays an adapter without lm_head LoRA
        await rb.sample(sample_job([3, 1, 4], max_tokens=2, seed=1, adapter="snap"))
        assert rb.primary.served == 1 and not built
        job = sample_job([3, 1, 4, 1, 5], max_tokens=1, seed=2, prompt_logprobs=True, adapter="snap")
        got, want = await rb.sample(job), await ref.sample(job)
        assert got.prompt_logprobs[1:] == pytest.approx(want.prompt_logprobs[1:], abs=1e-6)
        await rb.sample(sample_job([3, 1, 4], max_tokens=1, topk_prompt_logprobs=2, adapter="snap"))
        assert rb.routed == {"prompt logprobs with lm_head LoRA": 2} and len(built) == 1
        await rb.sample(sample_job([3, 1, 4], max_tokens=1, prompt_logprobs=True, adapter="body"))
        assert rb.primary.served == 2 and rb.routed == {"prompt logprobs with lm_head LoRA": 2}
    finally:
        await rb.close()
        await ref.close()
