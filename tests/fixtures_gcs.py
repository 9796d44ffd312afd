"""The ``gcs_emulator`` fixture: one fake-gcs-server for the test session.

Import it from ``tests/conftest.py`` (``from fixtures_gcs import gcs_emulator  # noqa: F401``)
to make it available to every test module. It yields the emulator URL and does not
touch the environment; tests set ``STORAGE_EMULATOR_HOST`` themselves (with
``monkeypatch.setenv``) so that ``google.cloud.storage.Client`` talks to it.

With an external stack (``$OPENRL_TEST_STACK_STATE``, tests/external_stack.py) the fixture
skips its tests: the GCS variants start stacks or storage of their own, and the GPU image has
neither the emulator nor google-cloud-storage.
"""

from __future__ import annotations

import pytest

from gcs_emulator import gcs_emulator as _run_gcs_emulator


@pytest.fixture(scope="session")
def gcs_emulator():
    """URL (``http://127.0.0.1:<port>``) of a fake-gcs-server that lives for the session."""
    from external_stack import external_state, skip_reason

    if external_state() is not None:
        pytest.skip(skip_reason("the GCS emulator variants start their own stack"))
    with _run_gcs_emulator() as url:
        yield url


def count_downloads(store) -> list[str]:
    """Wrap ``store._download_file`` (a ``GCSStorage``) to record each object it downloads;
    returns the list the names are appended to (the download itself is unchanged)."""
    calls: list[str] = []
    orig = store._download_file

    def counting(name, dest):
        calls.append(name)
        return orig(name, dest)

    store._download_file = counting
    return calls


def file_or_gcs_storage(kind: str, request, tmp_path, monkeypatch):
    """A fresh store of ``kind``: ``"file"`` (FileStorage under ``tmp_path``) or ``"gcs"`` (a new
    bucket on the session's emulator, the real google-cloud-storage client; ``STORAGE_EMULATOR_HOST``
    set for this test). For ``@pytest.fixture(params=["file", "gcs"])`` fixtures."""
    import uuid

    from openrl.storage import FileStorage

    if kind == "file":
        return FileStorage(tmp_path / "store")
    from openrl.storage.gcs import GCSStorage, make_client

    monkeypatch.setenv("STORAGE_EMULATOR_HOST", request.getfixturevalue("gcs_emulator"))
    bucket = f"openrl-{uuid.uuid4().hex[:12]}"
    make_client().create_bucket(bucket)
    return GCSStorage(bucket, "ckpts", cache_dir=tmp_path / "gcs-cache")
