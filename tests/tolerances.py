"""The numeric tolerances of the SDK-level tests, in one place.

The same tests run in two places:

- CI (CPU, float32 base weights, the tiny offline model): packing, forward vs
  forward_backward, save -> load and sampler vs trainer agree to float32 rounding;
- the GPU conformance run (``bench/gpu_conformance.sh``: ``openrl serve`` on the H200 with
  a Qwen3-4B-shaped bf16 model and the vLLM sampler), selected by
  ``OPENRL_TEST_PRECISION=bf16``. There the kernels of a packed pass, of a forward without
  gradients and of vLLM differ from those of a solo pass in their reduction order (GEMM tile
  shapes follow the number of rows), so results agree only within bf16 rounding of the
  activations.

Every test that compares numbers takes its bound from :data:`TOL`; :func:`measured` records
the value it saw (``$OPENRL_TEST_MEASURES``, one JSON line per measurement) so that the
conformance run's table can state what was measured next to the bound.

All logprob bounds are in nats (natural-log probability units) per token.
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
        save_load: max |delta logprob| before a save and after loading it (same weights).
        sampler_trainer_mean: mean |delta logprob| of the sampler's logprobs vs the trainer's
            forward of the same tokens and weights.
        sampler_trainer_max: max |delta logprob| of the same.
        kl_sample_train: bound on the product's own ``kl_sample_train_v1`` metric.
        reference_loss_rel: relative difference per step of a run's loss vs plain peft +
            torch AdamW trained the same way (``tests/stack/test_reference_peft.py``).
        reference_logprob: max |delta logprob| of the same, after training.
        seeded_identical: seeded samples alone vs in a shared batch are token-for-token
            identical (True on CPU; on the GPU vLLM's batch shapes change the sampled logits'
            rounding, so only the shared prefix is compared).
    """

    cobatch_logprob: float
    cobatch_loss_rel: float
    fwd_vs_fwdbwd: float
    save_load: float
    sampler_trainer_mean: float
    sampler_trainer_max: float
    kl_sample_train: float
    reference_loss_rel: float
    reference_logprob: float
    seeded_identical: bool


#: float32 on CPU (CI): reductions differ only in summation order.
FP32 = Tolerances(
    cobatch_logprob=1e-4,
    cobatch_loss_rel=1e-4,
    fwd_vs_fwdbwd=1e-5,
    save_load=1e-5,
    sampler_trainer_mean=1e-4,
    sampler_trainer_max=1e-3,
    kl_sample_train=1e-6,
    reference_loss_rel=1e-3,
    reference_logprob=1e-3,
    seeded_identical=True,
)

#: bf16 base weights on an H200 (the GPU conformance run). Bounds stated before measuring
#: (issue 22's targets where it gives one); docs/gpu-conformance.md gives the measured values.
BF16 = Tolerances(
    cobatch_logprob=0.15,
    cobatch_loss_rel=0.05,
    fwd_vs_fwdbwd=0.05,
    save_load=0.05,
    sampler_trainer_mean=0.02,
    sampler_trainer_max=0.5,
    kl_sample_train=1e-3,
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
        rec = {"name": name, "value": float(value), "bound": bound, "precision": PRECISION,
               "time": time.time(), **info}
        with open(path, "a") as f:
            f.write(json.dumps(rec) + "\n")
    return float(value)


def as_dict() -> dict:
    """The active tolerances as a dict (for the conformance table's header)."""
    return {"precision": PRECISION, **asdict(TOL)}
