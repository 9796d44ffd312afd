"""Which batch rows use which adapter: the routing metadata of one batch (the role of vLLM's
punica metadata), and the one call a layer makes to add its adapters' deltas under it.

A :class:`LoraRouting` is built once per ``MultiLoRAModel.use_adapters`` block from the
per-row adapter names. It describes the batch as maximal runs ("segments") of rows with the
same adapter, as tensors (``seg_starts``, ``seg_lens``, ``seg_adapter_ids``, and
``row_adapter_ids`` per row) and as Python tuples for slicing, and carries the
:class:`~openrl.model.lora.ops.KernelPlan` chosen for it, so a layer call does no selection.
"""

from __future__ import annotations

from typing import Callable, Mapping, Sequence

import torch
from torch import Tensor

from openrl.model.lora.ops import (
    LoraKernelSettings,
    grouped_lora_delta,
    grouped_mm_support,
    index_add_lora,
    lora_delta,
    stacked_lora_delta,
    select_plan,
)
from openrl.model.lora.pass_weights import PassWeights


#: One block of a layer call: ``(start, end, segments)``; ``segments`` are the ``(start, end,
#: adapter name)`` runs applied together in it, ``()`` for rows given the base output only.
Block = tuple[int, int, tuple[tuple[int, int, str], ...]]


