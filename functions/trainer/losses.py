"""Tinker's built-in loss functions, per datum, with input/config validation.

Every loss maps one datum's

* ``target_logprobs``: float32 [T] (or [T, K] for 2-D cross-entropy targets), the current
  policy's ``log p_theta(target_t | input_<=t)`` with grad (see ``openrl.model.logprobs``),
* ``inputs``: the datum's validated ``loss_fn_inputs`` as tensors on the same device,
* ``config``: the resolved ``loss_fn_config`` (defaults filled in),

to ``(loss, outputs, metrics)``: ``loss`` a scalar summed over tokens (Tinker losses are
sums, never means), ``outputs`` the per-datum ``loss_fn_outputs`` (always ``"logprobs"``,
float32, shape of ``target_tokens``), ``metrics`` ``{"loss:sum": float}``.

Notation: ``lp`` = target_logprobs, ``q`` = ``inputs["logprobs"]`` (the sampler's logprobs
of the same tokens), ``A`` = ``inputs["advantages"]``, ``r = exp(lp - q)`` the per-token
importance ratio. Formulas (as documented for the Tinker API, tinker-docs "Loss Functions"):

``cross_entropy``   ``loss = -sum(lp * weights)``. ``weights`` (optional, default 1) may be
    negative or fractional. 2-D ``target_tokens`` [T, K] with ``weights`` [T, K] give
    ``-sum_{t,k} lp[t,k] * w[t,k]`` (soft / top-K targets; this is also how the SDK's
    ``forward_backward_custom`` sends its surrogate gradient).
``importance_sampling``  ``loss = -sum(r * A)`` (REINFORCE with an importance ratio to
    correct for sampler/learner mismatch).
``ppo``   ``loss = -sum(min(r * A, clip(r, lo, hi) * A))``, the clipped surrogate of
    Schulman et al. 2017, "Proximal Policy Optimization Algorithms" (arXiv:1707.06347).
``cispo`` ``loss = -sum(sg(clip(r, lo, hi)) * A * lp)``, the clipped-IS-weight policy
    optimisation of MiniMax-M1 (MiniMax, 2025, arXiv:2506.13585): the clipped ratio is a
    stop-gradient coefficient, so no token's gradient is ever zeroed.
``gspo``  GSPO-token (Zheng et al. 2025, "Group Sequence Policy Optimization",
    arXiv:2507.18071; the token-level variant Tinker documents): the sequence ratio
    ``s = exp(mean_{t in M}(lp_t - q_t))`` over the tokens ``M`` that ``sequence_ratio_mask``
    marks (!= 0), each token's ratio ``s_t = sg[s] * exp(lp_t - sg[lp_t])`` (s's value, the
    token's own gradient), ``loss = -sum(min(s_t * A, clip(s_t, lo, hi) * A))``.
``dro``   ``loss = -sum(A * lp - beta/2 * (lp - q)^2)``, direct reward optimisation with
    a quadratic penalty (Richemond et al. 2024, "Offline Regularised Reinforcement Learning
    for Large Language Models Alignment", arXiv:2405.19107; Kimi k1.5 2025).

Clip thresholds are *ratio bounds*, exactly as Tinker's ``torch.clamp(prob_ratio,
clip_low_threshold, clip_high_threshold)``: ppo defaults 0.8 / 1.2 (epsilon 0.2, PPO's
usual value), cispo defaults 0.0 / 4.0 (one-sided cap, Tinker's documented default).
gspo uses ppo's 0.8 / 1.2 (Tinker does not publish its default; the GSPO paper's own
ranges are far tighter, e.g. 1 - 3e-4 / 1 + 4e-4: pass them in ``loss_fn_config``). Both can
also be given per token as ``loss_fn_inputs`` of the same names (float32 [T]), which then
override the config. gspo's ``sequence_ratio_mask`` (float32 [T]) is optional: without it
the sequence ratio is taken over the tokens with a non-zero advantage (the sampled tokens
in the usual RL datum, whose prompt positions carry advantage 0 and logprob 0); an empty
mask gives ``s = 1``.

``dro``'s ``beta`` defaults to 0.05 (the value of Tinker's examples).

``stable_reinforce`` is **openrl's own objective** (definition ``openrl_tis_k3_v1``): Tinker
publishes only its contract (sampling-time records made with ``record_stability_info=True``,
datums naming their samples by provenance spans, non-zero advantages only on sampled tokens,
``loss_fn_config`` key ``kl_coeff``), not its formula. The trainer resolves each datum's
``SampledProvenanceSpan`` s to the *recorded* sampler logprobs ``mu`` of those tokens
(:mod:`functions.trainer.stability`); with ``m`` the sampled-token mask, ``C = tis_cap``
(default 2.0), ``beta = kl_coeff`` (default 0.0) and ``r = exp(lp - mu)``::

    loss = -sum_t m_t * sg(min(r_t, C)) * A_t * lp_t            (REINFORCE, truncated IS)
           + beta * sum_t m_t * ((r_t - 1) - log r_t)             (k3 KL estimator)

The first term is REINFORCE with truncated importance sampling against the sampler's own
logprobs (Yao et al. 2025, "Your Efficient RL Framework Secretly Brings You Off-Policy RL
Training", fengyao.notion.site/off-policy-rl; Ionides 2008 for truncated IS), which keeps the
gradient bounded when the sampler (vLLM, bf16, stale weights) and the trainer disagree. The
second is Schulman's k3 estimator (J. Schulman 2020, "Approximating KL Divergence",
joschu.net/blog/kl-approx.html) of KL(sampler || trainer) on the sampler's own samples: >= 0,
zero on-policy, gradient ``(r_t - 1) * grad lp_t``. ``log r`` inside k3 is clamped to [-20, 20]
(a numeric guard; a token that far off-policy would otherwise give an infinite loss). On-policy
(``mu = sg(lp)``, ``beta = 0``, ``C >= 1``) its gradient is importance_sampling's. The client's
``logprobs`` input is accepted and ignored (the recorded ones are used). Metrics:
``stable_reinforce/openrl_tis_k3_v1:max`` = 1.0 names the definition that ran;
``stable_reinforce/sampled_tokens:sum``, ``stable_reinforce/tis_clipped_tokens:sum`` (tokens
with ``r > C``) and ``stable_reinforce/kl_k3:sum`` (the k3 sum, before ``kl_coeff``).

Inputs a loss does not read: a datum may carry any key of :data:`KNOWN_INPUTS` (the SDK's
``Datum`` table: ``target_tokens``, ``weights``, ``advantages``, ``logprobs``, the clip
thresholds, ``sequence_ratio_mask``) with any loss, as hosted Tinker's own examples do (its
losses page puts ``weights`` in the RL datum; the SDK's ``forward_backward_custom`` docs say
datums carry more fields than a loss uses). Each is checked (dtype, shape, finiteness) and
then ignored by a loss that does not read it: ``weights`` does not mask an RL loss (Tinker's
documented RL formulas read only ``target_tokens``, ``logprobs`` and ``advantages``; the
cookbook masks RL datums with zero advantages), ``logprobs`` / ``advantages`` do nothing to
``cross_entropy``. A key outside that table (e.g. the cookbook's client-side ``mask``, which
its ``rl/train.py`` strips before sending) is refused: no loss could read it, and a typo
(``weight``) would otherwise train silently without its mask.

Errors are :class:`openrl.errors.UserError` naming the field: ``loss_fn`` (unknown loss),
``loss_fn_config.<key>`` (unknown key / bad value), ``data[i].loss_fn_inputs.<key>``
(missing, unknown to every loss, wrong dtype, shape or non-finite input), ``data[i].model_input``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Mapping

import numpy as np
import torch
from torch import Tensor

from openrl.edge.proto.decode import LOSS_FN_INPUT_KINDS
from openrl.errors import UserError

LossResult = tuple[Tensor, dict[str, Tensor], dict[str, float]]
LossFn = Callable[[Tensor, Mapping[str, Tensor], Mapping[str, float]], LossResult]


# ---------------------------------------------------------------------------- losses


def _out(lp: Tensor, loss: Tensor) -> LossResult:
    # "loss:sum" stays a 0-dim tensor on the loss's device: reading it here would make the host wait
    # for the GPU once per datum; the engine reads a micro-batch's losses in one transfer
    return loss, {"logprobs": lp.detach()}, {"loss:sum": loss.detach()}


def _thresholds(inputs: Mapping[str, Tensor], config: Mapping[str, float]) -> tuple[Tensor | float, Tensor | float]:
    lo = inputs.get("clip_low_threshold", config["clip_low_threshold"])
    hi = inputs.get("clip_high_threshold", config["clip_high_threshold"])
    return lo, hi


def _clamp(x: Tensor, lo: Tensor | float, hi: Tensor | float) -> Tensor:
    if isinstance(lo, Tensor) or isinstance(hi, Tensor):
        lo_t = lo if isinstance(lo, Tensor) else torch.full_like(x, float(lo))
        hi_t = hi if isinstance(hi, Tensor) else torch.full_like(x, float(hi))
        return torch.minimum(torch.maximum(x, lo_t), hi_t)
    return x.clamp(float(lo), float(hi))


def cross_entropy(lp: Tensor, inputs: Mapping[str, Tensor], config: Mapping[str, float]) -> LossResult:
    """``-sum(lp * weights)``; lp float32 [T] or [T, K]; weights same shape (default ones)."""
    w = inputs.get("weights")
    loss = -(lp * w).sum() if w is not None else -lp.sum()
    return _out(lp, loss)


def importance_sampling(lp: Tensor, inputs: Mapping[str, Tensor], config: Mapping[str, float]) -> LossResult:
    """``-sum(exp(lp - q) * A)``; all [T] float32."""
    ratio = torch.exp(lp - inputs["logprobs"])
    return _out(lp, -(ratio * inputs["advantages"]).sum())


def ppo(lp: Tensor, inputs: Mapping[str, Tensor], config: Mapping[str, float]) -> LossResult:
    """``-sum(min(r * A, clip(r, lo, hi) * A))``, r = exp(lp - q) (Schulman et al. 2017)."""
    ratio = torch.exp(lp - inputs["logprobs"])
    lo, hi = _thresholds(inputs, config)
    adv = inputs["advantages"]
    objective = torch.minimum(ratio * adv, _clamp(ratio, lo, hi) * adv)
    return _out(lp, -objective.sum())


def cispo(lp: Tensor, inputs: Mapping[str, Tensor], config: Mapping[str, float]) -> LossResult:
    """``-sum(sg(clip(r, lo, hi)) * A * lp)`` (MiniMax-M1, 2025)."""
    ratio = torch.exp(lp - inputs["logprobs"])
    lo, hi = _thresholds(inputs, config)
    coef = _clamp(ratio, lo, hi).detach()
    return _out(lp, -(coef * inputs["advantages"] * lp).sum())


def gspo(lp: Tensor, inputs: Mapping[str, Tensor], config: Mapping[str, float]) -> LossResult:
    """GSPO-token (Zheng et al. 2025): ``-sum(min(s_t * A, clip(s_t, lo, hi) * A))`` with
    ``s_t = exp(mean_M(sg[lp] - q) + lp - sg[lp])``; lp, q, A, sequence_ratio_mask all [T]."""
    adv = inputs["advantages"]
    mask = inputs.get("sequence_ratio_mask")
    in_ratio = (mask != 0) if mask is not None else (adv != 0)
    diff = lp.detach() - inputs["logprobs"]
    log_ratio = diff[in_ratio].mean() if bool(in_ratio.any()) else diff.new_zeros(())
    ratio = torch.exp(log_ratio + lp - lp.detach())
    lo, hi = _thresholds(inputs, config)
    objective = torch.minimum(ratio * adv, _clamp(ratio, lo, hi) * adv)
    return _out(lp, -objective.sum())


def dro(lp: Tensor, inputs: Mapping[str, Tensor], config: Mapping[str, float]) -> LossResult:
    """``-sum(A * lp - beta/2 * (lp - q)^2)`` (Richemond et al. 2024)."""
    beta = float(config["beta"])
    objective = lp * inputs["advantages"] - 0.5 * beta * (lp - inputs["logprobs"]) ** 2
    return _out(lp, -objective.sum())


#: loss_fn_inputs the trainer adds for stable_reinforce after resolving provenance
#: (:mod:`functions.trainer.stability`); a client may not send them.
RECORDED_LOGPROBS = "_recorded_logprobs"  # float32 [T]: the recorded sampler logprob, 0 off sampled tokens
SAMPLED_MASK = "_sampled_mask"  # float32 [T]: 1 where loss_fn_input_spans name a sampled token
RESERVED_INPUTS = (RECORDED_LOGPROBS, SAMPLED_MASK)
#: the metric that names which stable_reinforce definition ran (value 1.0)
STABLE_REINFORCE_DEFINITION = "stable_reinforce/openrl_tis_k3_v1:max"
_K3_LOG_RATIO_CLAMP = 20.0


def stable_reinforce(lp: Tensor, inputs: Mapping[str, Tensor], config: Mapping[str, float]) -> LossResult:
    """openrl's ``stable_reinforce`` (definition ``openrl_tis_k3_v1``, see the module docstring):
    ``-sum(m * sg(min(r, C)) * A * lp) + kl_coeff * sum(m * ((r - 1) - log r))`` with
    ``r = exp(lp - mu)``, ``mu`` the recorded sampler logprobs; lp, mu, m, A all float32 [T].
    Sources: truncated IS (Yao et al. 2025), k3 KL estimator (Schulman 2020)."""
    mu, m, adv = inputs[RECORDED_LOGPROBS], inputs[SAMPLED_MASK], inputs["advantages"]
    cap, beta = float(config["tis_cap"]), float(config["kl_coeff"])
    log_ratio = (lp - mu) * m  # 0 off the sampled tokens
    weight = torch.exp(log_ratio.detach()).clamp(max=cap)
    pg = -(m * weight * adv * lp).sum()
    lr = log_ratio.clamp(-_K3_LOG_RATIO_CLAMP, _K3_LOG_RATIO_CLAMP)
    k3 = (m * (torch.exp(lr) - 1.0 - lr)).sum()
    loss = pg + beta * k3 if beta else pg
    sampled = m > 0
    metrics = {
        "loss:sum": float(loss.detach()),
        STABLE_REINFORCE_DEFINITION: 1.0,
        "stable_reinforce/sampled_tokens:sum": float(sampled.sum()),
        "stable_reinforce/tis_clipped_tokens:sum": float((sampled & (log_ratio.detach() > math.log(cap))).sum()),
        "stable_reinforce/kl_k3:sum": float(k3.detach()),
    }
    return loss, {"logprobs": lp.detach()}, metrics


def _check_stable_reinforce(inputs: Mapping[str, Tensor], index: int) -> None:
    """Tinker's contract: non-zero advantages only on sampled tokens."""
    off = (inputs["advantages"] != 0) & (inputs[SAMPLED_MASK] == 0)
    if bool(off.any()):
        t = int(torch.nonzero(off)[0])
        raise UserError(f"data[{index}].loss_fn_inputs.advantages",
                        f"non-zero at position {t}, which loss_fn_input_spans do not attribute to a sampled token "
                        "(stable_reinforce takes advantages on sampled tokens only)")


