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

Trainer run state (adapter, optimizer state, seq_id cursor of a live training run) is
mutable, so it lives OUTSIDE the tinker:// namespace, in an internal area that no
listing, sweep or tinker:// path can reach::

    <root>/_runstate/<training_run_id>/HEAD.json            the pointer, written last
    <root>/_runstate/<training_run_id>/<snapshot>/<file>...  one immutable snapshot

A flush writes a new snapshot, then swaps ``HEAD.json`` with a compare-and-set on the
token the writer last saw (GCS: object generation; file: the snapshot name under a
lock file), then deletes the previous snapshot. See :meth:`Storage.put_run_state`.
"""

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


class Storage:
    """Interface of a weight store. All methods are blocking (call them in a thread)."""

    url: str

    def put_dir(self, path: TinkerPath, local_dir: Path, manifest: dict) -> dict:
        """Store every file of ``local_dir`` under ``path`` create-only, then the manifest.

        Raises:
            CheckpointExists: something is already stored at ``path``.
        """
        raise NotImplementedError

    def scratch_dir(self) -> Path | None:
        """Where a writer stages files for :meth:`put_dir` so that storing them moves no bytes
        (a folder on the store's own file system for ``file://``); None: the system temp dir."""
        return None

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

    def copy(self, src: TinkerPath, dst: TinkerPath, manifest: dict) -> dict:
        """Store the files of checkpoint ``src`` under ``dst`` (create-only) with ``manifest``,
        inside the store: no bytes pass through this process (hard links on a file system, a
        server-side copy in GCS). ``manifest["files"]`` must be ``src``'s file table.

        Raises:
            NotFound: no checkpoint at ``src``.
            CheckpointExists: something is already stored at ``dst``.
        """
        raise NotImplementedError

    # ---- trainer run state (mutable; outside the tinker:// namespace) -------------------

    def put_run_state(self, run_id: str, local_dir: Path, info: dict, expect: str | None) -> str:
        """Store the files of ``local_dir`` as a new snapshot of run ``run_id``'s state, then
        point ``_runstate/<run_id>/HEAD.json`` at it (compare-and-set), then delete the
        snapshot the old pointer named.

        Args:
            info: JSON-able fields kept in the pointer (e.g. ``cursor``, ``final``); the
                keys ``format``, ``run_id``, ``snapshot`` and ``files`` are set here.
            expect: the token of the pointer the writer last saw (from :meth:`get_run_state`
                or the previous ``put_run_state``), or None when no pointer may exist yet.

        Returns:
            the new pointer's token.

        Raises:
            RunStateConflict: the pointer is not the one ``expect`` names (nothing changed;
                the new snapshot's files are removed).
            UserError: ``run_id`` is not a valid name.
        """
        raise NotImplementedError

    def get_run_state(self, run_id: str, *, download: bool = True) -> RunState | None:
        """The run's current state, or None when none is stored.

        Args:
            download: False reads only the pointer (``directory`` is None).

        Raises:
            ChecksumMismatch: a snapshot file does not match the pointer.
        """
        raise NotImplementedError

    def delete_run_state(self, run_id: str) -> None:
        """Delete the run's pointer and every snapshot (no-op when none is stored)."""
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

        return self._create(path, manifest, fill)

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


class ExpirySweeper:
    """Runs :func:`sweep_expired` every ``interval_s`` seconds in an asyncio task.

    The gateway runs one (it is the component that never scales to zero); with several
    gateway replicas each sweeps, which is harmless (a checkpoint deleted by another
    replica is skipped). Listings already hide a checkpoint whose ``expires_unix`` has
    passed; the sweep deletes its objects.

    Args:
        storage: the checkpoint store.
        interval_s: seconds between sweeps (``$OPENRL_SWEEP_INTERVAL_S``, default 300);
            0 disables the sweeper.

    Raises:
        ValueError: ``interval_s`` (or the env var) is not a number >= 0.
    """

    def __init__(self, storage: Storage, interval_s: float | None = None):
        raw = interval_s if interval_s is not None else os.environ.get("OPENRL_SWEEP_INTERVAL_S", "300")
        try:
            self.interval_s = float(raw)
        except (TypeError, ValueError):
            raise ValueError(f"OPENRL_SWEEP_INTERVAL_S must be a number of seconds, got {raw!r}") from None
        if self.interval_s < 0:
            raise ValueError(f"OPENRL_SWEEP_INTERVAL_S must be >= 0, got {self.interval_s}")
        self.storage = storage
        self.deleted: list[str] = []  # tinker:// paths deleted by this sweeper (most recent last, capped)
        self._task = None

    def start(self) -> None:
        import asyncio

        if self.interval_s > 0:
            self._task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        import asyncio
        import logging

        log = logging.getLogger("openrl.sweeper")
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                gone = await asyncio.to_thread(sweep_expired, self.storage)
            except Exception:  # noqa: BLE001 - the next round retries
                log.exception("checkpoint TTL sweep failed")
                continue
            if gone:
                log.info("deleted %d expired checkpoint(s): %s", len(gone), ", ".join(gone))
                self.deleted = (self.deleted + gone)[-1000:]

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            self._task = None


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
