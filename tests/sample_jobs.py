"""Sampling jobs for the sampler's tests: the ``sample`` payload (:class:`openrl.contract.payloads.
Sample`, which is the engine's and the backends' job) built from flat keywords, the way the tests
wrote the sampler's old ``SampleJob``."""

from __future__ import annotations

from typing import Any

from functions.sampler.types import ModelLimits, SampledSequence, SampleResult
from openrl.contract.payloads import Sample, SamplingParams

#: ``base_model`` of the tests' jobs (backends ignore it: a backend serves one base model).
BASE_MODEL = "micro"


def sample_job(prompt: list[int], adapter: str | None = None, *, target_prompt_ids: list[list[int]] | None = None,
               **fields: Any) -> Sample:
    """A validated job (``Sample.parse``).

    Args:
        prompt: ``prompt_tokens``.
        adapter: ``model_path``, the adapter key (None = the base model).
        target_prompt_ids: ``[P-1][K]`` rows, sent as the dense int64 TensorData
            ``target_prompt_logprobs``.
        fields: ``sampling_params`` fields (``max_tokens``, ``temperature``, ``top_p``, ``top_k``,
            ``seed``, ``stop``) by name, the other ``Sample`` fields by theirs.

    Raises:
        UserError: a field out of its range, named as the sampler names it.
    """
    return Sample.parse(_data(prompt, adapter, target_prompt_ids, fields))


def unchecked_job(prompt: list[int], adapter: str | None = None, *,
                  target_prompt_ids: list[list[int]] | None = None, **fields: Any) -> Sample:
    """As :func:`sample_job`, but built without validation (``model_construct``): a bad job built in
    Python, which the engine must refuse itself."""
    d = _data(prompt, adapter, target_prompt_ids, fields)
    d["sampling_params"] = SamplingParams.model_construct(**d["sampling_params"])
    return Sample.model_construct(**d)


def changed(job: Sample, **fields: Any) -> Sample:
    """``job`` with ``fields`` replaced (names as :func:`sample_job`'s; ``prompt`` / ``adapter`` too)."""
    flat: dict[str, Any] = {k: getattr(job, k) for k in job.model_fields_set
                            if k not in ("prompt_tokens", "model_path", "sampling_params")}
    flat |= {k: getattr(job.sampling_params, k) for k in job.sampling_params.model_fields_set}
    flat |= {"prompt": job.prompt_tokens, "adapter": job.model_path} | fields
    return sample_job(**flat)


class RecordingBackend:
    """A ``SamplerBackend`` stand-in (vLLM needs CUDA): records each validated job it is given in
    ``jobs`` and answers one empty sequence."""

    def __init__(self, limits: ModelLimits):
        self.limits = limits
        self.jobs: list[Sample] = []

    async def sample(self, job: Sample) -> SampleResult:
        self.jobs.append(job)
        return SampleResult(sequences=[SampledSequence(tokens=[], logprobs=[], stop_reason="length")])

    async def close(self) -> None:
        pass


def _data(prompt: list[int], adapter: str | None, target_prompt_ids: list[list[int]] | None,
          fields: dict[str, Any]) -> dict[str, Any]:
    params = {k: fields.pop(k) for k in list(fields) if k in SamplingParams.model_fields}
    data: dict[str, Any] = {"prompt_tokens": list(prompt), "base_model": BASE_MODEL, "model_path": adapter,
                            "sampling_params": params, **fields}
    if target_prompt_ids is not None:
        k = len(target_prompt_ids[0]) if target_prompt_ids else 0
        data["target_prompt_logprobs"] = {"data": [t for r in target_prompt_ids for t in r], "dtype": "int64",
                                          "shape": [len(target_prompt_ids), k]}
    return data