def merge_metrics(into: dict[str, float], metrics: Mapping[str, float]) -> None:
    """Fold one datum's loss metrics (other than ``loss:sum``) into its request's: ``:sum``
    keys add up, ``:max`` keys keep the largest (the SDK reduces the same suffixes across chunks)."""
    for key, value in metrics.items():
        if key == "loss:sum":
            continue
        if key.endswith(":max"):
            into[key] = max(into.get(key, value), value)
        else:
            into[key] = into.get(key, 0.0) + value


# ------------------------------------------------------------------------- registry


@dataclass(frozen=True)
class LossDef:
    """A built-in loss: its function, the ``loss_fn_inputs`` it takes, its config keys.

    Attributes:
        required: input keys that must be present (besides ``target_tokens``, always required).
        optional: input keys that may be present.
        config_defaults: accepted ``loss_fn_config`` keys and their defaults.
        two_d_targets: whether ``target_tokens`` may be [T, K].
        check: optional extra validation of one datum's prepared inputs ``(inputs, index)``,
            raising :class:`UserError`.
    """

    name: str
    fn: LossFn
    required: tuple[str, ...] = ()
    optional: tuple[str, ...] = ()
    config_defaults: Mapping[str, float] = field(default_factory=dict)
    two_d_targets: bool = False
    check: Callable[[Mapping[str, Tensor], int], None] | None = None


