"""Host cost of the trainer's fused AdamW step (``functions.trainer.optim.step_many``), on the CPU.

    python bench/optim_host.py [--runs 8] [--tensors 504] [--reps 15]

A rank-32 Qwen3-4B adapter has 504 parameter tensors; ``step_many`` steps all runs of a pass
at once. On a GPU its kernels are asynchronous launches, so the step's wall time there is
mostly the host's: the Python bookkeeping per run and per tensor plus the launches. This bench
gives every run ``--tensors`` tiny float32 tensors (4 x 16), so the arithmetic is negligible, and
reports per call the median wall time and the time spent in ``step_many``'s own Python
(cProfile ``tottime``; what no kernel explains). Run it at two commits on one machine for a
before / after ratio (``PYTHONPATH=<other checkout> python bench/optim_host.py``).
"""

from __future__ import annotations

import argparse
import cProfile
import json
import platform
import pstats
import statistics
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=8)
    ap.add_argument("--tensors", type=int, default=504)
    ap.add_argument("--reps", type=int, default=15)
    args = ap.parse_args()
    from functions.trainer import optim
    from functions.trainer.optim import AdamConfig, RunOptimizer, step_many

    torch.manual_seed(0)
    torch.set_num_threads(1)
    opts = [RunOptimizer([(f"p{i}", torch.nn.Parameter(torch.randn(4, 16))) for i in range(args.tensors)])
            for _ in range(args.runs)]
    cfg = AdamConfig(learning_rate=1e-3, grad_clip_norm=1.0)

    def fill() -> None:
        for o in opts:
            for p in o.params:
                p.grad = torch.randn_like(p)

    fill()
    step_many([(o, cfg) for o in opts])
    walls, own = [], []
    for _ in range(args.reps):
        fill()
        t = time.perf_counter()
        step_many([(o, cfg) for o in opts])
        walls.append(time.perf_counter() - t)
        fill()
        prof = cProfile.Profile()
        prof.runcall(step_many, [(o, cfg) for o in opts])
        stats = pstats.Stats(prof).stats
        own.append(sum(v[2] for k, v in stats.items() if k[2] in ("step_many", "_prepare", "grad_norm",
                                                                    "_grad_norm_tensor")))
    print(json.dumps({"what": "step_many_host", "runs": args.runs, "tensors_per_run": args.tensors,
                      "wall_ms_median": round(statistics.median(walls) * 1e3, 1),
                      "own_python_ms_median": round(statistics.median(own) * 1e3, 1),
                      "module": optim.__file__, "cpu": platform.processor() or platform.machine(),
                      "torch": torch.__version__}))


if __name__ == "__main__":
    main()
