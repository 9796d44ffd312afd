"""Which device and dtype the trainer and sampler run on.

Invariant 9 of the design: on a machine with a GPU the functions run on it, with bf16 base
weights, without extra settings. The choice, in order:

- device: an explicit value (``--device`` on ``openrl serve`` / ``openrl run``, a function's
  ``cfg["device"]``), else ``$OPENRL_DEVICE``, else ``"auto"``; ``"auto"`` is ``"cuda"`` when
  ``torch.cuda.is_available()``, else ``"cpu"``.
- dtype of the *base* weights: the registry entry's ``dtype`` (``"bfloat16"``, ``"float16"``,
  ``"float32"`` or ``"auto"``, the default); ``"auto"`` is bfloat16 on CUDA and float32 on
  CPU. LoRA adapters and their AdamW state are always float32 (see ``openrl.model.lora``).
"""

from __future__ import annotations


import torch

from openrl.config import Settings

#: Environment variable naming the device (``auto``, ``cpu``, ``cuda``, ``cuda:N``).
DEVICE_ENV = "OPENRL_DEVICE"
#: Accepted registry / flag spellings of a base-weight dtype.
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
DTYPE_NAMES = ("auto", *DTYPES)


def resolve_device(explicit: str | None = None) -> str:
    """The torch device string the functions use.

    Args:
        explicit: ``"auto"``, ``"cpu"``, ``"cuda"`` or ``"cuda:N"``; None or ``""`` reads
            ``$OPENRL_DEVICE`` (default ``"auto"``).

    Returns:
        ``"cpu"`` or a CUDA device string.

    Raises:
        ValueError: an unknown device name, or a CUDA device asked for where none is available.
    """
    name = (explicit or Settings().device or "auto").strip().lower()
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cpu":
        return "cpu"
    if name == "cuda" or name.startswith("cuda:"):
        if not torch.cuda.is_available():
            raise ValueError(f"device {name!r} asked for ({DEVICE_ENV} or --device), but torch sees no CUDA device")
        return name
    raise ValueError(f"unknown device {name!r} ({DEVICE_ENV} or --device): expected auto, cpu, cuda or cuda:N")


def resolve_dtype(name: str | None, device: str) -> torch.dtype:
    """The dtype of a base model's weights on ``device``.

    Args:
        name: a registry entry's ``dtype``: ``"bfloat16"``, ``"float16"``, ``"float32"``, or
            ``"auto"`` / None (bfloat16 on CUDA, float32 on CPU).
        device: a device string from :func:`resolve_device`.

    Raises:
        ValueError: an unknown dtype name.
    """
    key = (name or "auto").strip().lower()
    if key == "auto":
        return torch.bfloat16 if str(device).startswith("cuda") else torch.float32
    if key not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}: expected one of {', '.join(DTYPE_NAMES)}")
    return DTYPES[key]


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"`` (for logs, metrics and ``openrl status``)."""
    return str(dtype).removeprefix("torch.")
