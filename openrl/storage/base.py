"""The interface of a weight store (see :mod:`openrl.storage`)."""

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
from openrl.storage.layout import KINDS, CHECKPOINT_TYPE, RUNSTATE_DIR, RUNSTATE_HEAD, RUNSTATE_FORMAT, CheckpointExists, ChecksumMismatch, RunStateConflict, RunState, TinkerPath, check_name, sha256_file, file_table, verify_files, new_snapshot_name, run_state_pointer, build_manifest  # noqa: F401


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


