"""The transformers backend's running batch: its rows and their left-padded KV cache.

Rows leave the batch (:meth:`RunningBatch.keep`) and new ones join it
(:meth:`RunningBatch.merge`) between decode steps; the cache is edited in place. Touched
only by the backend's worker thread.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor


class RunningBatch:
    """The running rows and their KV cache.

    Attributes:
        rows: B running rows (the backend's per-sequence records).
        cache: the transformers ``DynamicCache``; each layer's ``keys``/``values`` are
            [B, kv_heads, L, head_dim].
        mask: int64 [B, L], 1 where the cache column holds a real token of the row.
        next_tok: int64 [B], the last drawn token of each row (not yet in the cache).
        pos: int64 [B], position id of ``next_tok`` (= tokens of the row in the cache).
    """

    def __init__(self) -> None:
        self.rows: list[Any] = []
        self.cache: Any = None
        self.mask: Tensor | None = None
        self.next_tok: Tensor | None = None
        self.pos: Tensor | None = None

    def __len__(self) -> int:
        return len(self.rows)

    def keep(self, keep: list[int], device: torch.device) -> None:
        """Keep only rows ``keep`` (a non-empty list of row indices, in order); then trim
        cache columns that became padding for every row."""
        if len(keep) != len(self.rows):
            idx = torch.tensor(keep, dtype=torch.long)
            self.rows = [self.rows[i] for i in keep]
            select_cache_rows(self.cache, idx.to(device))
            self.mask = self.mask.index_select(0, idx)
            self.next_tok = self.next_tok.index_select(0, idx)
            self.pos = self.pos.index_select(0, idx)
        used = self.mask.any(dim=0).nonzero()
        c = int(used[0]) if used.numel() else 0
        if c > 0:
            self.mask = self.mask[:, c:]
            for layer in self.cache.layers:
                layer.keys = layer.keys[..., c:, :]
                layer.values = layer.values[..., c:, :]

    def merge(self, new: "RunningBatch") -> None:
        """Append ``new``'s rows (a non-empty batch), left-padding the shorter cache."""
        L, Ln = self.mask.shape[1], new.mask.shape[1]
        T = max(L, Ln)

        def lpad(x: Tensor, n: int, dim: int) -> Tensor:
            if n == 0:
                return x
            shape = list(x.shape)
            shape[dim] = n
            return torch.cat([x.new_zeros(shape), x], dim=dim)

        for layer, nl in zip(self.cache.layers, new.cache.layers):
            layer.keys = torch.cat([lpad(layer.keys, T - L, 2), lpad(nl.keys, T - Ln, 2)], 0)
            layer.values = torch.cat([lpad(layer.values, T - L, 2), lpad(nl.values, T - Ln, 2)], 0)
        self.mask = torch.cat([lpad(self.mask, T - L, 1), lpad(new.mask, T - Ln, 1)], 0)
        self.rows = self.rows + new.rows
        self.next_tok = torch.cat([self.next_tok, new.next_tok])
        self.pos = torch.cat([self.pos, new.pos])


def select_cache_rows(cache: Any, idx: Tensor) -> None:
    """Keep (or repeat) batch rows ``idx`` (int64, on the cache's device) of every layer of
    a ``DynamicCache``, in place."""
    for layer in cache.layers:
        layer.keys = layer.keys.index_select(0, idx)
        layer.values = layer.values.index_select(0, idx)
