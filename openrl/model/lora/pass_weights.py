"""Adapter weights cast once per pass: each float32 adapter's ``A`` and ``B`` cast to the compute
dtype at their first use in a pass and reused by every later micro-batch of it.

Without it, every layer call of every micro-batch casts its adapters' float32 ``A`` and ``B`` to
the activations' dtype (bf16 on CUDA): on the 8-run pass of the eighth session's profile
(Qwen3-4B shapes, 7 micro-batches) 12,104 of the pass's 36,299 kernel launches were
``aten::_to_copy`` (docs/benchmarks.md, "Eighth session"). With a :class:`PassWeights` an adapter
applied alone (one adapter's rows in a block by themselves: the deterministic mode's one row per
micro-batch, blocks split by the rank cap, the interleaved path's gather) in k micro-batches is
cast once instead of k times (one bf16 copy per adapter, bounded). A block of several adapters
keeps its per-call cast of their concatenation / stack (``ops.stacked_lora_delta``,
``ops.grouped_lora_delta``): per-adapter casts would save that forward cast but split its one
backward cast into one per adapter, more casts in all (``bench/pass_weights_probe.py`` on the
CPU, 2026-12-07: 3,201 casts without the cache, 3,789 with per-adapter casts for every block).

Gradients are unchanged, bit for bit: the cached cast keeps its autograd graph (a cast saves no
tensor for backward, so each micro-batch's own ``backward`` can traverse it); each micro-batch's
bf16 gradient reaches the float32 parameter through the same cast as before and accumulates in
float32 in ``.grad``. An adapter is used once per forward (its rows are one block), so no
gradient is summed in bf16.

An entry is reused only while its source parameters are the same tensors, unchanged (identity,
storage pointer and autograd version counter: an in-place update such as an optimizer step, or
a swapped ``.data``, rebuilds it), with the same grad mode (a cast made under ``no_grad`` has no
graph and must never feed a training micro-batch) and the same detached flag.
"""

from __future__ import annotations

from typing import Callable, Hashable, Sequence, TypeVar

import torch
from torch import Tensor

T = TypeVar("T")


class PassWeights:
    """A per-pass cache of adapter casts (see the module doc).

    Memory: one compute-dtype copy of each adapter used in the pass, held until the pass ends;
    for 8 rank-32 runs on Qwen3-4B shapes about 0.5 GB in bf16 (the per-micro-batch casts held
    theirs while each micro-batch's graph lived).
    """

    __slots__ = ("_store", "hits", "builds")

    def __init__(self) -> None:
        self._store: dict[Hashable, tuple[tuple, object]] = {}
        #: counters for tests and traces: values reused / built
        self.hits = 0
        self.builds = 0

    def get(self, key: Hashable, sources: Sequence[Tensor], make: Callable[[], T]) -> T:
        """``make()`` on the first call for ``key`` (and whenever a source changed), else the
        value built before.

        Args:
            key: what the value is (e.g. the parameters' ids, dtype, detached flag); the grad mode
                is added here.
            sources: the parameters the value is computed from.
            make: builds the value (a tensor or tuple of tensors).
        """
        full = (key, torch.is_grad_enabled())
        stamp = tuple((id(t), t.data_ptr(), t._version) for t in sources)
        hit = self._store.get(full)
        if hit is not None and hit[0] == stamp:
            self.hits += 1
            return hit[1]  # type: ignore[return-value]
        value = make()
        self._store[full] = (stamp, value)
        self.builds += 1
        return value

    def __len__(self) -> int:
        return len(self._store)


__all__ = ["PassWeights"]
