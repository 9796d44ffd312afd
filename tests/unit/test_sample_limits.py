"""One size check for a sampling request (openrl/contract/sample_limits.py), called by the
gateway before it publishes and by the sampler's engine before it runs: the same request gets
the same answer on both sides (the message, and the field, except that the gateway names an
empty or too long prompt ``prompt``, the request's ModelInput, where the engine keeps
``prompt.chunks``). The engine here has a stand-in backend that
only reports the model's limits (no model is needed to check sizes); the gateway's side runs
through the SDK in tests/stack/test_errors.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from functions.sampler.engine import SamplerEngine
from functions.sampler.types import ModelLimits
from openrl.contract.sample_limits import check_sample_size
from openrl.errors import UserError
from sample_jobs import sample_job, unchecked_job  # tests/sample_jobs.py

LIMITS = ModelLimits(vocab_size=100, max_context=16, eos_token_ids=frozenset({2}), has_tokenizer=False)


class _LimitsOnly:
    limits = LIMITS

    async def close(self):
        pass


CASES = [  # (prompt, num_samples, max_tokens) -> the field at fault
    (([], 1, None), "prompt.chunks"),
    (([1, 100], 1, None), "prompt.chunks"),
    (([1, -1], 1, None), "prompt.chunks"),
    (([1] * 16, 1, None), "prompt.chunks"),
    (([1, 2], 0, None), "num_samples"),
    (([1, 2], 9, None), "num_samples"),
    (([1, 2], 1, 0), "sampling_params.max_tokens"),
    (([1, 2], 1, 15), "sampling_params.max_tokens"),
    (([1, 2], 1, 2.5), "sampling_params.max_tokens"),
]


@pytest.mark.parametrize("args, field", CASES)
def test_the_engine_refuses_what_the_check_refuses(args, field):
    prompt, n, mt = args
    with pytest.raises(UserError) as want:
        check_sample_size(prompt, n, mt, vocab_size=100, max_context=16, max_num_samples=8,
                          prompt_field="prompt.chunks")
    assert want.value.field == field
    engine = SamplerEngine(Path("unused"), backend=_LimitsOnly(), max_num_samples=8)
    for build in (sample_job, unchecked_job):  # refused as the payload is parsed, or by the engine itself
        with pytest.raises(UserError) as got:
            engine.validate(build(prompt, num_samples=n, max_tokens=mt))
        assert (got.value.field, str(got.value)) == (want.value.field, str(want.value))
    with pytest.raises(UserError) as gateway:  # the gateway's call
        check_sample_size(prompt, n, mt, vocab_size=100, max_context=16, max_num_samples=8)
    assert gateway.value.field == ("prompt" if field == "prompt.chunks" and (not prompt or len(prompt) >= 16)
                                   else field)


def test_max_tokens_defaults_and_cap():
    kw = dict(vocab_size=100, max_context=16, max_num_samples=8)
    assert check_sample_size([1, 2, 3], 1, None, **kw) == 13  # the room left
    assert check_sample_size([1, 2, 3], 1, None, max_tokens_cap=5, **kw) == 5  # the gateway's cap
    assert check_sample_size([1, 2, 3], 1, None, max_tokens_cap=5, default_max_tokens=20, **kw) == 13
    assert check_sample_size([1, 2, 3], 1, 13, **kw) == 13
    with pytest.raises(UserError, match="between 1 and 5"):
        check_sample_size([1, 2, 3], 1, 6, max_tokens_cap=5, **kw)
