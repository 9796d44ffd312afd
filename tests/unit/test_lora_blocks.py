"""openrl/model/lora: the blocks a layer works in are planned once per routing and set of
adapters (``LoraRouting.plan_blocks``, a pure function of the segments, the ranks and the
model's ``LoraKernelSettings``), and kernel selection is a setting passed in, never a module
global. CPU, fixed inputs."""

from __future__ import annotations

import pytest
import torch

from openrl.model.lora import LoraKernelSettings, LoraRouting


def _routing(rows, **kw) -> LoraRouting:
    return LoraRouting(rows, settings=LoraKernelSettings(**kw))


def test_blocks_cap_the_summed_rank_and_keep_base_rows_apart():
    r = _routing(["a", "a", "b", None, "c", "d"], mode="auto", stacked_max_rank_sum=10)
    present = (("a", 4), ("b", 4), ("c", 8), ("d", 2))
    assert r.plan_blocks(present) == (
        (0, 3, ((0, 2, "a"), (2, 3, "b"))),  # 4 + 4 <= 10
        (3, 4, ()),                           # no adapter: base output
        (4, 6, ((4, 5, "c"), (5, 6, "d"))),  # 8 + 2 <= 10
    )
    # a layer without "b" (e.g. no LoRA on its module): b's rows get the base output
    assert r.plan_blocks((("a", 4), ("c", 8), ("d", 2))) == (
        (0, 2, ((0, 2, "a"),)), (2, 3, ()), (3, 4, ()), (4, 6, ((4, 5, "c"), (5, 6, "d"))))
    # a single adapter over the cap still runs, alone
    assert r.plan_blocks((("a", 16), ("b", 4))) == (
        (0, 2, ((0, 2, "a"),)), (2, 3, ((2, 3, "b"),)), (3, 4, ()), (4, 5, ()), (5, 6, ()))


@pytest.mark.parametrize("mode, cap", [("loop", 0), ("stacked", float("inf")), ("auto", 512)])
def test_settings_choose_the_rank_cap(mode, cap):
    r = _routing(["a", "b"], mode=mode)
    assert r.plan.rank_cap == cap and not r.plan.grouped  # CPU: "auto" never groups
    blocks = r.plan_blocks((("a", 4), ("b", 4)))
    assert len(blocks) == (2 if mode == "loop" else 1)


def test_add_lora_plans_once_per_set_of_adapters():
    r = _routing(["a", "a", "b"], mode="auto")
    x = torch.ones(3, 2, 8)
    y = torch.zeros(3, 2, 6)
    g = torch.Generator().manual_seed(0)
    A = {n: torch.randn(4, 8, generator=g) for n in "ab"}
    B = {n: torch.randn(6, 4, generator=g) for n in "ab"}
    s = {"a": 0.5, "b": 2.0}
    out = r.add_lora(y, x, A, B, s)
    want = torch.cat([(x[:2] @ A["a"].T) @ B["a"].T * 0.5, (x[2:] @ A["b"].T) @ B["b"].T * 2.0])
    torch.testing.assert_close(out, want)
    r.add_lora(y, x, A, B, s)
    r.add_lora(y, x, {"a": A["a"]}, {"a": B["a"]}, {"a": 0.5})
    assert set(r._blocks) == {(("a", 4), ("b", 4)), (("a", 4),)}


def test_bad_settings_name_the_field():
    with pytest.raises(ValueError, match="LoraKernelSettings.mode"):
        LoraKernelSettings(mode="fast")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="stacked_max_rank_sum"):
        LoraKernelSettings(stacked_max_rank_sum=0)


def test_no_module_global_knobs():
    """The knobs that benchmarks and tests used to assign are gone from the modules."""
    from openrl.model import logprobs
    from openrl.model.lora import ops

    assert not hasattr(ops, "MULTI_ADAPTER_MODE") and not hasattr(ops, "STACKED_MAX_RANK_SUM")
    assert not hasattr(logprobs, "FUSED_LOGPROB")
