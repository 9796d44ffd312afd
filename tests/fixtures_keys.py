"""A session stack with several API keys and tight limits, for the auth, bad-input and
backpressure suites (tests/stack/test_auth.py, tests/stack/test_errors.py, tests/stack/test_load.py).

Keys: ``user`` (the stack's own generated key, = the ``api_key`` fixture), ``other`` (a second
user), ``admin`` and ``quota`` (a user with the quotas ``QUOTA_*`` below, tests/stack/test_fair_share.py).
Limits: a 6 s seq-gap timeout, 24 pending samples, 2 MiB bodies, packed passes of
``PASS_TOKEN_BUDGET`` tokens.

With an external stack (``$OPENRL_TEST_STACK_STATE``, tests/external_stack.py) ``keyed_stack``
is that stack, and ``keys`` its keys, when its serve was started with the environment of
:func:`serve_env` (``bench/gpu_conformance.py --serve`` / ``--print-env`` write it to
``<state>/conformance.json``): the keys, the quota key's quotas, the seq-gap timeout and the
body limit. The pass token budget and the pending-samples limit stay at the serve's defaults
(they would change what the rest of the suite measures), so the tests that need those
(:func:`skip_unless_own_limits`) skip; so do the tests that stop the stack's processes.
The keys serve one test session (the keyed tests expect fresh keys: the quota key's one run, the
``other`` key's own runs): the first session marks conformance.json as used and later ones
skip the keyed tests. Without conformance.json every keyed test skips.
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


def new_keys(user: str) -> Keys:
    """Fresh random ``other`` / ``admin`` / ``quota`` keys beside ``user``."""
    tag = secrets.token_urlsafe(12)
    return Keys(user=user, other=f"tml-other-{tag}", admin=f"tml-admin-{tag}", quota=f"tml-quota-{tag}")


def serve_env(keys: Keys) -> dict[str, str]:
    """The environment that gives a stack the three keys (``OPENRL_API_KEYS``; the quota key
    with its quotas), the seq-gap timeout and the body limit above (what an external stack
    needs for the keyed tests; ``keyed_stack`` adds the pass budget and pending limit)."""
    return {
        "OPENRL_API_KEYS": f"other: {keys.other},admin ops: {keys.admin},quota: {keys.quota} runs={QUOTA_RUNS} "
                           f"tokens_per_min={QUOTA_TOKENS_PER_MIN} stored_bytes={QUOTA_STORED_BYTES}",
        "OPENRL_SEQ_GAP_TIMEOUT_S": str(GAP_TIMEOUT_S),
        "OPENRL_MAX_BODY_BYTES": str(MAX_BODY_BYTES),
    }


@pytest.fixture(scope="session")
def keys(request) -> Keys:
    """``user`` is the key every test stack generates into its <state>/api_key (= ``api_key``);
    with an external stack, the keys its conformance.json names."""
    from conftest import _SESSION_KEY, EXTERNAL

    if EXTERNAL is not None:
        return request.getfixturevalue("keyed_stack").keyring
    return new_keys(_SESSION_KEY)


@pytest.fixture(scope="session")
def keyed_stack(request, tmp_path_factory, models_dir):
    """The embedded stack (pull workers, file storage) with the three keys and the limits above;
    with an external stack, that stack (``keyring``: its :class:`Keys`) if its serve has
    :func:`serve_env` (else the keyed tests skip)."""
    from conftest import EXTERNAL, _make_stack

    if EXTERNAL is not None:
        yield _external_keyed(request.getfixturevalue("stack"))
        return
    keys = request.getfixturevalue("keys")
    s = _make_stack(tmp_path_factory, models_dir, extra_env={
        **serve_env(keys),
        "OPENRL_PASS_TOKEN_BUDGET": str(PASS_TOKEN_BUDGET),
        "OPENRL_MAX_PENDING_SAMPLES": str(MAX_PENDING_SAMPLES),
    })
    assert s.api_key == keys.user
    s.start()
    yield s
    s.stop()


def _external_keyed(stack):
    """The external stack with its :class:`Keys` as ``keyring``; skips unless its serve_env
    (conformance.json) holds every variable of :func:`serve_env` with this module's values, the
    serve accepts the ``other`` key, and no earlier test session used the keys (then marks them used)."""
    import os
    import time

    import httpx

    from external_stack import mark_conformance_used, skip_reason

    k = stack.keys
    if not {"other", "admin", "quota"} <= set(k):
        pytest.skip(skip_reason("no extra API keys (start the serve with bench/gpu_conformance.py --serve or "
                                "--print-env to run the keyed tests)"))
    keys = Keys(user=stack.api_key, other=k["other"], admin=k["admin"], quota=k["quota"])
    want = serve_env(keys)
    wrong = sorted(n for n, v in want.items() if stack.serve_env.get(n) != v)
    if wrong:
        pytest.skip(skip_reason(f"the serve's environment differs from tests/fixtures_keys.py in {', '.join(wrong)}"))
    r = httpx.get(stack.base_url + "/api/v1/training_runs", params={"limit": 1}, headers={"X-API-Key": keys.other},
                  timeout=60)
    if r.status_code == 401:
        pytest.skip(skip_reason("the serve does not accept conformance.json's keys (start it with the environment "
                                "that bench/gpu_conformance.py --print-env printed)"))
    used = mark_conformance_used(stack.state_dir, f"pytest pid {os.getpid()} at {time.strftime('%H:%M:%S')}")
    if used:
        pytest.skip(skip_reason(f"its extra keys were used by an earlier test session ({used}); the keyed tests "
                                "need a new serve (bench/gpu_conformance.py --serve starts one per run)"))
    stack.keyring = keys
    return stack


def skip_unless_own_limits(stack, why: str) -> None:
    """Skip on an external stack a test that needs ``keyed_stack``'s own pass budget or
    pending-samples limit, or stops the stack's processes (``why`` says which)."""
    from external_stack import skip_if_external

    skip_if_external(stack, why)
