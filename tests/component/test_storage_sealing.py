"""age-encrypted exports in storage (:mod:`openrl.storage.sealing`), on both backends: a
``file://`` directory and ``gs://`` on a real GCS emulator (fake-gcs-server, the real
``google-cloud-storage`` client). Encryption and decryption are real ``pyrage``; nothing is mocked.
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import pytest

from fixtures_gcs import file_or_gcs_storage, gcs_emulator  # noqa: F401  (session fixture)
from openrl.errors import UserError
from openrl.storage import FileStorage, TinkerPath, build_manifest
from openrl.storage.sealing import AGE_SUFFIX, export_request_key, is_sealed, parse_recipients

pyrage = pytest.importorskip("pyrage")

FILES = {"adapter_model.safetensors": b"\x00weights" * 1000, "adapter_config.json": b'{"r": 4}'}


@pytest.fixture(params=["file", "gcs"])
def store(request, tmp_path, monkeypatch):
    return file_or_gcs_storage(request.param, request, tmp_path, monkeypatch)


def _save(store, path: TinkerPath, tmp_path: Path, seq_id: int) -> dict:
    """What the trainer does: stage the files, build the manifest (with its seq_id), put_dir."""
    src = tmp_path / f"src-{uuid.uuid4().hex[:8]}"
    src.mkdir()
    for name, data in FILES.items():
        (src / name).write_bytes(data)
    manifest = build_manifest(src, path, owner="alice", ttl_seconds=None, extra={"seq_id": seq_id})
    store.put_dir(path, src, manifest)
    return manifest


def test_requested_export_is_stored_as_age_ciphertext_only(store, tmp_path):
    me, other = pyrage.x25519.Identity.generate(), pyrage.x25519.Identity.generate()
    rcpts = [str(me.to_public()), str(other.to_public())]
    path = TinkerPath.parse("tinker://run-a/external_weights/final")
    store.put_export_request(path, 7, rcpts)
    assert store.export_request(path, 7) == {"scheme": "age", "recipients": rcpts}
    returned = _save(store, path, tmp_path, seq_id=7)

    m = store.manifest(path)
    assert m == returned  # the writer's manifest dict was rewritten in place (size_bytes it reports)
    assert is_sealed(m) and m["encryption"]["recipients"] == rcpts
    assert set(m["files"]) == {f + AGE_SUFFIX for f in FILES}
    assert m["size_bytes"] == sum(v["size"] for v in m["files"].values())
    local = store.get_dir(path)  # verified against the ciphertext's sha256
    for name, data in FILES.items():
        ct = (local / (name + AGE_SUFFIX)).read_bytes()
        assert data not in ct
        assert pyrage.decrypt(ct, [me]) == data and pyrage.decrypt(ct, [other]) == data
    with pytest.raises(pyrage.DecryptError):
        pyrage.decrypt((local / ("adapter_config.json" + AGE_SUFFIX)).read_bytes(),
                       [pyrage.x25519.Identity.generate()])
    assert store.export_request(path, 7) is None  # consumed
    assert store.list_runs() == ["run-a"]  # the request lived outside the tinker:// namespace


def test_no_request_or_another_seq_id_stores_plaintext(store, tmp_path):
    me = pyrage.x25519.Identity.generate()
    path = TinkerPath.parse("tinker://run-b/external_weights/e")
    store.put_export_request(path, 3, [str(me.to_public())])  # a different request's
    _save(store, path, tmp_path, seq_id=4)
    m = store.manifest(path)
    assert not is_sealed(m) and set(m["files"]) == set(FILES)
    assert store.export_request(path, 3) is not None


def test_ssh_recipient(store, tmp_path):
    from cryptography.hazmat.primitives import serialization as ser
    from cryptography.hazmat.primitives.asymmetric import ed25519

    key = ed25519.Ed25519PrivateKey.generate()
    pub = key.public_key().public_bytes(ser.Encoding.OpenSSH, ser.PublicFormat.OpenSSH).decode()
    ident = pyrage.ssh.Identity.from_buffer(key.private_bytes(ser.Encoding.PEM, ser.PrivateFormat.OpenSSH,
                                                              ser.NoEncryption()))
    path = TinkerPath.parse("tinker://run-c/external_weights/ssh")
    store.put_export_request(path, 1, [pub])
    _save(store, path, tmp_path, seq_id=1)
    ct = (store.get_dir(path) / "adapter_config.json.age").read_bytes()
    assert json.loads(pyrage.decrypt(ct, [ident])) == {"r": 4}


def test_only_external_weights_are_sealed(store):
    with pytest.raises(UserError, match="path"):
        store.put_export_request(TinkerPath.parse("tinker://run-d/weights/s"), 1,
                                 [str(pyrage.x25519.Identity.generate().to_public())])


@pytest.mark.parametrize("values, field", [
    ([], "age_encryption_recipients"),
    (["age1qqqq"], "age_encryption_recipients[0]"),
    (["AGE-SECRET-KEY-1ABC"], "age_encryption_recipients[0]"),
    (["ssh-ed25519 AAAAbad"], "age_encryption_recipients[0]"),
    (["gpg:0xdeadbeef"], "age_encryption_recipients[0]"),
    ([""], "age_encryption_recipients[0]"),
    (["age1" + "q" * 58] * 11, "age_encryption_recipients"),
])
def test_parse_recipients_names_the_field(values, field):
    with pytest.raises(UserError) as err:
        parse_recipients(values)
    assert err.value.field == field
    assert "SECRET" not in str(err.value)


def test_parse_recipients_accepts_age_keys_and_none():
    pub = str(pyrage.x25519.Identity.generate().to_public())
    assert len(parse_recipients([pub, " " + pub + " "])) == 2
    assert parse_recipients(None) == []
    assert export_request_key(TinkerPath.parse("tinker://r:train:0/external_weights/n"), 5) == \
        "_runstate/r:train:0/exports/n.5.json"
