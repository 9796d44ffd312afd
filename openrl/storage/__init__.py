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
``gs://bucket/prefix`` (see :mod:`openrl.storage.gcs`).

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

from pathlib import Path
from urllib.parse import urlparse

from openrl.storage.base import Storage
from openrl.storage.layout import (  # noqa: F401 - the package's public names
    KINDS,
    CHECKPOINT_TYPE,
    RUNSTATE_DIR,
    RUNSTATE_HEAD,
    RUNSTATE_FORMAT,
    CheckpointExists,
    ChecksumMismatch,
    RunStateConflict,
    RunState,
    TinkerPath,
    check_name,
    sha256_file,
    file_table,
    verify_files,
    new_snapshot_name,
    run_state_pointer,
    build_manifest,
)
from openrl.storage.local import FileStorage
from openrl.storage.sweeper import sweep_expired, ExpirySweeper  # noqa: F401


def open_storage(url: str, *, cache_dir: Path | None = None, write_through: bool = False) -> Storage:
    """Open a store by URL: ``file:///abs/dir`` or ``gs://bucket/prefix``.

    ``cache_dir`` / ``write_through``: see :class:`openrl.storage.gcs.GCSStorage` (``gs://`` only:
    ``file://`` storage is already local and is read in place).

    Raises:
        ValueError: an unsupported scheme.
    """
    u = urlparse(url)
    if u.scheme == "file":
        return FileStorage(Path(u.path))
    if u.scheme == "gs":
        from openrl.storage.gcs import GCSStorage

        return GCSStorage(u.netloc, u.path.lstrip("/"), cache_dir=cache_dir, write_through=write_through)
    if u.scheme == "" and url:
        return FileStorage(Path(url))
    raise ValueError(f"unsupported storage URL {url!r}: use file:///dir or gs://bucket/prefix")
