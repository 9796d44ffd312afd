"""The transformers sampler's deterministic mode (issue 33, functions/sampler/backends/hf_solo.py):
a seeded request's tokens and logprobs are bitwise the same alone or among other requests.

CPU, float32, exact (``==`` on the sampled tokens and on the float32 logprobs, no tolerance):
the request alone; in one gather with other requests of other prompt lengths, adapters,
sample counts and sampling parameters; and joining a batch already decoding. A control shows
that outside the mode the same comparison is not exact (padded, batched decode).
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch
import transformers

from functions.sampler.engine import SamplerEngine
from micro_model import write_micro_qwen3  # tests/micro_model.py
from openrl.model.lora import LoraSpec, MultiLoRAModel, save_peft_adapter
from sample_jobs import sample_job  # tests/sample_jobs.py


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return write_micro_qwen3(tmp_path_factory.mktemp("det-qwen3"), max_positions=128, tie=False)


@pytest.fixture(scope="module")
def adapter_dirs(model_dir, tmp_path_factory) -> list[Path]:
    root = tmp_path_factory.mktemp("det-adapters")
    out = []
    for i, rank in enumerate((4, 8)):
        m = MultiLoRAModel(transformers.AutoModelForCausalLM.from_pretrained(str(model_dir)))
        m.add_adapter("a", LoraSpec(rank=rank, seed=20 + i))
        g = torch.Generator().manual_seed(20 + i)
        with torch.no_grad():
            for name, p in m.named_adapter_parameters("a"):
                if "lora_B" in name:
                    p.copy_(torch.randn(p.shape, generator=g) * 0.3)
        save_peft_adapter(m, "a", root / f"ad{i}")
        out.append(root / f"ad{i}")
    return out


@pytest.fixture(autouse=True)
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


#: the request under test: seeded, 4 samples, with adapter k0
JOB = dict(prompt=[5, 17, 33, 101, 7, 250, 11, 3, 90], adapter="k0", num_samples=4, max_tokens=10,
           temperature=1.0, seed=7, stop=[], topk_sample_logprobs=3)


def _others():
    """Other concurrent requests: other prompt lengths, the base model and another adapter,
    greedy and seeded, top-k / top-p, more and fewer samples and tokens."""
    return [
        sample_job([300, 2], None, num_samples=3, max_tokens=14, temperature=0.9, seed=1, stop=[]),
        sample_job(list(range(40, 77)), "k1", num_samples=2, max_tokens=6, temperature=0.7, top_k=20,
                   seed=2, stop=[]),
        sample_job([42, 43, 44, 45], "k0", num_samples=1, max_tokens=12, temperature=0.0, stop=[]),
        sample_job(list(range(200, 221)), "k0", num_samples=5, max_tokens=9, temperature=1.2, top_p=0.9,
                   seed=3, stop=[]),
    ]


def _seqs(result):
    return [(s.tokens, s.logprobs, s.topk) for s in result.sequences]


async def _engine(model_dir, adapter_dirs, deterministic: bool) -> SamplerEngine:
    eng = SamplerEngine(model_dir, backend="hf", deterministic=deterministic)
    assert eng.deterministic is deterministic
    await eng.ensure_adapter("k0", adapter_dirs[0])
    await eng.ensure_adapter("k1", adapter_dirs[1])
    return eng


async def _alone_and_among(model_dir, adapter_dirs, deterministic: bool):
    """The job's sequences alone, among the others in one gather, and joining a running batch."""
    eng = await _engine(model_dir, adapter_dirs, deterministic)
    job = sample_job(JOB["prompt"], JOB["adapter"], **{k: v for k, v in JOB.items() if k not in ("prompt", "adapter")})
    alone = _seqs(await eng.sample(job))
    o = _others()
    res = await asyncio.gather(eng.sample(o[0]), eng.sample(o[1]), eng.sample(job), eng.sample(o[2]),
                               eng.sample(o[3]))
    among = _seqs(res[2])
    long_job = asyncio.ensure_future(eng.sample(_others()[0]))
    while eng.backend.steps < 3:  # let the other job start decoding; the seeded one joins it
        await asyncio.sleep(0.001)
    late = _seqs(await eng.sample(job))
    await long_job
    await eng.close()
    return alone, among, late


async def test_seeded_request_alone_equals_among_others(model_dir, adapter_dirs):
    alone, among, late = await _alone_and_among(model_dir, adapter_dirs, deterministic=True)
    assert len({tuple(t) for t, _, _ in alone}) > 1  # the 4 samples differ from each other
    assert among == alone
    assert late == alone


async def test_mode_off_is_not_exact_here(model_dir, adapter_dirs):
    """Control: outside the mode the rows share padded, batched forwards, and at least one
    logprob moves here (so the test above can fail). Skipped, not failed, on a CPU whose
    kernels happen to give the same bits (the product promises nothing outside the mode)."""
    alone, among, late = await _alone_and_among(model_dir, adapter_dirs, deterministic=False)
    if among == alone and late == alone:  # the CPU's kernels may give the same bits: nothing to show then
        pytest.skip("batched decoding happened to be exact on this CPU without the mode")


async def test_mode_decodes_each_job_in_its_own_forward(model_dir, adapter_dirs):
    """One prefill per job and one forward per running job per step: 2 jobs of 3 and 1
    samples, 4 tokens each: 2 prefills + 3 decode steps x 2 jobs."""
    eng = await _engine(model_dir, adapter_dirs, deterministic=True)
    jobs = [sample_job([1, 2, 3], "k0", num_samples=3, max_tokens=4, temperature=1.0, seed=5, stop=[]),
            sample_job([9, 8], None, num_samples=1, max_tokens=4, temperature=0.0, stop=[])]
    before = eng.backend.steps
    await asyncio.gather(*(eng.sample(j) for j in jobs))
    assert eng.backend.steps - before == 2 + 3 * 2
    await eng.close()
