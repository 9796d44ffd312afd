"""``file://`` storage: a directory on a local or shared file system."""

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
from openrl.storage.base import Storage
from openrl.storage.layout import KINDS, CHECKPOINT_TYPE, RUNSTATE_DIR, RUNSTATE_HEAD, RUNSTATE_FORMAT, CheckpointExists, ChecksumMismatch, RunStateConflict, RunState, TinkerPath, check_name, sha256_file, file_table, verify_files, new_snapshot_name, run_state_pointer, build_manifest  # noqa: F401


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

    def _create(self, path: TinkerPath, manifest: dict, fill) -> dict:
        """Create checkpoint ``path`` atomically: ``fill(tmp_dir)`` puts its files in a
        temporary directory beside it, which gets the manifest and is renamed into place.

        Raises:
            CheckpointExists: ``path`` exists (the rename fails on a non-empty directory).
        """
        dest = self._dir(path)
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=dest.parent, prefix=".tmp-"))
        try:
            fill(tmp)
            (tmp / "manifest.json").write_text(json.dumps(manifest, indent=1))
            try:
                os.rename(tmp, dest)  # atomic, and fails if dest exists and is non-empty
            except OSError as exc:
                raise CheckpointExists("path", f"{path} already exists; saved weights are immutable") from exc
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
        return manifest

    def put_dir(self, path: TinkerPath, local_dir: Path, manifest: dict) -> dict:
        """As :meth:`Storage.put_dir`; files staged on the store's file system (see
        :meth:`scratch_dir`) are hard-linked in, not copied: the writer deletes its staging
        copy and the stored bytes never change (invariant 4)."""
        def fill(tmp: Path) -> None:
            for f in Path(local_dir).iterdir():
                if f.is_file() and f.name != "manifest.json":
                    try:
                        os.link(f, tmp / f.name)
                    except OSError:  # another file system
                        shutil.copy2(f, tmp / f.name)

        sealed = self.seal_export(path, Path(local_dir), manifest)  # age-encrypted export: ciphertext only
        out = self._create(path, manifest, fill)
        self._forget_export_request(sealed)
        return out

    def _internal_path(self, key: str) -> Path:
        p = (self.root / key).resolve()
        if self.root.resolve() not in p.parents:
            raise UserError("path", f"{key} escapes the storage root")
        return p

    def _put_internal(self, key: str, data: bytes) -> None:
        p = self._internal_path(key)
        p.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=p.parent, prefix=".tmp-")
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, p)

    def _get_internal(self, key: str) -> bytes | None:
        try:
            return self._internal_path(key).read_bytes()
        except FileNotFoundError:
            return None

    def _delete_internal(self, key: str) -> None:
        self._internal_path(key).unlink(missing_ok=True)

    def put_file(self, key: str, src: Path) -> None:
        p = self._internal_path(key)
        p.parent.mkdir(parents=True, exist_ok=True)
        _copy_whole(src, p)

    def get_file(self, key: str, dest: Path) -> bool:
        p = self._internal_path(key)
        if not p.is_file():
            return False
        _copy_whole(p, Path(dest))
        return True

    def scratch_dir(self) -> Path:
        d = self.root / ".scratch"
        d.mkdir(parents=True, exist_ok=True)
        return d

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
        return sorted(p.name for p in self.root.iterdir()
                      if p.is_dir() and not p.name.startswith(".") and p.name != RUNSTATE_DIR)

    def delete(self, path: TinkerPath) -> None:
        d = self._dir(path)
        if not d.exists():
            raise NotFound("checkpoint_id", f"no checkpoint at {path}")
        shutil.rmtree(d)

    def copy(self, src: TinkerPath, dst: TinkerPath, manifest: dict) -> dict:
        source = self.get_dir(src)

        def fill(tmp: Path) -> None:
            for name in manifest["files"]:
                check_name(name, "source_path")
                try:
                    os.link(source / name, tmp / name)  # shared, immutable bytes
                except OSError:
                    shutil.copy2(source / name, tmp / name)  # another file system

        return self._create(dst, manifest, fill)

    # ---- run state -------------------------------------------------------------------------

    def _rs_dir(self, run_id: str) -> Path:
        check_name(run_id, "model_id")
        return self.root / RUNSTATE_DIR / run_id

    @contextmanager
    def _rs_lock(self, base: Path):
        """An exclusive ``flock`` on ``<base>/.lock`` (serialises pointer swaps across processes)."""
        base.mkdir(parents=True, exist_ok=True)
        with open(base / ".lock", "a") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)

    @staticmethod
    def _read_head(base: Path) -> dict | None:
        try:
            return json.loads((base / RUNSTATE_HEAD).read_text())
        except FileNotFoundError:
            return None

    def put_run_state(self, run_id: str, local_dir: Path, info: dict, expect: str | None) -> str:
        base = self._rs_dir(run_id)
        base.mkdir(parents=True, exist_ok=True)
        files = file_table(local_dir)
        snap = new_snapshot_name(info.get("cursor"))
        tmp = Path(tempfile.mkdtemp(dir=base, prefix=".tmp-"))
        try:
            for name in files:
                shutil.copy2(Path(local_dir) / name, tmp / name)
            os.rename(tmp, base / snap)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        with self._rs_lock(base):
            head = self._read_head(base)
            current = head["snapshot"] if head else None
            if current != expect:
                shutil.rmtree(base / snap, ignore_errors=True)
                raise RunStateConflict(f"run state of {run_id}: pointer is at {current!r}, the writer expected "
                                       f"{expect!r} (another trainer flushed or deleted it)")
            fd, tmp_head = tempfile.mkstemp(dir=base, prefix=".head-")
            with os.fdopen(fd, "w") as f:
                f.write(json.dumps(run_state_pointer(run_id, snap, files, info), indent=1))
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp_head, base / RUNSTATE_HEAD)  # the commit point
        if current and current != snap:
            shutil.rmtree(base / current, ignore_errors=True)
        return snap

    def get_run_state(self, run_id: str, *, download: bool = True) -> RunState | None:
        base = self._rs_dir(run_id)
        for _attempt in range(5):
            head = self._read_head(base)
            if head is None:
                return None
            if not download:
                return RunState(None, head, head["snapshot"])
            d = base / head["snapshot"]
            try:
                verify_files(d, head.get("files", {}), f"run state of {run_id}")
            except ChecksumMismatch:
                if self._read_head(base) != head:
                    continue  # replaced (and the old snapshot deleted) while we read it
                raise
            return RunState(d, head, head["snapshot"])
        raise ServerError(f"run state of {run_id} kept changing while it was read; retry")

    def delete_run_state(self, run_id: str) -> None:
        base = self._rs_dir(run_id)
        if not base.exists():
            return
        with self._rs_lock(base):
            (base / RUNSTATE_HEAD).unlink(missing_ok=True)
        shutil.rmtree(base, ignore_errors=True)


def _copy_whole(src: Path, dest: Path) -> None:
    """Copy ``src`` to ``dest`` through a temp file beside ``dest``: readers see all or nothing."""
    fd, tmp = tempfile.mkstemp(dir=dest.parent, prefix=".tmp-")
    os.close(fd)
    try:
        shutil.copyfile(src, tmp)
        os.replace(tmp, dest)
    finally:
        Path(tmp).unlink(missing_ok=True)
