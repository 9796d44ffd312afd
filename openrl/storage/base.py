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


    # ---- age-encrypted exports (see openrl.storage.sealing) -----------------------------

    def _put_internal(self, key: str, data: bytes) -> None:
        """Write (or replace) the small internal object ``key`` (relative to the store's root)."""
        raise NotImplementedError

    def _get_internal(self, key: str) -> bytes | None:
        """The small internal object ``key``, or None when absent."""
        raise NotImplementedError

    def _delete_internal(self, key: str) -> None:
        """Delete the internal object ``key`` (no-op when absent)."""
        raise NotImplementedError

    def put_file(self, key: str, src: Path) -> None:
        """Write (or replace) the internal object ``key`` (relative to the store's root, e.g.
        ``.compile-cache/<tag>.tar.gz``) from the local file ``src``, streamed (large files)."""
        raise NotImplementedError

    def get_file(self, key: str, dest: Path) -> bool:
        """Download the internal object ``key`` to ``dest`` (written whole or not at all);
        False when there is no such object."""
        raise NotImplementedError

    def put_export_request(self, path: TinkerPath, seq_id: int | None, recipients: list[str]) -> None:
        """Record that the ``external_weights`` checkpoint ``path`` saved by request ``seq_id``
        must be age-encrypted to ``recipients`` (see :mod:`openrl.storage.sealing`). The gateway
        calls it before it publishes the save; :meth:`seal_export` consumes it.

        Raises:
            UserError: bad recipients (field ``age_encryption_recipients[i]``), or ``path`` not
                an ``external_weights`` path (field ``path``).
        """
        from openrl.storage.sealing import export_request_key, request_body

        if path.kind != "external_weights":
            raise UserError("path", f"only external_weights checkpoints are encrypted, not {path.kind}")
        self._put_internal(export_request_key(path, seq_id), request_body(recipients))

    def export_request(self, path: TinkerPath, seq_id: int | None) -> dict | None:
        """The encryption request recorded for (``path``, ``seq_id``), or None."""
        from openrl.storage.sealing import export_request_key

        raw = self._get_internal(export_request_key(path, seq_id))
        return None if raw is None else json.loads(raw)

    def seal_export(self, path: TinkerPath, local_dir: Path, manifest: dict) -> str | None:
        """Before :meth:`put_dir` stores an ``external_weights`` checkpoint: when an encryption
        request exists for ``path`` and ``manifest["seq_id"]``, encrypt every file of
        ``local_dir`` to ``<file>.age`` (plaintext removed) and rewrite ``manifest`` in place
        (file table, ``size_bytes``, ``encryption``).

        Returns:
            the request's key (delete it with :meth:`_delete_internal` once stored), or None
            when nothing was encrypted.

        Raises:
            UserError, pyrage.EncryptError, OSError: as :func:`openrl.storage.sealing.seal_dir`.
        """
        from openrl.storage.sealing import export_request_key, seal_dir, seal_manifest

        if path.kind != "external_weights":
            return None
        key = export_request_key(path, manifest.get("seq_id"))
        raw = self._get_internal(key)
        if raw is None:
            return None
        recipients = list(json.loads(raw)["recipients"])
        seal_manifest(manifest, seal_dir(local_dir, recipients), recipients)
        return key

    def _forget_export_request(self, key: str | None) -> None:
        """Best-effort delete of a consumed encryption request (a leftover is harmless: it is
        keyed by its seq_id, and the run's state deletion removes it)."""
        if key:
            try:
                self._delete_internal(key)
            except Exception:  # noqa: BLE001 - the checkpoint is stored; a stale request only wastes bytes
                import logging

                logging.getLogger(__name__).warning("could not delete export request %s", key, exc_info=True)
