"""PEFT adapter files: ``adapter_model.safetensors`` (keys
``base_model.model.<module path>.lora_{A,B}.weight``) + ``adapter_config.json``, the layout
``peft.PeftModel.from_pretrained(base, dir)`` and vLLM's LoRA loader read.

With ``train_unembed`` (Tinker's default) the unembedding LoRA is
``base_model.model.lm_head.lora_{A,B}.weight`` ([r, hidden], [vocab, r]) with ``"lm_head"`` in
``target_modules``: the names PEFT gives a LoRA on the ``nn.Linear`` output projection (not
``lora_embedding_{A,B}``, which PEFT uses for ``nn.Embedding``), so PEFT applies it to the
logits only, as the trainer does, also on a tied-embedding base
(tests/stack/test_weights_download.py loads a downloaded adapter with PEFT and matches the
server's logprobs)."""

from __future__ import annotations

import json
from pathlib import Path

from torch import Tensor

from openrl.errors import UserError
from openrl.model.lora.model import MultiLoRAModel

ADAPTER_WEIGHTS_NAME = "adapter_model.safetensors"
ADAPTER_CONFIG_NAME = "adapter_config.json"


def save_peft_adapter(model: MultiLoRAModel, name: str, directory: Path) -> None:
    """Write adapter ``name`` of ``model`` as :data:`ADAPTER_WEIGHTS_NAME` (float32) +
    :data:`ADAPTER_CONFIG_NAME` in ``directory`` (created if needed).

    Raises:
        KeyError: unknown adapter. OSError: the directory cannot be written.
    """
    from safetensors.torch import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    save_file(model.peft_state_dict(name), str(directory / ADAPTER_WEIGHTS_NAME), metadata={"format": "pt"})
    (directory / ADAPTER_CONFIG_NAME).write_text(json.dumps(model.peft_config(name), indent=2, sort_keys=True))


def read_peft_adapter(directory: Path) -> tuple[dict[str, Tensor], dict]:
    """Read ``(state_dict, adapter_config)`` from a PEFT adapter directory (tensors on CPU).

    Raises:
        UserError: files missing or unreadable (field ``checkpoint``).
    """
    from safetensors.torch import load_file

    directory = Path(directory)
    wpath, cpath = directory / ADAPTER_WEIGHTS_NAME, directory / ADAPTER_CONFIG_NAME
    if not wpath.is_file() or not cpath.is_file():
        raise UserError("checkpoint", f"{directory} holds no PEFT adapter ({ADAPTER_WEIGHTS_NAME} + {ADAPTER_CONFIG_NAME})")
    try:
        return load_file(str(wpath)), json.loads(cpath.read_text())
    except Exception as e:  # corrupt file
        raise UserError("checkpoint", f"cannot read adapter in {directory}: {e}") from None


def load_peft_adapter(model: MultiLoRAModel, name: str, directory: Path, seed: int | None = None) -> None:
    """(Re)create adapter ``name`` of ``model`` from a PEFT adapter directory.

    Raises:
        UserError: unreadable files, or an adapter that does not fit the model (field
            ``checkpoint``); a previous adapter ``name`` is then untouched.
    """
    sd, cfg = read_peft_adapter(directory)
    model.load_peft_state_dict(name, sd, cfg, seed=seed)


#: safetensors dtype names (format: https://github.com/huggingface/safetensors#format).
_ST_DTYPES = {"float32": "F32", "bfloat16": "BF16", "float16": "F16"}