#: every ``loss_fn_inputs`` key a client may send (the SDK's ``Datum`` dtype table, as the
#: gateway decodes it); each loss reads some of them and ignores the rest.
KNOWN_INPUTS: tuple[str, ...] = tuple(LOSS_FN_INPUT_KINDS)

_RL = ("logprobs", "advantages")
_CLIP_INPUTS = ("clip_low_threshold", "clip_high_threshold")

LOSSES: dict[str, LossDef] = {
    "cross_entropy": LossDef("cross_entropy", cross_entropy, optional=("weights",), two_d_targets=True),
    "importance_sampling": LossDef("importance_sampling", importance_sampling, required=_RL),
    "ppo": LossDef(
        "ppo", ppo, required=_RL, optional=_CLIP_INPUTS,
        config_defaults={"clip_low_threshold": 0.8, "clip_high_threshold": 1.2},
    ),
    "cispo": LossDef(
        "cispo", cispo, required=_RL, optional=_CLIP_INPUTS,
        config_defaults={"clip_low_threshold": 0.0, "clip_high_threshold": 4.0},
    ),
    "gspo": LossDef(
        "gspo", gspo, required=_RL, optional=(*_CLIP_INPUTS, "sequence_ratio_mask"),
        config_defaults={"clip_low_threshold": 0.8, "clip_high_threshold": 1.2},
    ),
    "dro": LossDef("dro", dro, required=_RL, config_defaults={"beta": 0.05}),
    "stable_reinforce": LossDef(
        "stable_reinforce", stable_reinforce, required=("advantages", *RESERVED_INPUTS), optional=("logprobs",),
        config_defaults={"kl_coeff": 0.0, "tis_cap": 2.0}, check=_check_stable_reinforce,
    ),
}