class LoraRouting:
    """Routing of one batch: rows -> adapters, and the kernels that apply them.

    Attributes:
        batch_size: B, the rows the routing was built for.
        row_names: B entries, an adapter name or None (base model only).
        names: the distinct adapter names, in first-seen order; adapter id ``k`` is
            ``names[k]``.
        row_adapter_ids: int64 [B] (CPU), each row's adapter id, -1 for None.
        seg_starts, seg_lens, seg_adapter_ids: int64 [S] (CPU), the maximal runs of rows
            with the same adapter (id -1 for None), in row order; they tile ``[0, B)``.
        segments: when every adapter's rows are contiguous (the trainer orders rows so):
            ``[(start, end, name | None), ...]``, the same runs as tuples; else None.
        groups: when ``segments`` is None: adapter name -> int64 row indices [n] on the
            model's device (the gather / scatter-add path); else empty.
        detached: adapter names whose parameters are used detached (no gradient).
        plan: the kernels chosen for this routing (:func:`ops.select_plan`, from the model's
            :class:`~openrl.model.lora.ops.LoraKernelSettings`).
        pass_weights: the pass's :class:`~openrl.model.lora.pass_weights.PassWeights` (each
            adapter's compute-dtype cast made once for every micro-batch of a pass), or None:
            each layer call casts its own.
    """

    __slots__ = ("segments", "groups", "detached", "batch_size", "row_names", "names", "plan",
                 "row_adapter_ids", "seg_starts", "seg_lens", "seg_adapter_ids", "_cache", "_blocks",
                 "pass_weights")

    def __init__(
        self,
        row_names: Sequence[str | None],
        detached: Sequence[str] = (),
        *,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
        settings: LoraKernelSettings = LoraKernelSettings(),
        pass_weights: PassWeights | None = None,
    ):
        self.pass_weights = pass_weights
        self.row_names = list(row_names)
        self.batch_size = len(self.row_names)
        self.detached = frozenset(detached)
        self.names = list(dict.fromkeys(n for n in self.row_names if n is not None))  # first-seen order
        ids = {n: k for k, n in enumerate(self.names)}
        runs: list[tuple[int, int, str | None]] = []
        for i, name in enumerate(self.row_names):
            if runs and runs[-1][2] == name:
                runs[-1] = (runs[-1][0], i + 1, name)
            else:
                runs.append((i, i + 1, name))
        self.row_adapter_ids = torch.tensor([ids.get(n, -1) if n is not None else -1 for n in self.row_names],
                                            dtype=torch.long)
        self.seg_starts = torch.tensor([s for s, _, _ in runs], dtype=torch.long)
        self.seg_lens = torch.tensor([e - s for s, e, _ in runs], dtype=torch.long)
        self.seg_adapter_ids = torch.tensor([ids[n] if n is not None else -1 for _, _, n in runs], dtype=torch.long)
        named = [n for _, _, n in runs if n is not None]
        contiguous = len(named) == len(set(named))  # each adapter's rows are one run
        self.segments = runs if contiguous else None
        self.groups: dict[str, Tensor] = {}
        if not contiguous:
            rows: dict[str, list[int]] = {}
            for i, name in enumerate(self.row_names):
                if name is not None:
                    rows.setdefault(name, []).append(i)
            self.groups = {k: torch.tensor(v, dtype=torch.long, device=device) for k, v in rows.items()}
        self.plan = select_plan(contiguous, len(self.names), torch.device(device), dtype, settings)
        self._cache: dict[tuple, Tensor] = {}
        self._blocks: dict[tuple, tuple[Block, ...]] = {}

    # ------------------------------------------------------------------ small cached tensors

    def cached(self, key: tuple, make: Callable[[], Tensor]) -> Tensor:
        """A small per-routing tensor (offsets, scale columns, masks) built once by ``make()``."""
        t = self._cache.get(key)
        if t is None:
            t = make()
            self._cache[key] = t
        return t

    def mask(self, names: Sequence[str], ranks: Sequence[int], scales: Sequence[float],
             dtype: torch.dtype, device: torch.device, rows: tuple[int, int]) -> Tensor:
        """[end - start, sum(ranks)] matrix for batch rows [start, end): ``scales[g]`` on
        row b / the columns of adapter g when row b uses adapter g, else 0 (cached)."""

        def make() -> Tensor:
            start, end = rows
            row_names = self.row_names[start:end]
            m = torch.zeros(end - start, sum(ranks), dtype=torch.float32)
            col = 0
            for name, r, sc in zip(names, ranks, scales):
                idx = [i for i, n in enumerate(row_names) if n == name]
                m[idx, col : col + r] = sc
                col += r
            return m.to(device=device, dtype=dtype)

        return self.cached(("mask", tuple(names), tuple(ranks), tuple(scales), dtype, device, rows), make)

    # ------------------------------------------------------------------ the layer call

    def add_lora(
        self,
        y: Tensor,
        x: Tensor,
        lora_a: Mapping[str, Tensor],
        lora_b: Mapping[str, Tensor],
        scaling: Mapping[str, float],
    ) -> Tensor:
        """``y`` plus, on every row, the delta of the row's adapter (out of place).

        Args:
            y: [B, ..., out], the base layer's output.
            x: [B, ..., in], the layer input.
            lora_a / lora_b / scaling: the layer's adapters: name -> A [r, in], B [out, r]
                (float32 parameters) and ``alpha / r``. Rows whose adapter the layer lacks
                get the base output only.

        Returns:
            [B, ..., out] in y's dtype.

        Raises:
            RuntimeError: x has a different number of rows than the routing.
        """
        if x.shape[0] != self.batch_size:
            raise RuntimeError(
                f"MultiLoRALinear got a batch of {x.shape[0]} rows but routing is for {self.batch_size}"
            )
        present = tuple((n, lora_a[n].shape[0]) for n in self.names if n in lora_a)  # (name, rank)
        if not present:
            return y

        cache = self.pass_weights

        def weights(name: str, alone: bool = False) -> tuple[Tensor, Tensor]:
            """The adapter's (A, B), detached for a no-grad adapter. ``alone`` (applied by itself,
            not stacked with others) and a pass cache: cast to x's dtype once per pass (the
            kernel's own cast is then a no-op). A stacked block keeps casting its concatenation
            per call: cached per-adapter casts would save its forward cast but split its
            backward cast into one per adapter (measured: more casts in all)."""
            a, b = lora_a[name], lora_b[name]
            det = name in self.detached
            if alone and cache is not None and a.dtype != x.dtype:
                return cache.get(("cast", id(a), id(b), det, x.dtype), (a, b),
                                 lambda: ((a.detach() if det else a).to(x.dtype), (b.detach() if det else b).to(x.dtype)))
            return (a.detach(), b.detach()) if det else (a, b)

        if self.segments is None:
            return self._add_interleaved(y, x, [n for n, _ in present], weights, scaling)
        blocks = self._blocks.get(present)
        if blocks is None:  # planned once per routing and set of adapters (layers share it)
            blocks = self._blocks[present] = self.plan_blocks(present)
        # Each block works on its slice of rows (views): base output only, a single adapter as
        # one delta, several as one grouped or stacked delta. One concatenation.
        parts: list[Tensor] = []
        for s0, e1, segs in blocks:
            if not segs:
                parts.append(y[s0:e1])
                continue
            whole = s0 == 0 and e1 == x.shape[0]
            xs, ys = (x, y) if whole else (x[s0:e1], y[s0:e1])
            names = [n for _, _, n in segs]
            ws = [weights(n) for n in names]
            if len(names) == 1:
                d = lora_delta(xs, *weights(names[0], alone=True), scaling[names[0]])
            elif self.plan.grouped and _grouped_fits(xs, segs, ws[0][1].shape[0]):
                d = self._grouped(xs, segs, ws, [scaling[n] for n in names])
            else:
                m = self.mask(names, [a.shape[0] for a, _ in ws], [scaling[n] for n in names],
                              xs.dtype, xs.device, (s0, e1))
                d = stacked_lora_delta(xs, [a for a, _ in ws], [b for _, b in ws], m)
            parts.append(ys + d.to(y.dtype))
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)

    def plan_blocks(self, present: Sequence[tuple[str, int]]) -> tuple[Block, ...]:
        """The blocks a layer with adapters ``present`` (``(name, rank)``, in :attr:`names`
        order) works in, when every adapter's rows are contiguous: ``(start, end, segments)``
        tiling ``[0, B)`` in row order, where ``segments`` is ``()`` for rows that get the base
        output only (no adapter, or one this layer lacks) and else the consecutive
        ``(start, end, name)`` runs applied together, of summed rank <= the plan's
        ``rank_cap`` (a single adapter may exceed it, alone). Pure; cached per ``present`` by
        :meth:`add_lora`.

        Raises:
            RuntimeError: the routing's adapters are not contiguous (``segments`` is None).
        """
        if self.segments is None:
            raise RuntimeError("plan_blocks needs contiguous adapter rows")
        ranks = dict(present)
        cap = self.plan.rank_cap
        blocks: list[Block] = []
        block: list[tuple[int, int, str]] = []
        for start, end, name in self.segments:
            if block and (name not in ranks or sum(ranks[n] for _, _, n in block) + ranks[name] > cap):
                blocks.append((block[0][0], block[-1][1], tuple(block)))
                block = []
            if name is None or name not in ranks:
                blocks.append((start, end, ()))
            else:
                block.append((start, end, name))
        if block:
            blocks.append((block[0][0], block[-1][1], tuple(block)))
        return tuple(blocks)

    def _add_interleaved(self, y: Tensor, x: Tensor, present: list[str], weights, scaling) -> Tensor:
        """Rows of some adapter are not contiguous: one stacked delta over the whole batch
        when the summed rank fits the plan's cap, else gather / scatter-add per adapter."""
        ws = {n: weights(n) for n in present}
        if len(present) > 1 and sum(ws[n][0].shape[0] for n in present) <= self.plan.rank_cap:
            m = self.mask(present, [ws[n][0].shape[0] for n in present], [scaling[n] for n in present],
                          x.dtype, x.device, (0, x.shape[0]))
            d = stacked_lora_delta(x, [ws[n][0] for n in present], [ws[n][1] for n in present], m)
            return y + d.to(y.dtype)
        for name, rows in self.groups.items():
            if name in ws:
                y = index_add_lora(y, x, rows, *weights(name, alone=True), scaling[name])
        return y

    def _grouped(self, xs: Tensor, block: Sequence[tuple[int, int, str]], ws: list[tuple[Tensor, Tensor]],
                 scales: list[float]) -> Tensor:
        """:func:`ops.grouped_lora_delta` for one block of contiguous segments (offsets and
        the per-token scale column cached on the routing)."""
        per_row = xs[0].numel() // xs.shape[-1] if xs.shape[0] else 0
        s0 = block[0][0]
        spans = tuple((s, e) for s, e, _ in block)
        offs = self.cached(
            ("offs", spans, per_row, xs.device),
            lambda: torch.tensor([(e - s0) * per_row for _, e, _ in block], dtype=torch.int32).to(xs.device),
        )
        if len(set(scales)) == 1:
            scale: float | Tensor = scales[0]
        else:
            scale = self.cached(
                ("scale", spans, tuple(scales), per_row, xs.dtype, xs.device),
                lambda: torch.cat(
                    [torch.full(((e - s) * per_row, 1), sc, dtype=torch.float32) for (s, e, _), sc in zip(block, scales)]
                ).to(device=xs.device, dtype=xs.dtype),
            )
        return grouped_lora_delta(xs, [a for a, _ in ws], [b for _, b in ws], offs, scale)


def _grouped_fits(xs: Tensor, block: Sequence[tuple[int, int, str]], out_features: int) -> bool:
    """Layout conditions of ``torch._grouped_mm`` for this block: 16-byte aligned row
    strides on CUDA (in/out features multiples of 8 for bf16), the kernel usable for xs's
    device/dtype and, where the self-check said so, group sizes (rows x tokens per row)
    that are multiples of 16."""
    if xs.is_cuda and (xs.shape[-1] % 8 or out_features % 8):
        return False
    support = grouped_mm_support(xs.device, xs.dtype)
    if support is None:
        return False
    if support == "aligned":
        per_row = xs[0].numel() // xs.shape[-1] if xs.shape[0] else 0
        return all(((e - s) * per_row) % 16 == 0 for s, e, _ in block)
    return True


class Router:
    """Holder of the current routing, shared by all ``MultiLoRALinear`` layers of one model
    (set by ``MultiLoRAModel.use_adapters``; None: base model only)."""

    __slots__ = ("current",)

    def __init__(self) -> None:
        self.current: LoraRouting | None = None


__all__ = ["Block", "LoraRouting", "Router"]
