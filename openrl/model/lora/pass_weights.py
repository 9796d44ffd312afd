"""Adapter operands prepared once per pass: the float32 adapters cast to the compute dtype (and,
for several adapters in one block, stacked) at their first use in a pass and reused by every
later micro-batch of it.

Without it, every layer call of every micro-batch casts its adapters' float32 ``A`` and ``B`` to
the activations' dtype (bf16 on CUDA) and, for a block of several adapters, pads and stacks them
again: on the 8-run pass of the eighth session's profile (Qwen3-4B shapes, 7 micro-batches,
activation checkpointing, so each forward runs twice) 12,104 of the pass's 36,299 kernel
launches were ``aten::_to_copy`` (docs/benchmarks.md, "Eighth session"). With a
:class:`PassWeights` the forward side of that work is done once per pass.

Gradients are unchanged, bit for bit: the cached operand keeps its autograd graph (cast, pad,
stack: none of them saves a tensor for backward, so the graph can be traversed by each
micro-batch's own ``backward``); each micro-batch's bf16 gradient reaches the float32 parameter
through the same cast as before and accumulates in float32 in ``.grad``. An operand is used once
per forward (an adapter's rows are one block), so no gradient is summed in bf16.

An entry is reused only while its source parameters are the same tensors, unchanged (identity,
storage pointer and autograd version counter: an in-place update such as an optimizer step, or
a swapped ``.data``, rebuilds it), with the same grad mode (an operand cast under ``no_grad`` has
no graph and must never feed a training micro-batch) and the same detached set.
"""

from __future__ import annotations

from typing import Callable, Hashable, Sequence, TypeVar

import torch
from torch import Tensor

T = TypeVar("T")


class PassWeights:
    """A per-pass cache of prepared adapter operands (see the module doc).

    Memory: one compute-dtype copy of each adapter used in the pass (plus the padded stacks of
    multi-adapter blocks), held until the pass ends; for 8 rank-32 runs on Qwen3-4B shapes about
    0.5 GB in bf16, which the per-micro-batch casts also held while each micro-batch's graph lived.
    """

    __slots__ = ("_store", "hits", "builds")

    def __init__(self) -> None:
        self._store: dict[Hashable, tuple[tuple, object]] = {}
        #: counters for tests and traces: operands reused / built
        self.hits = 0
        self.builds = 0

    def get(self, key: Hashable, sources: Sequence[Tensor], make: Callable[[], T]) -> T:
        """``make()`` on the first call for ``key`` (and whenever a source changed), else the
        value built before.

        Args:
            key: what the operand is (layer, adapters, dtype, detached set); the grad mode is
                added here.
            sources: the parameters the operand is computed from.
            make: builds the operand (a tensor or tuple of tensors).
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
