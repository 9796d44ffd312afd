"""Token drawing for the transformers backend: one token per row from float32 logits.

Per row, ``temperature == 0`` is argmax; otherwise logits / temperature, then top-k, then
top-p (nucleus over the sorted, top-k-filtered distribution), then one uniform draw from
the row's own ``torch.Generator`` (seeded from ``(job seed, sample index)``) inverted
through the CDF. A row's token depends only on its own logits, parameters and generator,
whatever the other rows of the batch do.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor

from openrl.contract.payloads import SamplingParams


def draw(logits: Tensor, params: Sequence[SamplingParams], gens: Sequence[torch.Generator | None]) -> Tensor:
    """One token per row.

    Args:
        logits: float32 [R, V].
        params: the ``sampling_params`` of each row's job (``temperature``, ``top_k``, ``top_p``).
        gens: R generators (None for greedy rows, temperature 0).

    Returns:
        int64 [R] on CPU. Rows with top-k/top-p filtering invert the CDF over the sorted
        distribution, the others over the vocabulary order.
    """
    R, V = logits.shape
    out = torch.empty(R, dtype=torch.long)
    greedy = [r for r, j in enumerate(params) if j.temperature == 0]
    if greedy:
        x = logits
        if len(greedy) != R:
            x = logits.index_select(0, torch.tensor(greedy, dtype=torch.long, device=logits.device))
        out[greedy] = x.argmax(dim=-1).cpu()
    plain, filtered = [], []
    for r, j in enumerate(params):
        if j.temperature > 0:
            (filtered if (0 < j.top_k < V or j.top_p < 1.0) else plain).append(r)
    for group, sort in ((plain, False), (filtered, True)):
        if group:
            out[group] = _draw_group(logits, params, gens, group, sort)
    return out


def _draw_group(logits: Tensor, params: Sequence[SamplingParams], gens: Sequence[torch.Generator | None],
                group: list[int], sort: bool) -> Tensor:
    """Tokens (int64 [n], CPU) for rows ``group`` (temperature > 0) of logits [R, V]."""
    V = logits.shape[1]
    dev = logits.device
    js = [params[r] for r in group]
    temp = torch.tensor([j.temperature for j in js], dtype=torch.float32, device=dev)
    if len(group) != logits.shape[0]:
        logits = logits.index_select(0, torch.tensor(group, dtype=torch.long, device=dev))
    x = logits / temp[:, None]
    u = torch.cat([torch.rand(1, generator=gens[r]) for r in group]).to(dev)  # [n] in [0, 1)
    order = None
    if sort:
        x, order = x.sort(dim=-1, descending=True, stable=True)
        ranks = torch.arange(V, device=dev)[None, :]
        kt = torch.tensor([j.top_k if 0 < j.top_k < V else V for j in js], device=dev)[:, None]
        x = x.masked_fill(ranks >= kt, float("-inf"))
        probs = torch.softmax(x, dim=-1)
        pt = torch.tensor([float(j.top_p) for j in js], dtype=torch.float32, device=dev)[:, None]
        # drop a token when the mass strictly before it already reaches top_p (keeps >= 1)
        drop = ((probs.cumsum(dim=-1) - probs) >= pt) & (pt < 1.0)
        x = x.masked_fill(drop, float("-inf"))
    probs = torch.softmax(x, dim=-1)
    cdf = probs.cumsum(dim=-1)
    target = (u * cdf[:, -1])[:, None]
    choice = torch.searchsorted(cdf, target, right=True).clamp(max=V - 1)  # [n, 1]
    # never land on a zero-probability token through rounding at the top end
    zero = probs.gather(-1, choice) <= 0
    if bool(zero.any()):
        last_nz = (probs > 0).long().cumsum(-1).argmax(-1, keepdim=True)
        choice = torch.where(zero, last_nz, choice)
    tok = choice if order is None else order.gather(-1, choice)
    return tok[:, 0].cpu()


def draw_k(logits: Tensor, temperature: float, k: int, gen: torch.Generator | None) -> Tensor:
    """k independent draws per row from softmax(logits / temperature) (argmax when 0).

    Args:
        logits: float32 [N, V]. gen: CPU generator (unused when temperature is 0).

    Returns:
        int64 [N, k] on logits' device.
    """
    if temperature == 0:
        return logits.argmax(dim=-1, keepdim=True).expand(-1, k).contiguous()
    probs = torch.softmax(logits / temperature, dim=-1).cpu()
    return torch.multinomial(probs, k, replacement=True, generator=gen).to(logits.device)
