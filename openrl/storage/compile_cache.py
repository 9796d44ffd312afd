"""Compile caches kept in storage, so a sampler pod that starts with an empty disk starts warm.

vLLM's engine start is mostly compilation: on an H100 with Qwen3-4B shapes, 12.8 s of Dynamo
bytecode transform and 20 s of Inductor compile, then CUDA-graph capture and the Triton LoRA
kernels' JIT (docs/benchmarks.md, issue 32). vLLM keeps the compiled artefacts in
``VLLM_CACHE_ROOT`` (its AOT-compiled model under ``torch_compile_cache/``), Triton its kernels
in ``TRITON_CACHE_DIR``, Inductor in ``TORCHINDUCTOR_CACHE_DIR``; a second start that finds them
skips the compile. On one machine the state directory keeps them. A Knative pod on GKE starts
with an empty ``/tmp`` at every scale from zero, so there every start was a cold one.

With ``OPENRL_COMPILE_CACHE_SYNC`` (``auto``: on with ``gs://`` storage) the sampler

1. before its engine starts, fetches ``.compile-cache/<tag>.tar.gz`` from storage and unpacks
   it into those directories (:func:`restore`);
2. once the engine is up, packs the directories again and stores the archive when the start
   added files the archive did not have (:func:`save`; in the background, after ready).

``<tag>`` names what the artefacts depend on outside vLLM's own hashes (which key every entry by
the model, the engine configuration and vLLM's source): the torch and vLLM versions and the GPU
name (:func:`cache_tag`). Two pods that compile different things at once both store their
archive; the last one wins, and the entries it lacks are compiled (and stored) by a later start.
An archive that does not unpack (truncated, or a path outside the directory) is skipped with a
logged warning: a cache only ever costs a compile, it is never needed for correctness.
"""

from __future__ import annotations

import logging
import os
import re
import tarfile
import tempfile
import time
from pathlib import Path
from typing import Mapping

log = logging.getLogger(__name__)

#: Cache directory name -> the environment variable that points at it.
CACHE_ENV = {"vllm": "VLLM_CACHE_ROOT", "triton": "TRITON_CACHE_DIR", "inductor": "TORCHINDUCTOR_CACHE_DIR"}
PREFIX = ".compile-cache"


def cache_dirs(env: Mapping[str, str] | None = None) -> dict[str, Path]:
    """``{name: directory}`` of the compile caches set in ``env`` (default ``os.environ``), by
    :data:`CACHE_ENV`; unset ones are left out."""
    env = os.environ if env is None else env
    return {name: Path(env[var]) for name, var in CACHE_ENV.items() if env.get(var)}


def cache_tag(torch_version: str, vllm_version: str | None, device_name: str | None) -> str:
    """The archive's name: ``torch-<v>_vllm-<v>_<gpu>`` with every character outside
    ``[A-Za-z0-9._-]`` replaced by ``-`` (e.g. ``torch-2.11.0-cu130_vllm-0.24.0_NVIDIA-H100-80GB-HBM3``)."""
    raw = f"torch-{torch_version}_vllm-{vllm_version or 'none'}_{device_name or 'cpu'}"
    return re.sub(r"[^A-Za-z0-9._-]", "-", raw)


def _files(dirs: Mapping[str, Path]) -> dict[str, int]:
    """``{"<name>/<relative path>": size}`` of every regular file under ``dirs``."""
    out = {}
    for name, d in dirs.items():
        if not d.is_dir():
            continue
        for p in d.rglob("*"):
            if p.is_file() and not p.is_symlink():
                out[f"{name}/{p.relative_to(d).as_posix()}"] = p.stat().st_size
    return out


def merge_triton(vllm_root: Path, triton_dir: Path) -> int:
    """Copy the Triton kernels that vLLM compiled into its per-hash ``triton_cache`` directories
    (``<vllm_root>/torch_compile_cache/.../triton_cache/<key>/``, written while it compiled the
    model) into ``triton_dir`` (``TRITON_CACHE_DIR``), where a later start that loads the compiled
    model from the cache looks for them (:func:`functions.sampler.backends.vllm_settings.configure_vllm_env`).

    A kernel is a directory named by Triton's cache key; one already in ``triton_dir`` is kept, one
    still being written (``tmp.*``, Triton's staging name) is skipped, and each copy is renamed into
    place whole. Returns the number of kernels copied. Never raises for an unreadable entry (logged).
    """
    import shutil

    copied = 0
    if not vllm_root.is_dir():
        return 0
    triton_dir.mkdir(parents=True, exist_ok=True)
    for base, subdirs, _ in os.walk(vllm_root):
        if os.path.basename(base) != "triton_cache":
            subdirs[:] = [d for d in subdirs if d != "inductor_cache"]
            continue
        subdirs[:] = []  # the kernels below are copied whole
        for key in os.listdir(base):
            src, dst = Path(base) / key, triton_dir / key
            if key.startswith("tmp.") or not src.is_dir() or dst.exists():
                continue
            part = triton_dir / f"tmp.openrl-{os.getpid()}-{key}"
            try:
                shutil.copytree(src, part)
                os.rename(part, dst)
                copied += 1
            except OSError as exc:  # another start copied it first, or the entry went away
                shutil.rmtree(part, ignore_errors=True)
                if not dst.exists():
                    log.warning("triton kernel %s not copied: %s", key, exc)
    return copied