#: loss names of the SDK's LossFnType that this server does not implement.
UNSUPPORTED = ("custom",)
_WHY_UNSUPPORTED = {
    "custom": "server-side custom losses are not implemented; forward_backward_custom with a Python "
              "callable (or a client-side LossHandle) works",
}


def get_loss(loss_fn: str) -> LossDef:
    """The :class:`LossDef` of ``loss_fn``.

    Raises:
        UserError("loss_fn", ...): unknown or unsupported loss.
    """
    d = LOSSES.get(loss_fn) if isinstance(loss_fn, str) else None
    if d is None:
        if loss_fn in UNSUPPORTED:
            raise UserError("loss_fn", f"{loss_fn!r} is not supported by this server: {_WHY_UNSUPPORTED[loss_fn]}")
        raise UserError("loss_fn", f"{loss_fn!r} is unknown; supported: {', '.join(LOSSES)}")
    return d


def resolve_config(loss_fn: str, config: Mapping[str, float | str] | None) -> dict[str, float]:
    """Validate ``loss_fn_config`` and fill defaults.

    Returns:
        ``{key: float}`` with every accepted key of the loss.

    Raises:
        UserError: ``loss_fn`` unknown; ``loss_fn_config.<key>`` unknown key, non-numeric or
            non-finite value, or out of range (clip thresholds need 0 <= low <= high; beta >= 0).
    """
    d = get_loss(loss_fn)
    out = dict(d.config_defaults)
    for key, value in (config or {}).items():
        fld = f"loss_fn_config.{key}"
        if key not in d.config_defaults:
            accepted = ", ".join(d.config_defaults) or "none"
            raise UserError(fld, f"unknown key for loss_fn {loss_fn!r} (accepted: {accepted})")
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise UserError(fld, f"must be a number, got {value!r}")
        if not math.isfinite(float(value)):
            raise UserError(fld, f"must be finite, got {value!r}")
        out[key] = float(value)
    if "clip_low_threshold" in out:
        lo, hi = out["clip_low_threshold"], out["clip_high_threshold"]
        if lo < 0:
            raise UserError("loss_fn_config.clip_low_threshold", f"must be >= 0 (it is a ratio bound), got {lo}")
        if hi < lo:
            raise UserError("loss_fn_config.clip_high_threshold", f"must be >= clip_low_threshold ({lo}), got {hi}")
    if out.get("beta", 0.0) < 0:
        raise UserError("loss_fn_config.beta", f"must be >= 0, got {out['beta']}")
    if out.get("kl_coeff", 0.0) < 0:
        raise UserError("loss_fn_config.kl_coeff", f"must be >= 0, got {out['kl_coeff']}")
    if out.get("tis_cap", 1.0) < 1:
        raise UserError("loss_fn_config.tis_cap", f"must be >= 1 (a cap below 1 would down-weight on-policy "
                                                  f"tokens), got {out['tis_cap']}")
    return out


