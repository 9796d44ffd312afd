"""Sampler–trainer mismatch: how far the trainer's logprobs of the sampled tokens are from the
logprobs the sampler reported for them, measured on every RL forward(_backward).

A datum of an RL loss (importance_sampling, ppo, cispo, gspo, dro; stable_reinforce with the
logprobs recorded at sampling time) carries ``q``, the sampler's logprob of each target token.
The trainer computes ``lp``, its own logprob of the same token, in the same pass that trains
on it. On-policy (no optimizer step between sampling and this pass) ``q - lp`` is pure
numerics: a different kernel, dtype or batch shape on the sampler side. It is the cookbook's
``optim/kl_sample_train_v1`` / ``_v2`` (tinker_cookbook 0.6.1 ``rl/metrics.py``
``compute_kl_sample_train``), computed here without any client code:

* ``kl_sample_train_v1 = mean_t(q_t - lp_t)``: first-order estimate of KL(sampler || trainer)
  (the tokens were drawn from the sampler, so ``E[q - lp]`` is that KL).
* ``kl_sample_train_v2 = 0.5 * mean_t((q_t - lp_t)^2)``: second-order estimate.
* ``sample_train_logprob_diff_abs`` mean and max of ``|q_t - lp_t|``.

Which tokens count: the cookbook averages over its ``mask`` (the action tokens), which the
SDK does not send. Its RL datums put ``q = 0`` and advantage ``0`` on every observation
(prompt) position, so a token counts here when ``q_t != 0`` or ``A_t != 0``
(:func:`sampled_token_mask`). The only sampled tokens this leaves out are those with a
sampler logprob of exactly 0 (p = 1 in float32) *and* a zero advantage; their ``|q - lp|`` is
``|lp|``, itself ~0, so the means move by less than float noise. A loss that knows its sampled
tokens exactly (stable_reinforce, from its provenance spans) passes its own mask to
:meth:`MismatchStats.add`.

The metric keys follow the SDK's ``name:reduction`` convention
(``tinker.lib.chunked_fwdbwd_helpers``): the SDK merges the results of a call it split into
several requests by that suffix, ``:mean`` weighted by datum count (so across requests the
mean is datum-weighted, not token-weighted), ``:max`` by max, ``:sum`` by sum. Within one
request the values are exact over all its datums, however the trainer packed them.

Healthy values: the cookbook's ``recipes/rl_numerics_check`` reports ``kl_sample_train_v1``
about 2e-4 for a dense model (Qwen3.6-27B) and 1e-3–2e-3 for an MoE (Qwen3.6-35B-A3B); a long
context bug showed up as 0.02–0.16. docs/internals.md ("Sampler–trainer mismatch") says how to
read ours.
"""

from __future__ import annotations

from typing import Mapping

import torch
from torch import Tensor

#: ``loss_fn_inputs`` keys that hold the sampler's logprobs of the target tokens, in order of
#: preference (a loss that resolves recorded logprobs under another key adds it here or calls
#: :meth:`MismatchStats.add` itself).
SAMPLER_LOGPROB_KEYS: tuple[str, ...] = ("logprobs",)

#: the forward_backward metric keys this module reports (``name:reduction``).
METRIC_KEYS = (
    "kl_sample_train_v1:mean",
    "kl_sample_train_v2:mean",
    "sample_train_logprob_diff_abs:mean",
    "sample_train_logprob_diff_abs:max",
    "sample_train_tokens:sum",
)


def sampled_token_mask(inputs: Mapping[str, Tensor], sampler_logprobs: Tensor) -> Tensor:
    """bool [T]: the tokens whose mismatch counts, ``q != 0 or advantages != 0`` (module doc).

    Args:
        inputs: the datum's prepared ``loss_fn_inputs`` (``advantages`` float32 [T], optional).
        sampler_logprobs: float32 [T], the sampler's logprobs ``q``.
    """
    mask = sampler_logprobs != 0
    adv = inputs.get("advantages")
    if adv is not None:
        mask = mask | (adv != 0)
    return mask


class MismatchStats:
    """Running sums of ``d = q - lp`` over the counted tokens of one request's datums.

    :meth:`add` takes one datum's tensors and keeps the sums on their device (no host sync);
    :meth:`metrics` reads them once. Sums are float64.
    """

    def __init__(self) -> None:
        self._sums: Tensor | None = None  # float64 [4]: tokens, sum d, sum d^2, sum |d|
        self._max: Tensor | None = None  # float64 [], max |d|

    def add(self, trainer_logprobs: Tensor, sampler_logprobs: Tensor, mask: Tensor | None = None) -> None:
        """Account one datum.

        Args:
            trainer_logprobs: float32 [T], the trainer's logprobs ``lp`` (detached here).
            sampler_logprobs: float32 [T], the sampler's logprobs ``q`` of the same tokens.
            mask: bool (or 0/1) [T], the tokens that count; None: every token.

        Raises:
            ValueError: shapes differ.
        """
        lp = trainer_logprobs.detach()
        if lp.shape != sampler_logprobs.shape or (mask is not None and mask.shape != lp.shape):
            raise ValueError(f"trainer {tuple(lp.shape)}, sampler {tuple(sampler_logprobs.shape)} and mask "
                             f"{None if mask is None else tuple(mask.shape)} logprobs must have one shape")
        m = torch.ones_like(lp, dtype=torch.float64) if mask is None else mask.to(lp.device, torch.float64)
        d = (sampler_logprobs.to(lp.device, torch.float64) - lp.double()) * m
        a = d.abs()
        part = torch.stack([m.sum(), d.sum(), (d * d).sum(), a.sum()])
        peak = a.max() if a.numel() else a.new_zeros(())
        self._sums = part if self._sums is None else self._sums + part
        self._max = peak if self._max is None else torch.maximum(self._max, peak)

    @property
    def empty(self) -> bool:
        """No datum was added."""
        return self._sums is None

    def metrics(self) -> dict[str, float]:
        """The forward_backward metrics (:data:`METRIC_KEYS`); with no counted token the means
        and the max are 0.0 and ``sample_train_tokens:sum`` is 0 (keys stay present so that the
        SDK can merge the chunks of a split call)."""
        n = s1 = s2 = sa = mx = 0.0
        if self._sums is not None:
            n, s1, s2, sa = (float(x) for x in self._sums.cpu().tolist())
            mx = float(self._max.cpu())
        k = 1.0 / n if n else 0.0
        return {
            "kl_sample_train_v1:mean": s1 * k,
            "kl_sample_train_v2:mean": 0.5 * s2 * k,
            "sample_train_logprob_diff_abs:mean": sa * k,
            "sample_train_logprob_diff_abs:max": mx if n else 0.0,
            "sample_train_tokens:sum": n,
        }


def sampler_logprobs_of(inputs: Mapping[str, Tensor]) -> Tensor | None:
    """The datum's sampler logprobs (the first of :data:`SAMPLER_LOGPROB_KEYS` present), else None."""
    for key in SAMPLER_LOGPROB_KEYS:
        q = inputs.get(key)
        if q is not None:
            return q
    return None


__all__ = ["METRIC_KEYS", "MismatchStats", "SAMPLER_LOGPROB_KEYS", "sampled_token_mask", "sampler_logprobs_of"]
