"""Sampler snapshots handed from the trainer to a sampler on the same machine through host
shared memory (issue 31 item 1).

``save_weights_and_get_sampling_client()`` (an unnamed ``save_weights_for_sampler``) is on the
critical path of every RL step. On one machine (the embedded stack: ``openrl serve``, where
``OPENRL_COLOCATED_SAMPLER`` is set) the trainer packs such a snapshot on the GPU under its
engine lock and writes it into a file on a tmpfs through a pinned host buffer after releasing the
lock (:mod:`openrl.model.lora.packed`), answers the future, and writes the durable checkpoint (manifest with
sha256, storage ``put_dir``) in the background. The sampler finds the snapshot here before it
asks storage; vLLM memory-maps the file. Nothing here replaces storage: every snapshot still
becomes an immutable durable checkpoint at the same ``tinker://`` path (invariant 4), which is
what listings, downloads and a machine restart see. Named snapshots (``save_weights_for_sampler
(name)``, ``save_state``) are written durably before their future resolves, as before.

Layout (``root`` = ``$OPENRL_HANDOFF_DIR``, default ``/dev/shm/openrl-<hash of the state dir>``)::

    <root>/<run>/sampler_weights/<name>/adapter_model.safetensors, adapter_config.json
    <root>/<run>/sampler_weights/<name>/.meta.json   what the durable manifest needs (owner, ttl, ...)
    <root>/<run>/sampler_weights/<name>/.durable     present once storage holds the checkpoint
    <root>/.pins/<pid>/<run>/sampler_weights/<name>/ hard links: what a sampler process loaded

An entry appears whole (written in a ``.tmp-*`` directory beside it, then renamed), and its
files never change. Entries are evicted oldest first when the handoff holds more than
``max_bytes``, but only once durable and at least ``keep_s`` old (a sampler that found the
entry a moment ago still reads it; a reader that loses the race falls back to storage; a
sampler pins what it loaded, :meth:`SnapshotHandoff.pin`, so a later read of the same
directory never finds it gone). When
there is no room (entries not yet durable fill it, or the tmpfs is full) a save takes the
durable path directly: slower, never wrong.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable

from openrl.storage.layout import TinkerPath

log = logging.getLogger("openrl.storage.handoff")

META_NAME = ".meta.json"
DURABLE_NAME = ".durable"
PINS_DIR = ".pins"
SPARES_DIR = ".spare"  # pre-allocated files a save writes into (Settings.handoff_spares)
#: the default cap: this share of the tmpfs' size, and never more than DEFAULT_CAP_BYTES
DEFAULT_SHARE = 0.25
DEFAULT_CAP_BYTES = 16 << 30


def default_root(home: Path) -> Path | None:
    """``/dev/shm/openrl-<12 hex of sha1(home)>``, or None when ``/dev/shm`` is not a writable
    directory (then the handoff is off unless ``OPENRL_HANDOFF_DIR`` names one)."""
    shm = Path("/dev/shm")
    if not (shm.is_dir() and os.access(shm, os.W_OK)):
        return None
    return shm / f"openrl-{hashlib.sha1(str(home).encode()).hexdigest()[:12]}"


class SnapshotHandoff:
    """A directory of sampler snapshots shared by a trainer and a sampler on one machine.

    Args:
        root: the directory (created); on a tmpfs for the copy to stay in memory.
        max_bytes: the most bytes of entries it holds (0: :data:`DEFAULT_SHARE` of the file
            system's size, capped at :data:`DEFAULT_CAP_BYTES`).
        keep_s: seconds an entry stays after it was written, durable or not.
    """

    def __init__(self, root: Path, max_bytes: int = 0, keep_s: float = 60.0):
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        if not max_bytes:
            st = os.statvfs(self.root)
            max_bytes = min(int(st.f_blocks * st.f_frsize * DEFAULT_SHARE), DEFAULT_CAP_BYTES)
        self.max_bytes = int(max_bytes)
        self.keep_s = float(keep_s)
        self._room = threading.Lock()  # the room check and the bytes of writes under way
        self._reserved = 0

    @classmethod
    def from_settings(cls, cfg) -> "SnapshotHandoff | None":
        """The handoff of a process with :class:`openrl.config.Settings` ``cfg``, or None when it
        is off: ``colocated_sampler`` unset (trainer and sampler on different machines, e.g.
        Knative pods: storage is the only way), ``handoff_dir`` = ``off``, or no default
        directory (:func:`default_root`)."""
        root = cls.root_for(cfg) if cfg.colocated_sampler else None
        if root is None:
            return None
        try:
            return cls(root, cfg.handoff_max_bytes)
        except OSError as exc:  # e.g. a read-only /dev/shm: the durable path alone
            log.warning("snapshot handoff off: %s: %s", root, exc)
            return None

    @staticmethod
    def root_for(cfg) -> Path | None:
        """The handoff directory that Settings ``cfg`` name (``handoff_dir``, else
        :func:`default_root` of ``home``), or None when it is ``off`` or there is none."""
        if (cfg.handoff_dir or "").lower() == "off":
            return None
        return Path(cfg.handoff_dir) if cfg.handoff_dir else default_root(cfg.home_dir)

    # ------------------------------------------------------------------ readers

    def dir_of(self, path: TinkerPath) -> Path:
        """Where the entry of ``path`` lives (whether it exists or not)."""
        return self.root / path.key

    def get(self, path: TinkerPath) -> Path | None:
        """The entry's directory when ``path`` is held here, else None."""
        d = self.dir_of(path)
        return d if (d / META_NAME).is_file() else None

    def durable(self, path: TinkerPath) -> bool:
        """Whether storage already holds ``path`` (False for an entry not held here)."""
        return (self.dir_of(path) / DURABLE_NAME).exists()

    def meta(self, path: TinkerPath) -> dict:
        """What :meth:`put` was given as ``meta`` for ``path``.

        Raises:
            FileNotFoundError: not held here.
        """
        return json.loads((self.dir_of(path) / META_NAME).read_text())

    # ------------------------------------------------------------------ the sampler's pins

    def _pins(self) -> Path:
        return self.root / PINS_DIR / str(os.getpid())

    def pin(self, path: TinkerPath) -> Path | None:
        """A directory holding the entry of ``path`` that stays readable, whatever the trainer
        evicts, until :meth:`unpin_except` drops it: hard links (same tmpfs, no copy) under
        ``<root>/.pins/<pid>/``. None when the entry is not here (or was just evicted).

        The sampler pins what it loads: a backend may read an adapter's directory again later
        (the routed backend's transformers fallback does, on its first routed job).
        """
        src = self.get(path)
        if src is None:
            return None
        dest = self._pins() / path.key
        if (dest / META_NAME).is_file():
            return dest
        tmp = dest.parent / f".tmp-{dest.name}-{threading.get_ident()}-{time.monotonic_ns()}"
        try:
            tmp.mkdir(parents=True)
            for f in src.iterdir():
                if f.is_file() and f.name != DURABLE_NAME:
                    os.link(f, tmp / f.name)
            os.rename(tmp, dest)
        except OSError:  # pinned meanwhile by another request of this process (ENOTEMPTY), or evicted
            shutil.rmtree(tmp, ignore_errors=True)
        return dest if (dest / META_NAME).is_file() else None

    def unpin_except(self, keep: set[str]) -> None:
        """Drop this process's pins whose ``tinker://`` path is not in ``keep``."""
        base = self._pins()
        for m in _below(base, 3, META_NAME):
            try:
                if json.loads(m.read_text()).get("tinker_path") not in keep:
                    shutil.rmtree(m.parent, ignore_errors=True)
            except (OSError, ValueError):
                shutil.rmtree(m.parent, ignore_errors=True)

    def drop_dead_pins(self) -> None:
        """Remove the pins of processes that no longer run (a sampler that crashed)."""
        for d in _below(self.root / PINS_DIR, 1):
            try:
                os.kill(int(d.name), 0)
            except (ValueError, ProcessLookupError):
                shutil.rmtree(d, ignore_errors=True)
            except PermissionError:  # alive, another user's
                pass

    # ------------------------------------------------------------------ the trainer's side

    def put(self, path: TinkerPath, nbytes: int, write: Callable[[Path], object], meta: dict) -> Path | None:
        """Add the entry of ``path``: ``write(dir)`` fills a new directory, which is renamed
        into place with ``meta`` beside the files.

        Args:
            nbytes: about how many bytes ``write`` will write (for the room check).

        Returns:
            The entry's directory, or None when there is no room (after evicting what may go)
            or the file system refused the write (ENOSPC): the caller then writes to storage.

        Raises:
            whatever ``write`` raises other than OSError; FileExistsError: ``path`` is here
            already (snapshots are immutable).
        """
        if self.get(path) is not None:
            raise FileExistsError(f"{path} is already in the handoff")
        with self._room:  # concurrent puts (the trainer writes two at a time) count each other's bytes
            if not self.make_room(nbytes + self._reserved):
                return None
            self._reserved += nbytes
        try:
            return self._put(path, write, meta)
        finally:
            with self._room:
                self._reserved -= nbytes

    def _put(self, path: TinkerPath, write: Callable[[Path], object], meta: dict) -> Path | None:
        dest = self.dir_of(path)
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=dest.parent, prefix=".tmp-"))
        try:
            write(tmp)
            (tmp / META_NAME).write_text(json.dumps({**meta, "written_unix": time.time()}))
            os.rename(tmp, dest)
        except OSError as exc:
            log.warning("snapshot handoff: %s not written here (%s); storage takes it", path, exc)
            return None
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
        return dest

    # ------------------------------------------------------------------ spare files

    def take_spare(self, nbytes: int, dest: Path) -> bool:
        """Move a spare file of exactly ``nbytes`` bytes to ``dest`` (a new name on this file
        system, e.g. in the directory :meth:`put` hands its writer). Its pages are allocated
        already, so writing over them is a memcpy, where a new tmpfs file first has the kernel
        allocate and zero every page (284 MB: 0.11-0.15 s, docs/benchmarks.md). True if one was
        there; concurrent takers each get their own or none."""
        d = self.root / SPARES_DIR
        if not d.is_dir():
            return False
        for f in sorted(d.glob(f"{int(nbytes)}-*")):
            try:
                os.rename(f, dest)
                return True
            except FileNotFoundError:  # taken by a concurrent writer
                continue
        return False

    def make_spares(self, nbytes: int, count: int) -> int:
        """Allocate spare files of ``nbytes`` bytes (``posix_fallocate``: the pages are
        allocated and zeroed now, off a save's path) until ``count`` of that size exist, within
        ``max_bytes`` (spares count as used, and :meth:`make_room` drops them first) and the
        file system's free space. Returns how many were made; an OSError (ENOSPC) stops it."""
        d = self.root / SPARES_DIR
        made = 0
        d.mkdir(parents=True, exist_ok=True)
        while len(list(d.glob(f"{int(nbytes)}-*"))) < count:
            with self._room:
                st = os.statvfs(self.root)
                if self.size() + self._reserved + nbytes > self.max_bytes or \
                        nbytes * 2 >= st.f_bavail * st.f_frsize:
                    return made
                self._reserved += nbytes
            tmp = d / f".new-{threading.get_ident()}-{time.monotonic_ns()}"
            try:
                with open(tmp, "wb") as f:
                    os.posix_fallocate(f.fileno(), 0, int(nbytes))
                os.rename(tmp, d / f"{int(nbytes)}-{time.monotonic_ns()}")
                made += 1
            except OSError as exc:
                log.info("snapshot handoff: no spare file of %d bytes (%s)", nbytes, exc)
                tmp.unlink(missing_ok=True)
                return made
            finally:
                with self._room:
                    self._reserved -= nbytes
        return made

    def mark_durable(self, path: TinkerPath) -> None:
        """Record that storage holds ``path`` (the entry may now be evicted)."""
        d = self.dir_of(path)
        if d.is_dir():
            (d / DURABLE_NAME).touch()

    def entries(self) -> list[tuple[TinkerPath, Path, dict]]:
        """Every entry: ``(path, directory, meta)``, oldest first."""
        out = []
        for m in _below(self.root, 3, META_NAME):
            if m.parts[len(self.root.parts)] == PINS_DIR:
                continue
            try:
                meta = json.loads(m.read_text())
                out.append((TinkerPath.parse(meta["tinker_path"]), m.parent, meta))
            except (OSError, ValueError, KeyError) as exc:  # half-deleted or foreign: leave it
                log.debug("handoff entry %s skipped: %s", m.parent, exc)
        return sorted(out, key=lambda e: e[2].get("written_unix", 0.0))

    def pending(self) -> list[tuple[TinkerPath, Path, dict]]:
        """Entries storage does not hold yet (a trainer that stopped before their background
        write: the next trainer writes them)."""
        return [e for e in self.entries() if not (e[1] / DURABLE_NAME).exists()]

    def size(self) -> int:
        """Bytes of the entries' files and of the spare files."""
        return sum(_size_or_0(f) for f in _below(self.root, 4)
                   if f.is_file() and f.parts[len(self.root.parts)] != PINS_DIR) + \
            sum(_size_or_0(f) for f in self._spares())

    def _spares(self) -> list[Path]:
        d = self.root / SPARES_DIR
        return sorted(d.iterdir()) if d.is_dir() else []

    def make_room(self, nbytes: int) -> bool:
        """Drop spare files, then evict durable entries older than ``keep_s``, oldest first,
        until ``nbytes`` more fit under ``max_bytes`` and in the file system's free space.
        Returns whether they fit."""
        used = self.size()
        now = time.time()
        st = os.statvfs(self.root)
        free = st.f_bavail * st.f_frsize
        for f in self._spares():
            if used + nbytes <= self.max_bytes and nbytes < free:
                break
            n = _size_or_0(f)
            f.unlink(missing_ok=True)
            used -= n
            free += n
        for _path, d, meta in self.entries():
            if used + nbytes <= self.max_bytes and nbytes < free:
                break
            if (d / DURABLE_NAME).exists() and now - meta.get("written_unix", 0.0) >= self.keep_s:
                freed = sum(f.stat().st_size for f in d.iterdir() if f.is_file())
                shutil.rmtree(d, ignore_errors=True)
                used -= freed
                free += freed
        return used + nbytes <= self.max_bytes and nbytes < free

    def clear(self) -> None:
        """Remove the whole directory (the stack stopped; storage holds what was durable)."""
        shutil.rmtree(self.root, ignore_errors=True)


def _below(base: Path, depth: int, name: str | None = None) -> list[Path]:
    """The paths exactly ``depth`` levels below ``base`` (``base.glob("*/" * depth)``, hidden names
    included), or with ``name`` the existing ``<those at depth>/name``. Directories that vanish
    while they are listed (a writer renaming its ``.tmp-*`` directory into place, an eviction) are
    skipped: ``Path.glob`` raised FileNotFoundError there and failed a concurrent save (CI, 3.11)."""
    level = [base]
    for _ in range(depth):
        nxt: list[Path] = []
        for d in level:
            try:
                with os.scandir(d) as it:
                    nxt.extend(Path(e.path) for e in it)
            except (FileNotFoundError, NotADirectoryError):
                continue
        level = nxt
    if name is None:
        return level
    return [p / name for p in level if (p / name).exists()]


def _size_or_0(f: Path) -> int:
    try:
        return f.stat().st_size
    except FileNotFoundError:  # taken meanwhile
        return 0
