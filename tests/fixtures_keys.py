"""A session stack with several API keys and tight limits, for the auth, bad-input and
backpressure suites (tests/stack/test_auth.py, tests/stack/test_errors.py, tests/stack/test_load.py).

Keys: ``user`` (the stack's own generated key, = the ``api_key`` fixture), ``other`` (a second
user) and ``admin``. Limits: a 6 s seq-gap timeout, 24 pending samples, 2 MiB bodies.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass

import pytest

GAP_TIMEOUT_S = 6
MAX_PENDING_SAMPLES = 24
MAX_BODY_BYTES = 2 * 1024 * 1024


@dataclass(frozen=True)
class Keys:
    user: str
    other: str
    admin: str


@pytest.fixture(scope="session")
def keys() -> Keys:
    """``user`` is the key every test stack generates into its <state>/api_key (= ``api_key``)."""
    from conftest import _SESSION_KEY

    tag = secrets.token_urlsafe(12)
    return Keys(user=_SESSION_KEY, other=f"tml-other-{tag}", admin=f"tml-admin-{tag}")


@pytest.fixture(scope="session")
def keyed_stack(tmp_path_factory, models_dir, keys):
    """The embedded stack (pull workers, file storage) with the three keys and the limits above."""
    from conftest import _make_stack

    s = _make_stack(tmp_path_factory, models_dir, extra_env={
        "OPENRL_API_KEYS": f"other: {keys.other},admin ops: {keys.admin}",
        "OPENRL_SEQ_GAP_TIMEOUT_S": str(GAP_TIMEOUT_S),
        "OPENRL_MAX_PENDING_SAMPLES": str(MAX_PENDING_SAMPLES),
        "OPENRL_MAX_BODY_BYTES": str(MAX_BODY_BYTES),
    })
    assert s.api_key == keys.user
    s.start()
    yield s
    s.stop()
