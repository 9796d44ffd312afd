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
