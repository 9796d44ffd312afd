"""Weight storage shared by trainer and sampler, and the ``tinker://`` path layout.

A checkpoint is a directory of files (PEFT adapter, optimizer state, ...) stored under
one object prefix, with a ``manifest.json`` beside the files:

    <root>/<training_run_id>/<kind>/<name>/manifest.json
    <root>/<training_run_id>/<kind>/<name>/<file>...

where ``tinker://<training_run_id>/<kind>/<name>`` is the Tinker path and ``kind`` is
``weights`` (save_state: adapter + optimizer), ``sampler_weights`` (adapter only) or
``external_weights``. Saved checkpoints are immutable: writes are create-only, a
second write to the same path raises :class:`CheckpointExists`.

Backends are chosen by URL: ``file:///abs/dir`` (the embedded default) or
``gs://bucket/prefix`` (see :mod:`openrl.storage_gcs`).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

from openrl.errors import NotFound, ServerError, UserError

KINDS = ("weights", "sampler_weights", "external_weights")
CHECKPOINT_TYPE = {"weights": "training", "sampler_weights": "sampler", "external_weights": "external"}


class CheckpointExists(UserError):
    """A checkpoint already exists at that tinker:// path (saved weights are immutable)."""

    status = 409


class ChecksumMismatch(ServerError):
    """Stored bytes do not match the manifest's size / sha256 (corruption in the store or in transit)."""


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


class Storage:
    """Interface of a weight store. All methods are blocking (call them in a thread)."""

    url: str

    def put_dir(self, path: TinkerPath, local_dir: Path, manifest: dict) -> dict:
        """Store every file of ``local_dir`` under ``path`` create-only, then the manifest.

        Raises:
            CheckpointExists: something is already stored at ``path``.
        """
        raise NotImplementedError

    def get_dir(self, path: TinkerPath) -> Path:
        """A local directory holding the checkpoint's files, verified against the manifest.

        Raises:
            NotFound: no checkpoint at ``path``.
        """
        raise NotImplementedError

    def manifest(self, path: TinkerPath) -> dict | None:
        raise NotImplementedError

    def write_manifest(self, path: TinkerPath, manifest: dict) -> None:
        """Replace the manifest (ttl / public changes only; the files stay immutable)."""
        raise NotImplementedError

    def list_run(self, run_id: str) -> list[dict]:
        """Manifests of all checkpoints of a training run."""
        raise NotImplementedError

    def list_runs(self) -> list[str]:
        """Training-run ids that have anything stored."""
        raise NotImplementedError

    def delete(self, path: TinkerPath) -> None:
        """Delete the checkpoint and all its files.

        Raises:
            NotFound: nothing stored at ``path``.
        """
        raise NotImplementedError


class FileStorage(Storage):
    """``file:///dir`` backend: checkpoints are plain directories under ``root``."""

    def __init__(self, root: Path):
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.url = self.root.as_uri()

    def _dir(self, path: TinkerPath) -> Path:
        d = (self.root / path.key).resolve()
        if self.root.resolve() not in d.parents:
            raise UserError("path", f"{path} escapes the storage root")
        return d

    def put_dir(self, path: TinkerPath, local_dir: Path, manifest: dict) -> dict:
        dest = self._dir(path)
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=dest.parent, prefix=".tmp-"))
        try:
            for f in Path(local_dir).iterdir():
                if f.is_file() and f.name != "manifest.json":
                    shutil.copy2(f, tmp / f.name)
            (tmp / "manifest.json").write_text(json.dumps(manifest, indent=1))
            try:
                os.rename(tmp, dest)  # atomic, and fails if dest exists and is non-empty
            except OSError as exc:
                raise CheckpointExists("path", f"{path} already exists; saved weights are immutable") from exc
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
        return manifest

    def get_dir(self, path: TinkerPath) -> Path:
        d = self._dir(path)
        if not (d / "manifest.json").exists():
            raise NotFound("path", f"no checkpoint at {path}")
        return d

    def manifest(self, path: TinkerPath) -> dict | None:
        m = self._dir(path) / "manifest.json"
        return json.loads(m.read_text()) if m.exists() else None

    def write_manifest(self, path: TinkerPath, manifest: dict) -> None:
        d = self._dir(path)
        tmp = d / ".manifest.json.tmp"
        tmp.write_text(json.dumps(manifest, indent=1))
        os.replace(tmp, d / "manifest.json")

    def list_run(self, run_id: str) -> list[dict]:
        check_name(run_id, "training_run_id")
        out = []
        base = self.root / run_id
        for kind in KINDS:
            for d in sorted((base / kind).glob("*")) if (base / kind).exists() else []:
                m = d / "manifest.json"
                if m.exists():
                    out.append(json.loads(m.read_text()))
        return out

    def list_runs(self) -> list[str]:
        return sorted(p.name for p in self.root.iterdir() if p.is_dir() and not p.name.startswith("."))

    def delete(self, path: TinkerPath) -> None:
        d = self._dir(path)
        if not d.exists():
            raise NotFound("checkpoint_id", f"no checkpoint at {path}")
        shutil.rmtree(d)


def sweep_expired(storage: Storage, now: float | None = None) -> list[str]:
    """Delete every checkpoint whose manifest ``expires_unix`` is at or before ``now``.

    Works on any backend (it uses ``list_runs`` / ``list_run`` / ``delete``). A checkpoint
    deleted concurrently by someone else is skipped. Returns the deleted tinker:// paths.
    """
    now = time.time() if now is None else now
    deleted = []
    for run_id in storage.list_runs():
        try:
            manifests = storage.list_run(run_id)
        except UserError:  # a directory / prefix that is not a valid run id
            continue
        for m in manifests:
            expires = m.get("expires_unix")
            if expires is None or expires > now:
                continue
            path = TinkerPath.parse(m["tinker_path"])
            try:
                storage.delete(path)
            except NotFound:
                continue
            deleted.append(str(path))
    return deleted


def open_storage(url: str, *, cache_dir: Path | None = None) -> Storage:
    """Open a store by URL: ``file:///abs/dir`` or ``gs://bucket/prefix``.

    Raises:
        ValueError: an unsupported scheme.
    """
    u = urlparse(url)
    if u.scheme == "file":
        return FileStorage(Path(u.path))
    if u.scheme == "gs":
        from openrl.storage_gcs import GCSStorage

        return GCSStorage(u.netloc, u.path.lstrip("/"), cache_dir=cache_dir)
    if u.scheme == "" and url:
        return FileStorage(Path(url))
    raise ValueError(f"unsupported storage URL {url!r}: use file:///dir or gs://bucket/prefix")