def write_adapter_direct(params: list[tuple[str, Tensor]], path: Path, dtype=None) -> int:
    """Write ``params`` as a safetensors file with ONE device-to-host copy and no staging copy:
    the parameters are packed into one flat device buffer (``torch.cat``), the file is created
    at its final size and memory-mapped, and the buffer is copied straight into the mapped
    pages (on a tmpfs such as ``/dev/shm`` that is the only copy the bytes make).

    The file holds the same tensors as :func:`safetensors.torch.save_file` would write
    (metadata ``{"format": "pt"}``; the data in the given order, the header padded with spaces
    to a multiple of 8 bytes), so PEFT, vLLM and :func:`read_peft_adapter` read it. CPU
    tensors are written one after another from their own memory (no packing copy).
    Format: 8-byte little-endian header size N, N bytes of JSON header, then the raw
    little-endian tensor bytes at the header's ``data_offsets`` (safetensors README).

    Args:
        params: ``(key, tensor)`` pairs, any device, all of one dtype after the cast below;
            e.g. :meth:`MultiLoRAModel.named_adapter_parameters` (float32 ``[r, in]`` /
            ``[out, r]``).
        path: the file to create (replaced if present).
        dtype: the stored dtype (default: the first tensor's; float32 / bfloat16 / float16).

    Returns:
        The file's size in bytes.

    Raises:
        ValueError: no parameters, or a dtype safetensors has no name for here.
        OSError: the file cannot be created (e.g. the tmpfs is full: ENOSPC).
    """
    import torch

    if not params:
        raise ValueError("no tensors to write")
    dtype = dtype or params[0][1].dtype
    name = str(dtype).removeprefix("torch.")
    if name not in _ST_DTYPES:
        raise ValueError(f"cannot store dtype {dtype} (float32, bfloat16, float16)")
    esize = torch.empty((), dtype=dtype).element_size()
    header: dict = {"__metadata__": {"format": "pt"}}
    off = 0
    for key, t in params:
        nbytes = t.numel() * esize
        header[key] = {"dtype": _ST_DTYPES[name], "shape": list(t.shape), "data_offsets": [off, off + nbytes]}
        off += nbytes
    hjson = json.dumps(header, separators=(",", ":")).encode()
    hjson += b" " * (-(8 + len(hjson)) % 8)
    prefix = len(hjson).to_bytes(8, "little") + hjson
    path = Path(path)
    if all(t.device.type == "cpu" for _, t in params):
        with open(path, "wb") as f:
            f.write(prefix)
            for _, t in params:
                f.write(memoryview(t.detach().to(dtype).contiguous().reshape(-1).view(torch.uint8).numpy()))
        return len(prefix) + off
    return _write_packed(params, path, dtype, prefix, off)


def _write_packed(params: list[tuple[str, Tensor]], path: Path, dtype, prefix: bytes, nbytes: int) -> int:
    """:func:`write_adapter_direct` for device tensors: one ``torch.cat`` on the device, then one
    copy into the memory-mapped file after ``prefix`` (``nbytes`` of data). Returns the size."""
    import mmap

    import torch

    with torch.no_grad():
        flat = torch.cat([t.detach().reshape(-1).to(dtype) for _, t in params]).view(torch.uint8)
    total = len(prefix) + nbytes
    with open(path, "w+b") as f:
        f.truncate(total)
        with mmap.mmap(f.fileno(), total) as mm:
            mm[:len(prefix)] = prefix
            dst = torch.frombuffer(mm, dtype=torch.uint8, count=nbytes, offset=len(prefix))
            dst.copy_(flat)  # device -> host, straight into the file's pages
            del dst
    return total


def export_peft_direct(model: MultiLoRAModel, name: str, directory: Path) -> int:
    """Write adapter ``name`` of ``model`` as :func:`save_peft_adapter` does (float32
    ``adapter_model.safetensors`` + ``adapter_config.json`` in ``directory``, created if
    needed), through :func:`write_adapter_direct`: one device-to-host copy into the file.

    Returns:
        Bytes written (both files).

    Raises:
        KeyError: unknown adapter. OSError: the directory cannot be written.
    """
    import torch

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    n = write_adapter_direct(model.named_adapter_parameters(name), directory / ADAPTER_WEIGHTS_NAME, torch.float32)
    cfg = json.dumps(model.peft_config(name), indent=2, sort_keys=True)
    (directory / ADAPTER_CONFIG_NAME).write_text(cfg)
    return n + len(cfg)
