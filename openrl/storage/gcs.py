"""``gs://bucket/prefix`` weight storage, with a verified local cache.

Layout (the same as :class:`openrl.storage.FileStorage`, under an object prefix)::

    gs://<bucket>/<prefix>/<training_run_id>/<kind>/<name>/<file>...
    gs://<bucket>/<prefix>/<training_run_id>/<kind>/<name>/manifest.json

Writes are create-only (``ifGenerationMatch=0``): the files first, the manifest last.
The manifest is the commit point: a checkpoint exists exactly when its manifest object
does. A put that fails midway deletes the objects it created (each guarded by the
generation it created, so it can never delete someone else's object) and leaves no
manifest.

Reads stream to local files (``download_to_filename``) and are verified against the
manifest's sha256 before they become visible in the cache, ``<cache_dir>/<run>/<kind>/<name>/``:
a download goes into a temp dir beside it and is renamed into place, so concurrent
readers (threads, or sampler processes sharing a disk) never see half a checkpoint.

Trainer run state (:meth:`GCSStorage.put_run_state`) lives under ``<prefix>/_runstate/<run>/``:
snapshot objects are created with ``ifGenerationMatch=0`` and the ``HEAD.json`` pointer is
swapped with ``ifGenerationMatch=<generation the writer last saw>`` (0 for the first
write), so two trainers can never both advance the same run.

Credentials: with ``STORAGE_EMULATOR_HOST`` set (tests, local emulators) the client is
anonymous with project ``$GOOGLE_CLOUD_PROJECT`` or ``openrl-test``; otherwise it uses
Application Default Credentials (Workload Identity on GKE).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
import threading
from pathlib import Path
from typing import Any

from openrl.errors import NotFound, ServerError, UserError
from openrl.storage.base import Storage
from openrl.storage.layout import (
    KINDS,
    RUNSTATE_DIR,
    RUNSTATE_HEAD,
    ChecksumMismatch,
    CheckpointExists,
    RunState,
    RunStateConflict,
    TinkerPath,
    check_name,
    file_table,
    new_snapshot_name,
    run_state_pointer,
    sha256_file,
    verify_files,
)

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"


def make_client(project: str | None = None) -> Any:
    """A ``google.cloud.storage.Client``: anonymous against an emulator, ADC otherwise."""
    from google.cloud import storage

    if os.environ.get("STORAGE_EMULATOR_HOST"):
        from google.auth.credentials import AnonymousCredentials

        return storage.Client(project=project or os.environ.get("GOOGLE_CLOUD_PROJECT") or "openrl-test",
                              credentials=AnonymousCredentials())
    if project or os.environ.get("GOOGLE_CLOUD_PROJECT"):
        return storage.Client(project=project or os.environ["GOOGLE_CLOUD_PROJECT"])
    return storage.Client()


def _gexc():
    from google.api_core import exceptions

    return exceptions


class GCSStorage(Storage):
    """``gs://bucket/prefix`` backend.

    Args:
        bucket: bucket name (must exist; this class never creates buckets).
        prefix: object prefix, without leading/trailing ``/`` (may be empty).
        cache_dir: local directory for verified downloads; default
            ``$TMPDIR/openrl-gcs-cache/<bucket>/<prefix>``.
        client: a ``google.cloud.storage.Client`` to use instead of :func:`make_client`.
        write_through: keep the sampler snapshots :meth:`put_dir` uploads as this machine's verified cached copy
            (hard links from :meth:`scratch_dir`, same file system), so a sampler on the same
            machine sharing ``cache_dir`` reads the snapshot from the page cache instead of
            downloading it back (the embedded stack's trainer: ``Settings.colocated_sampler``).
    """

    #: resumable upload chunk (a multiple of 256 KiB): bounds the memory of one upload.
    CHUNK_SIZE = 8 << 20

    def __init__(self, bucket: str, prefix: str = "", cache_dir: Path | None = None, *, client: Any = None,
                 write_through: bool = False):
        if not bucket:
            raise ValueError("gs:// storage needs a bucket: gs://bucket/prefix")
        self.bucket_name = bucket
        self.prefix = prefix.strip("/")
        self.url = f"gs://{bucket}/{self.prefix}" if self.prefix else f"gs://{bucket}"
        self.client = client if client is not None else make_client()
        self.bucket = self.client.bucket(bucket)
        if cache_dir is None:
            cache_dir = Path(tempfile.gettempdir()) / "openrl-gcs-cache" / bucket / (self.prefix or "_")
        self.cache_dir = Path(cache_dir)
        self.write_through = bool(write_through)
        self._locks: dict[str, threading.Lock] = {}
        self._locks_guard = threading.Lock()
        # cache dir -> (files of its manifest, stat of its files) last verified by sha256 in
        # this process: a later hit with the same stats skips re-hashing.
        self._verified: dict[Path, tuple] = {}

    # ---- names -------------------------------------------------------------------------

    def _obj(self, key: str) -> str:
        return f"{self.prefix}/{key}" if self.prefix else key

    def _ckpt_prefix(self, path: TinkerPath) -> str:
        return self._obj(path.key) + "/"

    def _lock(self, key: str) -> threading.Lock:
        with self._locks_guard:
            return self._locks.setdefault(key, threading.Lock())

    # ---- blob I/O (single points, so tests can count or fail them) ---------------------

    def _upload_file(self, name: str, src: Path) -> int:
        """Create-only streaming upload of ``src``; returns the new object's generation."""
        blob = self.bucket.blob(name, chunk_size=self.CHUNK_SIZE)
        blob.upload_from_filename(str(src), content_type="application/octet-stream", if_generation_match=0)
        return int(blob.generation)

    def _download_file(self, name: str, dest: Path) -> None:
        """Streaming download of one object to ``dest``."""
        self.bucket.blob(name).download_to_filename(str(dest))

    def _read_manifest_blob(self, path: TinkerPath) -> tuple[dict, int] | None:
        """The stored manifest and its generation, or None when there is none."""
        blob = self.bucket.blob(self._ckpt_prefix(path) + MANIFEST)
        try:
            data = blob.download_as_bytes()
        except _gexc().NotFound:
            return None
        return json.loads(data), int(blob.generation or 0)

    # ---- Storage interface ---------------------------------------------------------------

    def _create(self, path: TinkerPath, manifest: dict, names: list[str], make_object) -> dict:
        """Create checkpoint ``path``: ``make_object(name, object_name)`` creates each of
        ``names`` create-only and returns its generation; the manifest goes last (readers see
        a checkpoint only once it is whole); on any failure the objects made are removed.

        Raises:
            CheckpointExists: ``path`` or one of its objects exists (a retried create whose
                first attempt landed reads back as our own manifest and succeeds).
        """
        gx = _gexc()
        base = self._ckpt_prefix(path)
        if self._read_manifest_blob(path) is not None:
            raise CheckpointExists("path", f"{path} already exists; saved weights are immutable")
        created: list[tuple[str, int]] = []
        ok = False
        try:
            for name in names:
                check_name(name, "path")
                try:
                    created.append((base + name, make_object(name, base + name)))
                except gx.PreconditionFailed as exc:
                    raise CheckpointExists(
                        "path", f"{path}: object {name!r} already exists (a concurrent or unfinished save); "
                        "saved weights are immutable") from exc
            body = json.dumps(manifest, indent=1).encode()
            mblob = self.bucket.blob(base + MANIFEST)
            try:
                mblob.upload_from_string(body, content_type="application/json", if_generation_match=0)
            except gx.PreconditionFailed as exc:
                got = self._read_manifest_blob(path)
                if got is None or got[0] != manifest:
                    raise CheckpointExists("path", f"{path} already exists; saved weights are immutable") from exc
            ok = True
            return manifest
        finally:
            if not ok:
                self._cleanup(created)

    def put_dir(self, path: TinkerPath, local_dir: Path, manifest: dict) -> dict:
        sealed = self.seal_export(path, Path(local_dir), manifest)  # age-encrypted export: ciphertext only
        files = {f.name: f for f in Path(local_dir).iterdir() if f.is_file() and f.name != MANIFEST}
        out = self._create(path, manifest, sorted(files), lambda name, obj: self._upload_file(obj, files[name]))
        self._forget_export_request(sealed)
        if self.write_through and path.kind == "sampler_weights":  # what a sampler reads next
            self._keep_local(path, files, manifest)
        return out

    def scratch_dir(self) -> Path | None:
        """With ``write_through``: ``<cache_dir>/.scratch``, so the files a writer stages there
        become the cached copy by hard link (no byte copy); else the system temp dir."""
        if not self.write_through:
            return None
        d = self.cache_dir / ".scratch"
        d.mkdir(parents=True, exist_ok=True)
        return d

    def _keep_local(self, path: TinkerPath, files: dict[str, Path], manifest: dict) -> None:
        """Install the just-uploaded ``files`` (name -> local file) and ``manifest`` as the verified
        cached copy of ``path`` (hard links where the file system allows, else copies). Best
        effort: a failure is logged and the next reader downloads as usual."""
        dest = self.cache_dir / path.key
        tmp = None
        try:
            dest.parent.mkdir(parents=True, exist_ok=True)
            tmp = Path(tempfile.mkdtemp(dir=dest.parent, prefix=f".tmp-{dest.name}-"))
            for name, src in files.items():
                try:
                    os.link(src, tmp / name)
                except OSError:
                    shutil.copyfile(src, tmp / name)
            (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1))
            with self._lock(path.key):
                self._install(tmp, dest, manifest)
        except (OSError, ServerError):
            log.warning("could not keep a local copy of %s; readers here will download it", path, exc_info=True)
        finally:
            if tmp is not None:
                shutil.rmtree(tmp, ignore_errors=True)

    def _put_internal(self, key: str, data: bytes) -> None:
        self.bucket.blob(self._obj(key)).upload_from_string(data, content_type="application/json")

    def _get_internal(self, key: str) -> bytes | None:
        try:
            return self.bucket.blob(self._obj(key)).download_as_bytes()
        except _gexc().NotFound:
            return None

    def _delete_internal(self, key: str) -> None:
        try:
            self.bucket.blob(self._obj(key)).delete()
        except _gexc().NotFound:
            pass

    def put_file(self, key: str, src: Path) -> None:
        blob = self.bucket.blob(self._obj(key), chunk_size=self.CHUNK_SIZE)
        blob.upload_from_filename(str(src), content_type="application/octet-stream")

    def get_file(self, key: str, dest: Path) -> bool:
        fd, tmp = tempfile.mkstemp(dir=Path(dest).parent, prefix=".tmp-")
        os.close(fd)
        try:
            self.bucket.blob(self._obj(key)).download_to_filename(tmp)
            os.replace(tmp, dest)
            return True
        except _gexc().NotFound:
            return False
        finally:
            Path(tmp).unlink(missing_ok=True)

    def copy(self, src: TinkerPath, dst: TinkerPath, manifest: dict) -> dict:
        """Server-side copy (GCS rewrite; no bytes through this process) of ``src``'s objects
        to ``dst``, create-only, then ``manifest``; a failed copy removes what it created."""
        if self._read_manifest_blob(src) is None:
            raise NotFound("source_path", f"no checkpoint at {src}")
        sbase = self._ckpt_prefix(src)

        def copy_object(name: str, obj: str) -> int:
            blob = self.bucket.copy_blob(self.bucket.blob(sbase + name), self.bucket, obj, if_generation_match=0)
            return int(blob.generation or 0)

        return self._create(dst, manifest, sorted(manifest["files"]), copy_object)

    def _cleanup(self, created: list[tuple[str, int]]) -> None:
        """Best-effort delete of the objects a failed put created (only those generations)."""
        gx = _gexc()
        for name, gen in reversed(created):
            try:
                self.bucket.blob(name).delete(if_generation_match=gen)
            except (gx.NotFound, gx.PreconditionFailed):
                pass
            except Exception:  # noqa: BLE001 - cleanup must not mask the original error
                log.warning("could not delete %s (generation %s) after a failed save", name, gen, exc_info=True)

    def manifest(self, path: TinkerPath) -> dict | None:
        got = self._read_manifest_blob(path)
        return got[0] if got else None

    def write_manifest(self, path: TinkerPath, manifest: dict) -> None:
        """Replace the manifest of an existing checkpoint (ttl / public changes).

        Raises:
            NotFound: no checkpoint at ``path`` (a deleted checkpoint is never re-created).
            UserError: the manifest changes the file list (files are immutable).
        """
        gx = _gexc()
        for _attempt in range(5):
            got = self._read_manifest_blob(path)
            if got is None:
                raise NotFound("path", f"no checkpoint at {path}")
            current, gen = got
            if manifest.get("files") != current.get("files"):
                raise UserError("path", f"{path}: a manifest update cannot change the files (they are immutable)")
            blob = self.bucket.blob(self._ckpt_prefix(path) + MANIFEST)
            try:
                blob.upload_from_string(json.dumps(manifest, indent=1).encode(), content_type="application/json",
                                        if_generation_match=gen)
                return
            except gx.PreconditionFailed:
                continue  # changed (or deleted) since we read it: look again
        raise ServerError(f"{path}: manifest kept changing during the update; retry")

    def get_dir(self, path: TinkerPath) -> Path:
        """A verified local copy of the checkpoint under ``cache_dir/<run>/<kind>/<name>``.

        Always reads the (small) remote manifest, so a deleted checkpoint is not served
        from cache; the files are downloaded only when the cache does not already hold
        them with the manifest's sha256.

        Raises:
            NotFound: no checkpoint at ``path``.
            ChecksumMismatch: a downloaded object does not match the manifest (nothing is cached).
        """
        dest = self.cache_dir / path.key
        with self._lock(path.key):
            got = self._read_manifest_blob(path)
            if got is None:
                shutil.rmtree(dest, ignore_errors=True)  # a stale copy of a deleted checkpoint
                self._verified.pop(dest, None)
                raise NotFound("path", f"no checkpoint at {path}")
            remote = got[0]
            if self._cache_valid(dest, remote):
                self._refresh_local_manifest(dest, remote)
                return dest
            self._download(path, remote, dest)
            return dest

    def _download(self, path: TinkerPath, remote: dict, dest: Path) -> None:
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=dest.parent, prefix=f".tmp-{dest.name}-"))
        try:
            base = self._ckpt_prefix(path)
            for fname, meta in sorted(remote.get("files", {}).items()):
                check_name(fname, "path")
                target = tmp / fname
                try:
                    self._download_file(base + fname, target)
                except _gexc().NotFound as exc:
                    raise ServerError(f"{path}: {fname} is listed in the manifest but missing from the bucket") from exc
                size, digest = target.stat().st_size, sha256_file(target)
                if size != meta.get("size") or digest != meta.get("sha256"):
                    raise ChecksumMismatch(
                        f"{path}: {fname} does not match its manifest (size {size} vs {meta.get('size')}, "
                        f"sha256 {digest} vs {meta.get('sha256')})")
            (tmp / MANIFEST).write_text(json.dumps(remote, indent=1))
            self._install(tmp, dest, remote)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    def _install(self, tmp: Path, dest: Path, remote: dict) -> None:
        """Rename the verified ``tmp`` to ``dest``; an invalid old ``dest`` is moved aside first."""
        for _attempt in range(3):
            try:
                os.rename(tmp, dest)  # atomic; fails if dest exists and is not empty
                self._remember(dest, remote)
                return
            except OSError:
                if self._cache_valid(dest, remote):
                    return  # another reader installed the same checkpoint first
                trash = Path(tempfile.mkdtemp(dir=dest.parent, prefix=f".old-{dest.name}-"))
                try:
                    os.rename(dest, trash / "d")
                except OSError:
                    pass
                shutil.rmtree(trash, ignore_errors=True)
        raise ServerError(f"could not install the cached checkpoint at {dest}")

    # ---- cache checks ----------------------------------------------------------------------

    @staticmethod
    def _stat_sig(dest: Path, files: dict) -> tuple | None:
        sig = []
        for fname in sorted(files):
            try:
                st = (dest / fname).stat()
            except OSError:
                return None
            sig.append((fname, st.st_size, st.st_mtime_ns, st.st_ino))
        return tuple(sig)

    def _remember(self, dest: Path, remote: dict) -> None:
        files = remote.get("files", {})
        sig = self._stat_sig(dest, files)
        if sig is not None:
            self._verified[dest] = (json.dumps(files, sort_keys=True), sig)

    def _cache_valid(self, dest: Path, remote: dict) -> bool:
        """True when ``dest`` has a manifest and every file of ``remote`` with its sha256."""
        if not (dest / MANIFEST).is_file():
            return False
        try:
            local = json.loads((dest / MANIFEST).read_text())
        except (OSError, ValueError):
            return False
        files = remote.get("files", {})
        if local.get("files") != files:
            return False
        sig = self._stat_sig(dest, files)
        if sig is None:
            return False
        key = (json.dumps(files, sort_keys=True), sig)
        if self._verified.get(dest) == key:
            return True
        for fname, meta in files.items():
            if sha256_file(dest / fname) != meta.get("sha256"):
                log.warning("cached %s/%s does not match its manifest; downloading again", dest, fname)
                return False
        self._verified[dest] = key
        return True

    @staticmethod
    def _refresh_local_manifest(dest: Path, remote: dict) -> None:
        """Keep the cached manifest.json in step with ttl / public changes (files are equal)."""
        try:
            if json.loads((dest / MANIFEST).read_text()) == remote:
                return
            fd, tmp = tempfile.mkstemp(dir=dest, prefix=".manifest-")
            with os.fdopen(fd, "w") as f:
                f.write(json.dumps(remote, indent=1))
            os.replace(tmp, dest / MANIFEST)
        except OSError:
            log.debug("could not refresh %s", dest / MANIFEST, exc_info=True)

    # ---- listing and deletion --------------------------------------------------------------

    def list_run(self, run_id: str) -> list[dict]:
        check_name(run_id, "training_run_id")
        base = self._obj(run_id) + "/"
        found: dict[tuple[str, str], str] = {}
        for blob in self.client.list_blobs(self.bucket_name, prefix=base):
            parts = blob.name[len(base) :].split("/")
            if len(parts) == 3 and parts[0] in KINDS and parts[2] == MANIFEST:
                found[(parts[0], parts[1])] = blob.name
        out = []
        for kind in KINDS:
            for (k, name) in sorted(n for n in found if n[0] == kind):
                m = self.manifest(TinkerPath(run_id, k, name))
                if m is not None:  # deleted between listing and reading
                    out.append(m)
        return out

    def list_runs(self) -> list[str]:
        base = self._obj("")
        it = self.client.list_blobs(self.bucket_name, prefix=base, delimiter="/")
        for _page in it.pages:  # prefixes fill in as pages are read
            pass
        runs = (p[len(base) :].rstrip("/") for p in it.prefixes)
        return sorted(r for r in runs if r and not r.startswith(".") and r != RUNSTATE_DIR)

    def delete(self, path: TinkerPath) -> None:
        """Delete every object under the checkpoint's prefix, the manifest first.

        Also removes a partial upload with no manifest. Raises NotFound when there is no object.
        """
        gx = _gexc()
        base = self._ckpt_prefix(path)
        names = [b.name for b in self.client.list_blobs(self.bucket_name, prefix=base)]
        if not names:
            raise NotFound("checkpoint_id", f"no checkpoint at {path}")
        names.sort(key=lambda n: n != base + MANIFEST)  # manifest first: the checkpoint stops existing
        for name in names:
            try:
                self.bucket.blob(name).delete()
            except gx.NotFound:
                pass
        dest = self.cache_dir / path.key
        with self._lock(path.key):
            shutil.rmtree(dest, ignore_errors=True)
            self._verified.pop(dest, None)

    # ---- run state -------------------------------------------------------------------------

    def _rs_prefix(self, run_id: str) -> str:
        check_name(run_id, "model_id")
        return self._obj(f"{RUNSTATE_DIR}/{run_id}") + "/"

    def _read_head(self, run_id: str) -> tuple[dict, int] | None:
        blob = self.bucket.blob(self._rs_prefix(run_id) + RUNSTATE_HEAD)
        try:
            data = blob.download_as_bytes()
        except _gexc().NotFound:
            return None
        return json.loads(data), int(blob.generation or 0)

    def _delete_prefix(self, prefix: str) -> None:
        gx = _gexc()
        for b in list(self.client.list_blobs(self.bucket_name, prefix=prefix)):
            try:
                self.bucket.blob(b.name).delete()
            except gx.NotFound:
                pass

    def put_run_state(self, run_id: str, local_dir: Path, info: dict, expect: str | None) -> str:
        gx = _gexc()
        base = self._rs_prefix(run_id)
        files = file_table(local_dir)
        snap = new_snapshot_name(info.get("cursor"))
        want = 0 if expect is None else int(expect)
        old = self._read_head(run_id)
        if (old[1] if old else 0) != want:
            raise RunStateConflict(f"run state of {run_id}: pointer generation is {old[1] if old else None}, "
                                   f"the writer expected {expect!r} (another trainer flushed or deleted it)")
        created: list[tuple[str, int]] = []
        ok = False
        try:
            for name in files:
                obj = base + f"{snap}/{name}"
                created.append((obj, self._upload_file(obj, Path(local_dir) / name)))
            head = self.bucket.blob(base + RUNSTATE_HEAD)
            body = json.dumps(run_state_pointer(run_id, snap, files, info), indent=1).encode()
            try:
                head.upload_from_string(body, content_type="application/json", if_generation_match=want)
            except gx.PreconditionFailed as exc:
                raise RunStateConflict(f"run state of {run_id}: pointer changed during the flush "
                                       "(another trainer flushed or deleted it)") from exc
            ok = True
            token = str(int(head.generation))
        finally:
            if not ok:
                self._cleanup(created)
        if old and old[0].get("snapshot") and old[0]["snapshot"] != snap:
            try:
                self._delete_prefix(base + old[0]["snapshot"] + "/")
            except Exception:  # noqa: BLE001 - a leftover snapshot wastes space, nothing else
                log.warning("could not delete the old run-state snapshot of %s", run_id, exc_info=True)
        return token

    def get_run_state(self, run_id: str, *, download: bool = True) -> RunState | None:
        base = self._rs_prefix(run_id)
        for _attempt in range(5):
            got = self._read_head(run_id)
            if got is None:
                return None
            head, gen = got
            if not download:
                return RunState(None, head, str(gen))
            snap = head["snapshot"]
            check_name(snap, "snapshot")
            run_cache = self.cache_dir / RUNSTATE_DIR / run_id
            dest = run_cache / snap
            with self._lock(f"{RUNSTATE_DIR}/{run_id}"):
                try:
                    if not dest.is_dir():
                        run_cache.mkdir(parents=True, exist_ok=True)
                        tmp = Path(tempfile.mkdtemp(dir=run_cache, prefix=".tmp-"))
                        try:
                            for name in head.get("files", {}):
                                check_name(name, "file")
                                self._download_file(base + f"{snap}/{name}", tmp / name)
                            verify_files(tmp, head.get("files", {}), f"run state of {run_id}")
                            os.rename(tmp, dest)
                        finally:
                            shutil.rmtree(tmp, ignore_errors=True)
                    else:
                        verify_files(dest, head.get("files", {}), f"run state of {run_id}")
                except _gexc().NotFound:
                    continue  # the snapshot was replaced and deleted while we read it: read the pointer again
                except ChecksumMismatch:
                    shutil.rmtree(dest, ignore_errors=True)
                    if self._read_head(run_id) != got:
                        continue
                    raise
                for other in run_cache.iterdir():  # older cached snapshots of this run
                    if other.name != snap and not other.name.startswith("."):
                        shutil.rmtree(other, ignore_errors=True)
            return RunState(dest, head, str(gen))
        raise ServerError(f"run state of {run_id} kept changing while it was read; retry")

    def delete_run_state(self, run_id: str) -> None:
        gx = _gexc()
        base = self._rs_prefix(run_id)
        try:  # the pointer first: the state stops existing
            self.bucket.blob(base + RUNSTATE_HEAD).delete()
        except gx.NotFound:
            pass
        self._delete_prefix(base)
        shutil.rmtree(self.cache_dir / RUNSTATE_DIR / run_id, ignore_errors=True)
