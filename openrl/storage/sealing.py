"""age encryption of exported weights: ``save_weights_external(..., age_encryption_recipients=...)``.

The SDK's contract (``SaveWeightsExternalRequest.age_encryption_recipients``): at most 10 age
recipients, native ``age1...`` X25519 keys or SSH public keys; when set, every exported file
is encrypted to them and stored with a ``.age`` suffix; the holder of a matching identity
decrypts with ``age -d`` (or ``pyrage.decrypt``), as ``tinker_cookbook.weights.download()``
does. The encryption is the ``age`` format (https://age-encryption.org/v1) as implemented
by ``pyrage`` (Python bindings of the ``rage`` Rust implementation); we write no crypto.

How a request reaches the bytes without the trainer knowing about encryption:

1. The gateway validates the recipients (:func:`parse_recipients`, 400 naming
   ``age_encryption_recipients[i]``) and, before it publishes the save, records them with
   :meth:`openrl.storage.Storage.put_export_request` for that checkpoint path and ``seq_id``
   (an internal object ``_runstate/<run>/exports/<name>.<seq_id>.json``, outside the
   ``tinker://`` namespace like the rest of the run state).
2. The trainer writes the adapter with ``Storage.put_dir``. For an ``external_weights``
   checkpoint, ``put_dir`` first calls :func:`seal_export`: when a request record exists for
   the path and the manifest's ``seq_id``, every file is encrypted in the staging directory to
   ``<file>.age`` (the plaintext removed), the manifest's file table, ``size_bytes`` and an
   ``encryption`` entry (``{"scheme": "age", "recipients": [...]}``, public keys only) are
   rewritten in place, and only ciphertext is stored. The record is deleted once the
   checkpoint is stored.

So the ciphertext is what lives at rest (file:// or gs://) and what every signed download URL
(the gateway's HMAC route or a GCS V4 URL) serves; the server never sees an identity.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from openrl.errors import UserError
from openrl.storage.layout import RUNSTATE_DIR, TinkerPath, check_name, sha256_file

log = logging.getLogger(__name__)

#: suffix of an encrypted file (the SDK's and the cookbook's ``.age``)
AGE_SUFFIX = ".age"
#: the SDK documents "at most 10" recipients
MAX_RECIPIENTS = 10
#: the request field named in errors
FIELD = "age_encryption_recipients"


def parse_recipients(values: list[str] | None, field: str = FIELD) -> list[Any]:
    """Parse age recipients: ``age1...`` X25519 public keys or SSH public keys
    (``ssh-ed25519 ...`` / ``ssh-rsa ...``).

    Args:
        values: the request's list (None: no encryption; returns ``[]``).
        field: the request field named in errors.

    Returns:
        ``pyrage`` recipient objects, in order.

    Raises:
        UserError: an empty list, more than :data:`MAX_RECIPIENTS`, or an entry that is not a
            recipient (the field is ``<field>[i]``; secret keys are refused without echoing them).
    """
    import pyrage

    if values is None:
        return []
    if not isinstance(values, list) or not values:
        raise UserError(field, "give at least one age recipient (age1... or an SSH public key), or omit the field")
    if len(values) > MAX_RECIPIENTS:
        raise UserError(field, f"at most {MAX_RECIPIENTS} recipients, got {len(values)}")
    out = []
    for i, raw in enumerate(values):
        where = f"{field}[{i}]"
        if not isinstance(raw, str) or not raw.strip():
            raise UserError(where, "must be a non-empty string")
        text = raw.strip()
        if text.upper().startswith("AGE-SECRET-KEY-"):
            raise UserError(where, "is an age secret key (identity); send its public key (age1...) instead")
        if text.startswith("age1"):
            try:
                out.append(pyrage.x25519.Recipient.from_str(text))
            except pyrage.RecipientError as e:
                raise UserError(where, f"not a valid age X25519 recipient: {e}") from None
        elif text.startswith(("ssh-", "ecdsa-")):
            try:
                out.append(pyrage.ssh.Recipient.from_str(text))
            except pyrage.RecipientError as e:
                raise UserError(where, f"not a valid SSH public key recipient: {e}") from None
        else:
            raise UserError(where, "not an age recipient: expected an age1... key or an SSH public key")
    return out


def export_request_key(path: TinkerPath, seq_id: int | None) -> str:
    """Storage key (relative to the store's root) of the encryption request of checkpoint
    ``path`` saved by request ``seq_id``: ``_runstate/<run>/exports/<name>.<seq_id>.json``."""
    check_name(path.run_id, "model_id")
    return f"{RUNSTATE_DIR}/{path.run_id}/exports/{path.name}.{'none' if seq_id is None else int(seq_id)}.json"


def request_body(recipients: list[str]) -> bytes:
    """The JSON body of an encryption request record (validates ``recipients`` first).

    Raises:
        UserError: as :func:`parse_recipients`.
    """
    parse_recipients(recipients)
    return json.dumps({"scheme": "age", "recipients": [r.strip() for r in recipients]}).encode()


def seal_dir(local_dir: Path, recipients: list[str]) -> dict[str, dict]:
    """Encrypt every file of ``local_dir`` (but ``manifest.json``) to ``recipients`` as
    ``<file>.age`` and delete the plaintext.

    Returns:
        the new file table ``{name: {size, sha256}}`` of the ``.age`` files.

    Raises:
        UserError: bad recipients (as :func:`parse_recipients`).
        pyrage.EncryptError, OSError: the encryption or a write failed (nothing is stored).
    """
    import pyrage

    parsed = parse_recipients(recipients)
    files = {}
    for f in sorted(Path(local_dir).iterdir()):
        if not f.is_file() or f.name == "manifest.json" or f.name.endswith(AGE_SUFFIX):
            continue
        out = f.with_name(f.name + AGE_SUFFIX)
        pyrage.encrypt_file(str(f), str(out), parsed)
        f.unlink()
    for f in sorted(Path(local_dir).iterdir()):
        if f.is_file() and f.name != "manifest.json":
            files[f.name] = {"size": f.stat().st_size, "sha256": sha256_file(f)}
    return files


def seal_manifest(manifest: dict, files: dict[str, dict], recipients: list[str]) -> dict:
    """Rewrite ``manifest`` in place for sealed ``files``: file table, ``size_bytes`` and
    ``encryption`` (``{"scheme": "age", "recipients": [...]}``). Returns it."""
    manifest["files"] = files
    manifest["size_bytes"] = sum(v["size"] for v in files.values())
    manifest["encryption"] = {"scheme": "age", "recipients": [r.strip() for r in recipients]}
    return manifest


def is_sealed(manifest: dict | None) -> bool:
    """True when the checkpoint's files are age ciphertext (``manifest["encryption"]``)."""
    return bool(manifest and (manifest.get("encryption") or {}).get("scheme") == "age")
