"""A session stack with several API keys and tight limits, for the auth, bad-input and
backpressure suites (tests/stack/test_auth.py, tests/stack/test_errors.py, tests/stack/test_load.py).

Keys: ``user`` (the stack's own generated key, = the ``api_key`` fixture), ``other`` (a second
user), ``admin`` and ``quota`` (a user with the quotas ``QUOTA_*`` below, tests/stack/test_fair_share.py).
Limits: a 6 s seq-gap timeout, 24 pending samples, 2 MiB bodies, packed passes of
``PASS_TOKEN_BUDGET`` tokens.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass

import pytest

GAP_TIMEOUT_S = 6
MAX_PENDING_SAMPLES = 24
MAX_BODY_BYTES = 2 * 1024 * 1024
PASS_TOKEN_BUDGET = 256
QUOTA_RUNS, QUOTA_TOKENS_PER_MIN, QUOTA_STORED_BYTES = 1, 3000, 1


@dataclass(frozen=True)
class Keys:
    user: str
    other: str
    admin: str
    quota: str


@pytest.fixture(scope="session")
def keys() -> Keys:
    """``user`` is the key every test stack generates into its <state>/api_key (= ``api_key``)."""
    from conftest import _SESSION_KEY

    tag = secrets.token_urlsafe(12)
    return Keys(user=_SESSION_KEY, other=f"tml-other-{tag}", admin=f"tml-admin-{tag}",
                quota=f"tml-quota-{tag}")


@pytest.fixture(scope="session")
def keyed_stack(tmp_path_factory, models_dir, keys):
    """The embedded stack (pull workers, file storage) with the three keys and the limits above."""
    from conftest import _make_stack

    s = _make_stack(tmp_path_factory, models_dir, extra_env={
        "OPENRL_API_KEYS": f"other: {keys.other},admin ops: {keys.admin},quota: {keys.quota} runs={QUOTA_RUNS} "
                           f"tokens_per_min={QUOTA_TOKENS_PER_MIN} stored_bytes={QUOTA_STORED_BYTES}",
        "OPENRL_PASS_TOKEN_BUDGET": str(PASS_TOKEN_BUDGET),
        "OPENRL_SEQ_GAP_TIMEOUT_S": str(GAP_TIMEOUT_S),
        "OPENRL_MAX_PENDING_SAMPLES": str(MAX_PENDING_SAMPLES),
        "OPENRL_MAX_BODY_BYTES": str(MAX_BODY_BYTES),
    })
    assert s.api_key == keys.user
    s.start()
    yield s
    s.stop()