def restore(storage, dirs: Mapping[str, Path], tag: str) -> dict:
    """Unpack the stored archive ``tag`` into ``dirs`` (files already there are kept).

    Returns ``{"found": bool, "files": n, "bytes": archive bytes, "s": seconds, "known": {name: size}}``
    (``known``: what the archive held, for :func:`save`). Never raises for a bad or missing archive.
    """
    t0 = time.perf_counter()
    out: dict = {"found": False, "files": 0, "bytes": 0, "s": 0.0, "known": {}}
    if not dirs:
        return out
    with tempfile.TemporaryDirectory(prefix="openrl-cc-") as tmp:
        arc = Path(tmp) / "cache.tar.gz"
        try:
            if not storage.get_file(f"{PREFIX}/{tag}.tar.gz", arc):
                out["s"] = round(time.perf_counter() - t0, 3)
                return out
            out["found"], out["bytes"] = True, arc.stat().st_size
            with tarfile.open(arc, "r:gz") as tf:
                for m in tf.getmembers():
                    name, _, rel = m.name.partition("/")
                    if not m.isfile() or name not in dirs or not rel:
                        continue
                    dest = dirs[name]
                    target = (dest / rel).resolve()
                    if dest.resolve() not in target.parents:
                        raise tarfile.TarError(f"member {m.name!r} leaves its directory")
                    if target.exists():
                        out["known"][m.name] = m.size
                        continue
                    target.parent.mkdir(parents=True, exist_ok=True)
                    src = tf.extractfile(m)
                    fd, part = tempfile.mkstemp(dir=target.parent, prefix=".part-")
                    with os.fdopen(fd, "wb") as f:
                        while chunk := src.read(1 << 20):
                            f.write(chunk)
                    os.replace(part, target)
                    out["known"][m.name] = m.size
                    out["files"] += 1
        except (OSError, tarfile.TarError, EOFError) as exc:
            log.warning("compile cache %s not restored: %s", tag, exc)
    out["s"] = round(time.perf_counter() - t0, 3)
    log.info("compile cache %s: %s, %d files unpacked in %.1f s", tag,
             "found" if out["found"] else "not in storage yet", out["files"], out["s"])
    return out


def save(storage, dirs: Mapping[str, Path], tag: str, known: Mapping[str, int]) -> dict:
    """Store ``dirs`` as the archive ``tag`` when they hold files that ``known`` (what the stored
    archive held at :func:`restore`) lacks; returns ``{"stored": bool, "files": n, "bytes": b, "s": seconds}``.

    Raises:
        OSError / storage errors: the archive could not be written or stored (nothing is
            stored then; the caller logs it).
    """
    t0 = time.perf_counter()
    now = _files(dirs)
    new = [k for k in now if k not in known]
    out = {"stored": False, "files": len(now), "new": len(new), "bytes": 0, "s": 0.0}
    if not new:
        out["s"] = round(time.perf_counter() - t0, 3)
        return out
    with tempfile.TemporaryDirectory(prefix="openrl-cc-") as tmp:
        arc = Path(tmp) / "cache.tar.gz"
        with tarfile.open(arc, "w:gz", compresslevel=1) as tf:
            for name, d in dirs.items():
                if d.is_dir():
                    for p in sorted(d.rglob("*")):
                        if p.is_file() and not p.is_symlink() and not p.name.startswith(".part-"):
                            tf.add(p, arcname=f"{name}/{p.relative_to(d).as_posix()}", recursive=False)
        storage.put_file(f"{PREFIX}/{tag}.tar.gz", arc)
        out["stored"], out["bytes"] = True, arc.stat().st_size
    out["s"] = round(time.perf_counter() - t0, 3)
    log.info("compile cache %s stored: %d files (%d new), %.1f MB in %.1f s", tag, out["files"], out["new"],
             out["bytes"] / 1e6, out["s"])
    return out


def enabled(mode: str, storage_url: str) -> bool:
    """Whether to sync: ``on``, ``off``, or ``auto`` (on for ``gs://`` storage)."""
    return mode == "on" or (mode == "auto" and storage_url.startswith("gs://"))
