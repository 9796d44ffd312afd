"""The numeric tolerances of the SDK-level tests, in one place.

The same tests run in two places:

- CI (CPU, float32 base weights, the tiny offline model): packing, forward vs
  forward_backward, save -> load and sampler vs trainer agree to float32 rounding, most of
  them exactly (the FP32 values are the bounds the tests asserted before this module);
- the GPU conformance run (``bench/gpu_conformance.py``: the same tests against ``openrl
  serve`` on the H200 with a Qwen3-4B-shaped bf16 model and the vLLM sampler, see
  docs/gpu-conformance.md), selected by ``OPENRL_TEST_PRECISION=bf16``. There the kernels of a
  packed pass, of a forward without gradients and of vLLM differ from those of a solo pass in
  their reduction order (GEMM tile shapes follow the number of rows), so results agree only
  within bf16 rounding of the activations.

Every test that compares numbers across passes takes its bound from :data:`TOL` and records
what it saw with :func:`measured` (``$OPENRL_TEST_MEASURES``, one JSON line per measurement),
so that the conformance run's table states what was measured next to the bound;
:func:`check_close` and :func:`check_loss` do both. Which field a comparison uses:

====================  =====================================================================
field                 what is compared
====================  =====================================================================
cobatch_*             one datum / run alone vs packed with others in the same pass
fwd_vs_fwdbwd         forward vs forward_backward of the same datums and weights
save_load             before a save vs after loading it (same bytes), also after one more
                      identical step of the original and the loaded copy
restore               a run whose trainer stopped or died and restored it vs its uninterrupted
                      twin, step by step (logprobs and adapter weights; own-stack tests, CPU only)
repeat_logprob        the same datum and weights in another pass of the same shape (a
                      pipelined vs a waited-for run, before vs after other traffic, a custom
                      loss's forward vs a plain forward, [T, K] column 0 vs the 1-D targets)
sampler_trainer_*     the sampler's logprobs (prompt logprobs, compute_logprobs, sampled
                      tokens) vs the trainer's forward of the same tokens and weights
sampler_repeat        two sampler requests scoring the same tokens (full prompt logprobs vs
                      top-k, last-N or target_prompt_logprobs)
kl_sample_train*      the product's own ``kl_sample_train_v1`` (|mean|) and ``_v2`` metrics
reference_*           the stack vs plain peft + torch AdamW (tests/stack/test_reference_peft.py)
seeded_identical      seeded samples alone vs in a shared batch, token for token
====================  =====================================================================

Loss values checked against a formula use the logprobs of the same pass where the output has
them (precision-free); where the formula needs another pass's logprobs, :func:`check_loss`
widens the float32 bound by the loss's sensitivity times the per-token field above.

All logprob bounds are in nats (natural-log probability units) per token; 0.0 means the
values must be bitwise equal.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class Tolerances:
    """Bounds for one precision (see the module doc).

    Attributes:
        cobatch_logprob: max |delta logprob| of one datum alone vs packed with other datums /
            runs in the same pass (forward or forward_backward).
        cobatch_loss_rel: relative difference of a run's loss (``loss:sum``) trained alone vs
            trained concurrently with other runs, step by step.
        fwd_vs_fwdbwd: max |delta logprob| of forward vs forward_backward on the same datums.
        save_load: max |delta logprob| before a save and after loading it (same weights), and
            after one more identical step of both.
        restore: max |delta| of the logprobs and adapter weights of a restored run vs its
            uninterrupted twin (same seed, data and steps).
        repeat_logprob: max |delta logprob| of the same datum and weights in two passes of the
            same shape.
        sampler_trainer_mean: mean |delta logprob| of the sampler's logprobs vs the trainer's
            forward of the same tokens and weights.
        sampler_trainer_max: max |delta logprob| of the same.
        sampler_repeat: max |delta logprob| of two sampler requests scoring the same tokens.
        kl_sample_train: bound on |``kl_sample_train_v1``| (mean sampler - trainer logprob).
        kl_sample_train_v2: bound on ``kl_sample_train_v2`` (half the mean squared difference).
        reference_loss_rel: relative difference per step of a run's loss vs plain peft +
            torch AdamW trained the same way (``tests/stack/test_reference_peft.py``).
        reference_logprob: max |delta logprob| of the same, after training.
        seeded_identical: seeded samples alone vs in a shared batch are token-for-token
            identical (True on CPU for a distribution cut to the top k tokens; on the GPU vLLM's
            batch shapes change the sampled logits' rounding, so only the shared prefix is
            compared and the fraction identical recorded). Over a random model's near-uniform
            full vocabulary even float32 rounding flips a draw now and then, on the CPU too
            (tests/stack/test_batch_invariance.py records that case only).
    """

    cobatch_logprob: float
    cobatch_loss_rel: float
    fwd_vs_fwdbwd: float
    save_load: float
    restore: float
    repeat_logprob: float
    sampler_trainer_mean: float
    sampler_trainer_max: float
    sampler_repeat: float
    kl_sample_train: float
    kl_sample_train_v2: float
    reference_loss_rel: float
    reference_logprob: float
    seeded_identical: bool


#: float32 on CPU (CI): reductions differ only in summation order; the same bytes and the
#: same pass shape give the same bits.
FP32 = Tolerances(
    cobatch_logprob=1e-4,
    cobatch_loss_rel=1e-4,
    fwd_vs_fwdbwd=1e-6,
    save_load=0.0,
    restore=1e-6,
    repeat_logprob=0.0,
    sampler_trainer_mean=1e-4,
    sampler_trainer_max=1e-4,
    sampler_repeat=1e-5,
    kl_sample_train=1e-4,
    kl_sample_train_v2=1e-6,
    reference_loss_rel=1e-3,
    reference_logprob=1e-3,
    seeded_identical=True,
)

#: bf16 base weights on an H200 (the GPU conformance run), Qwen3-4B shapes with random weights.
#: First stated before measuring (issue 22's targets where it gives one), then set from the
#: H200 run of 2026-12-02 (docs/gpu-conformance.md has every measured value):
#:
#: - ``sampler_trainer_mean`` 0.03: vLLM vs the trainer on the *base model* (no adapter at all)
#:   measured 0.019-0.023 nats mean, max 0.08; the issue's target of 0.02 is below that floor
#:   on this random-weight model, whose next-token distributions are near uniform over 151,936
#:   tokens (every logprob about -12, so bf16 rounding of the hidden state shows in every
#:   token). A policy mismatch (a dropped unembedding LoRA) is tenths of nats to nats.
#: - ``kl_sample_train`` 0.02: the product's on-policy ``kl_sample_train_v1`` (a signed mean over
#:   a few dozen tokens) measured |0.0004-0.0104| per step, 0.0057 at step 0 before any update.
#: - ``cobatch_logprob``: 0.06 measured (alone vs packed with a 3x longer datum); kept at 0.15.
BF16 = Tolerances(
    cobatch_logprob=0.15,
    cobatch_loss_rel=0.05,
    fwd_vs_fwdbwd=0.05,
    save_load=0.05,
    restore=0.05,
    repeat_logprob=0.05,
    sampler_trainer_mean=0.03,
    sampler_trainer_max=0.5,
    sampler_repeat=0.15,
    kl_sample_train=0.02,
    kl_sample_train_v2=1e-3,
    reference_loss_rel=0.05,
    reference_logprob=0.25,
    seeded_identical=False,
)

PRECISION = os.environ.get("OPENRL_TEST_PRECISION", "fp32").lower()
if PRECISION not in ("fp32", "bf16"):
    raise ValueError(f"OPENRL_TEST_PRECISION must be fp32 or bf16, got {PRECISION!r}")
TOL: Tolerances = BF16 if PRECISION == "bf16" else FP32


def measured(name: str, value: float, bound: float | None = None, **info) -> float:
    """Record one measured value (``$OPENRL_TEST_MEASURES``, JSON lines; nothing when unset)
    and return it, so a test reads ``assert measured("x", d, TOL.x) <= TOL.x``.

    Args:
        name: the tolerance's name (a :class:`Tolerances` field) or another label.
        value: what was measured (nats, or a ratio).
        bound: the bound it is checked against.
        info: anything else worth keeping (test, shapes).
    """
    path = os.environ.get("OPENRL_TEST_MEASURES")
    if path:
        test = os.environ.get("PYTEST_CURRENT_TEST", "").rsplit(" (", 1)[0]
        rec = {"name": name, "value": float(value), "bound": bound, "precision": PRECISION,
               "time": time.time(), "test": test, **info}
        with open(path, "a") as f:
            f.write(json.dumps(rec) + "\n")
    return float(value)


def check_close(name: str, got, want, bound: float, **info) -> float:
    """Compare two logprob arrays (nats; any shape, equal shapes) elementwise and record the
    max |got - want| (with the mean) under ``name``.

    Args:
        name: the :class:`Tolerances` field the bound comes from (e.g. ``"save_load"``).
        got, want: array-likes of floats.
        bound: the largest allowed max |got - want| (0.0: bitwise equal).
        info: kept with the measurement.

    Returns:
        The max |got - want|.

    Raises:
        AssertionError: shapes differ, a value is NaN, or the max exceeds ``bound``.
    """
    import numpy as np

    g, w = np.asarray(got, dtype=np.float64), np.asarray(want, dtype=np.float64)
    assert g.shape == w.shape, f"{name}: shapes {g.shape} vs {w.shape}"
    d = np.abs(g - w)
    worst = float(d.max()) if d.size else 0.0
    mean = float(d.mean()) if d.size else 0.0
    measured(name, worst, bound, mean=mean, n=int(d.size), **info)
    assert worst <= bound, (f"{name}: max |delta| {worst:.3g} > {bound:g} (mean {mean:.3g}, "
                            f"precision {PRECISION})\n got  {g.ravel()[:16]}\n want {w.ravel()[:16]}")
    return worst


def check_sampler_trainer(sampler_lp, trainer_lp, **info) -> float:
    """:func:`check_close` of sampler vs trainer logprobs against ``sampler_trainer_max``, and
    their mean |delta| against ``sampler_trainer_mean`` (recorded under that name too).

    Returns:
        The max |delta|.

    Raises:
        AssertionError: either bound is exceeded (or shapes differ, or a value is NaN).
    """
    import numpy as np

    worst = check_close("sampler_trainer_max", sampler_lp, trainer_lp, TOL.sampler_trainer_max, **info)
    mean = float(np.mean(np.abs(np.asarray(sampler_lp, np.float64) - np.asarray(trainer_lp, np.float64))))
    measured("sampler_trainer_mean", mean, TOL.sampler_trainer_mean, **info)
    assert mean <= TOL.sampler_trainer_mean, f"sampler_trainer_mean: {mean:.3g} > {TOL.sampler_trainer_mean:g}"
    return worst


def check_loss(name: str, got: float, want: float, per_token: float, sensitivity: float,
               rel: float = 1e-4, abs_: float = 0.0, **info) -> float:
    """Check a loss value against a formula evaluated on another pass's logprobs.

    The bound is ``max(rel * |want|, abs_, sensitivity * per_token)``: the formula's float32
    rounding, or what the passes' logprob difference can move the loss, whichever is larger.

    Args:
        name: the per-token field's name (recorded as ``loss/<name>``).
        got: the loss the server (or the SDK's custom loss) reported.
        want: the formula's value.
        per_token: the bound on one logprob's difference between the passes (a ``TOL`` field).
        sensitivity: sum over tokens of |d loss / d logprob| (e.g. the sum of |weights|).
        rel, abs_: the float32 bound of the loss alone.

    Returns:
        |got - want|.

    Raises:
        AssertionError: |got - want| exceeds the bound (or is NaN).
    """
    diff = abs(float(got) - float(want))
    bound = max(rel * abs(float(want)), abs_, sensitivity * per_token)
    measured(f"loss/{name}", diff, bound, got=float(got), want=float(want), **info)
    assert diff <= bound, f"loss/{name}: |{got} - {want}| = {diff:.3g} > {bound:.3g} (precision {PRECISION})"
    return diff


def as_dict() -> dict:
    """The active tolerances as a dict (for the conformance table's header)."""
    return {"precision": PRECISION, **asdict(TOL)}