def _as_array(value, fld: str) -> np.ndarray:
    if isinstance(value, torch.Tensor):
        value = value.detach().cpu().numpy()
    try:
        arr = np.asarray(value)
    except Exception as e:  # ragged lists and the like
        raise UserError(fld, f"not a rectangular numeric array: {e}") from None
    if arr.dtype.kind not in "iuf":
        raise UserError(fld, f"must be numeric, got dtype {arr.dtype}")
    return arr


def prepare_inputs(
    loss_fn: str,
    inputs: Mapping[str, object],
    n_tokens: int,
    index: int,
    vocab_size: int | None = None,
    device: torch.device | str = "cpu",
) -> dict[str, Tensor]:
    """Validate one datum's ``loss_fn_inputs`` and convert them to tensors.

    Args:
        loss_fn: the loss name.
        inputs: key -> numpy array (or tensor / nested list).
        n_tokens: length of the datum's model input; ``target_tokens`` must have it as its
            first dimension.
        index: the datum's index in the request (for error field names).
        vocab_size: if given, target ids must lie in ``[0, vocab_size)``.
        device: where the tensors go.

    Returns:
        ``target_tokens`` int64 [T] or [T, K]; the float inputs the loss reads, float32, each
        of the target's shape ([T] for RL inputs and clip thresholds). A key of
        :data:`KNOWN_INPUTS` that the loss does not read (``weights`` with an RL loss,
        ``logprobs`` / ``advantages`` with ``cross_entropy``, ...) is validated like the others
        and left out.

    Raises:
        UserError: ``data[i].loss_fn_inputs.<key>`` missing / unknown to every loss / wrong
            dtype / wrong shape / non-finite / out-of-vocabulary target; ``loss_fn`` unknown.
    """
    d = get_loss(loss_fn)
    base = f"data[{index}].loss_fn_inputs"
    reads = {"target_tokens", *d.required, *d.optional}
    for key in inputs:
        if key not in KNOWN_INPUTS and key not in reads:
            raise UserError(f"{base}.{key}", f"not an input of any loss (known: {', '.join(KNOWN_INPUTS)}); "
                                             "keep client-side fields out of loss_fn_inputs")
    for key in ("target_tokens", *d.required):
        if key not in inputs:
            raise UserError(f"{base}.{key}", f"required by loss_fn {loss_fn!r}")

    fld = f"{base}.target_tokens"
    tt = _as_array(inputs["target_tokens"], fld)
    if tt.dtype.kind == "f":
        if not (np.isfinite(tt).all() and (tt == np.round(tt)).all()):
            raise UserError(fld, "must hold integer token ids")
    ndim_ok = tt.ndim == 1 or (tt.ndim == 2 and d.two_d_targets)
    if not ndim_ok:
        shapes = "[T] or [T, K]" if d.two_d_targets else "[T]"
        raise UserError(fld, f"must have shape {shapes} for loss_fn {loss_fn!r}, got {list(tt.shape)}")
    if tt.shape[0] != n_tokens:
        raise UserError(fld, f"length {tt.shape[0]} must equal the model_input length {n_tokens}")
    if tt.ndim == 2 and tt.shape[1] == 0:
        raise UserError(fld, "the K dimension of [T, K] targets must be >= 1")
    tt = tt.astype(np.int64)
    if vocab_size is not None and tt.size and (tt.min() < 0 or tt.max() >= vocab_size):
        raise UserError(fld, f"token ids must lie in [0, {vocab_size})")
    out = {"target_tokens": torch.from_numpy(np.ascontiguousarray(tt)).to(device)}

    for key, value in inputs.items():
        if key == "target_tokens":
            continue
        fld = f"{base}.{key}"
        arr = _as_array(value, fld)
        want = tt.shape if key == "weights" else tt.shape[:1]
        if tuple(arr.shape) != tuple(want):
            raise UserError(fld, f"shape {list(arr.shape)} must be {list(want)} (that of target_tokens)")
        arr = arr.astype(np.float32)
        if not np.isfinite(arr).all():
            raise UserError(fld, "must be finite (no NaN/inf)")
        if key in _CLIP_INPUTS and (arr < 0).any():
            raise UserError(fld, "clip thresholds are ratio bounds and must be >= 0")
        if key not in reads:
            continue  # a known input this loss does not read: validated above, then ignored (module doc)
        out[key] = torch.from_numpy(np.ascontiguousarray(arr)).to(device)
    if d.check is not None:
        d.check(out, index)
    return out


def compute_loss(
    loss_fn: str, target_logprobs: Tensor, inputs: Mapping[str, Tensor], config: Mapping[str, float]
) -> LossResult:
    """Run loss ``loss_fn`` on one datum (inputs from :func:`prepare_inputs`, config from
    :func:`resolve_config`). Returns ``(loss scalar, {"logprobs": [T] or [T, K]},
    {"loss:sum": float, ...})`` (stable_reinforce adds the metrics the module docstring lists;
    :func:`merge_metrics` folds them per request)."""
    return get_loss(loss_fn).fn(target_logprobs, inputs, config)
