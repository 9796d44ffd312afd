"""Process-level settings for the torch workers."""

from __future__ import annotations

import os

from openrl.config import Settings


def configure_torch_threads(threads: int | None = None) -> int:
    """Set torch's intra-op threads: ``threads`` (``Settings.torch_threads``), else
    ``$OPENRL_TORCH_THREADS``.

    Default: half the CPU cores (at least 1). The embedded stack runs a trainer and a
    sampler process side by side; letting each use every core oversubscribes the CPU
    and makes small matmuls many times slower. Returns the thread count set.
    """
    import torch

    n = int(threads or Settings().torch_threads or max(1, (os.cpu_count() or 2) // 2))
    torch.set_num_threads(n)
    return n
