"""The ``tinker://`` path layout, checkpoint manifests and the run-state pointer format
(see :mod:`openrl.storage`)."""

from __future__ import annotations

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import tempfile
import time
import uuid
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

from openrl.errors import NotFound, ServerError, UserError

KINDS = ("weights", "sampler_weights", "external_weights")
CHECKPOINT_TYPE = {"weights": "training", "sampler_weights": "sampler", "external_weights": "external"}
#: top-level directory / object prefix of trainer run state (never a training-run id)
RUNSTATE_DIR = "_runstate"
#: the run-state pointer object inside ``_runstate/<run_id>/``
RUNSTATE_HEAD = "HEAD.json"
RUNSTATE_FORMAT = "openrl.runstate.v1"


class CheckpointExists(UserError):
    """A checkpoint already exists at that tinker:// path (saved weights are immutable)."""

    status = 409


class ChecksumMismatch(ServerError):
    """Stored bytes do not match the manifest's size / sha256 (corruption in the store or in transit)."""


class RunStateConflict(ServerError):
    """The run-state pointer changed since the writer last read or wrote it (another trainer
    flushed or deleted the run's state); nothing was changed by the failed write."""


@dataclass
class RunState:
    """A training run's state as read from storage.

    Attributes:
        directory: local directory holding the snapshot's files, verified against the
            pointer's sizes and sha256 (None when read with ``download=False``).
        info: the pointer's content: ``format``, ``run_id``, ``snapshot``, ``files``
            (name -> {size, sha256}) and the writer's fields (e.g. ``cursor``).
        token: opaque compare-and-set token; pass it as ``expect`` to the next
            :meth:`Storage.put_run_state` of this run.
    """

    directory: Path | None
    info: dict
    token: str


@dataclass(frozen=True)
class TinkerPath:
    """A parsed ``tinker://<training_run_id>/<kind>/<name>`` path."""

    run_id: str
    kind: str
    name: str

    @classmethod
    def parse(cls, path: str, field: str = "path") -> "TinkerPath":
        """Parse and validate a tinker:// path.

        Raises:
            UserError: not ``tinker://run/kind/name``, unknown kind, or a name with
                ``..``, ``/`` or other characters unsafe in object names.
        """
        if not isinstance(path, str) or not path.startswith("tinker://"):
            raise UserError(field, f"expected a tinker:// path, got {path!r}")
        parts = path[len("tinker://") :].split("/")
        if len(parts) != 3 or not all(parts):
            raise UserError(field, f"expected tinker://<training_run_id>/<kind>/<name>, got {path!r}")
        run_id, kind, name = parts
        if run_id == RUNSTATE_DIR:
            raise UserError(field, f"{RUNSTATE_DIR!r} is reserved and is not a training run id")
        if kind not in KINDS:
            raise UserError(field, f"unknown checkpoint kind {kind!r}; expected one of {KINDS}")
        check_name(name, field)
        check_name(run_id, field)
        return cls(run_id, kind, name)

    def __str__(self) -> str:
        return f"tinker://{self.run_id}/{self.kind}/{self.name}"

    @property
    def checkpoint_id(self) -> str:
        """The REST checkpoint id, ``<kind>/<name>``."""
        return f"{self.kind}/{self.name}"

    @property
    def key(self) -> str:
        """Object prefix relative to the storage root."""
        return f"{self.run_id}/{self.kind}/{self.name}"


def check_name(name: str, field: str) -> None:
    """Reject names that could escape the prefix or break object names.

    Raises:
        UserError: empty, ``.``/``..``, or characters outside ``[A-Za-z0-9._:=+-]``.
    """
    allowed = set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._:=+-")
    if not name or name in (".", "..") or ".." in name or any(c not in allowed for c in name) or len(name) > 200:
        raise UserError(field, f"invalid name {name!r}: use letters, digits and . _ : = + - (no '..')")


def sha256_file(path: Path) -> str:
    """Hex sha256 of a file, read in 1 MiB blocks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def file_table(local_dir: Path) -> dict[str, dict]:
    """``{file name: {"size": bytes, "sha256": hex}}`` of the plain files directly in ``local_dir``
    (``manifest.json`` and names starting with ``.`` excluded).

    Raises:
        UserError: a file name that is not a safe object name.
    """
    out = {}
    for f in sorted(Path(local_dir).iterdir()):
        if f.is_file() and f.name != "manifest.json" and not f.name.startswith("."):
            check_name(f.name, "file")
            out[f.name] = {"size": f.stat().st_size, "sha256": sha256_file(f)}
    return out


def verify_files(directory: Path, files: dict, what: str) -> None:
    """Check every file of ``files`` (name -> {size, sha256}) in ``directory``.

    Raises:
        ChecksumMismatch: a file is missing or its size / sha256 differ.
    """
    for name, meta in files.items():
        f = Path(directory) / name
        if not f.is_file():
            raise ChecksumMismatch(f"{what}: {name} is missing")
        size, digest = f.stat().st_size, sha256_file(f)
        if size != meta.get("size") or digest != meta.get("sha256"):
            raise ChecksumMismatch(f"{what}: {name} does not match (size {size} vs {meta.get('size')}, "
                                   f"sha256 {digest} vs {meta.get('sha256')})")


def new_snapshot_name(cursor: int | None = None) -> str:
    """A fresh, unique run-state snapshot name (``c<cursor>-<random>``), sortable by cursor."""
    return f"c{int(cursor or 0):010d}-{uuid.uuid4().hex[:12]}"


def run_state_pointer(run_id: str, snapshot: str, files: dict, info: dict) -> dict:
    """The ``HEAD.json`` content: the writer's ``info`` plus format, run id, snapshot and files."""
    return {**info, "format": RUNSTATE_FORMAT, "run_id": run_id, "snapshot": snapshot, "files": files}


def build_manifest(local_dir: Path, path: TinkerPath, *, owner: str, ttl_seconds: int | None, extra: dict) -> dict:
    """Manifest for a checkpoint directory: type, files with size and sha256, time, ttl, owner."""
    files = {}
    for f in sorted(local_dir.iterdir()):
        if f.is_file() and f.name != "manifest.json":
            files[f.name] = {"size": f.stat().st_size, "sha256": sha256_file(f)}
    now = time.time()
    return {
        "tinker_path": str(path),
        "checkpoint_id": path.checkpoint_id,
        "checkpoint_type": CHECKPOINT_TYPE[path.kind],
        "training_run_id": path.run_id,
        "created_unix": now,
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(now)),
        "ttl_seconds": ttl_seconds,
        "expires_unix": (now + ttl_seconds) if ttl_seconds else None,
        "owner": owner,
        "public": False,
        "size_bytes": sum(v["size"] for v in files.values()),
        "files": files,
        **extra,
    }


