"""Per-key quotas (issue 17 item 5): key-entry parsing and the tokens-per-minute window, in-process.
The 429s through HTTP are in tests/stack/test_fair_share.py."""

from __future__ import annotations

import pytest

from functions.gateway.quotas import WINDOW_S, QuotaExceeded, Quotas
from openrl.edge.auth import AuthConfigError, Quota, load_keys, owner_of, parse_entry
from openrl.errors import UserError


def test_key_entries_carry_quotas_over_the_defaults():
    ring = load_keys({"OPENRL_API_KEYS": "alice: tml-alice-123456 runs=2 stored_bytes=3K,"
                                         "bob: tml-bob-12345678 tokens_per_min=unlimited,tml-carol-123456",
                      "OPENRL_QUOTA_TOKENS_PER_MIN": "500", "OPENRL_INTERNAL_TOKEN": "x"})
    assert ring.check("tml-alice-123456").quota == Quota(runs=2, tokens_per_min=500, stored_bytes=3072)
    assert ring.check("tml-bob-12345678").quota == Quota()  # its own "unlimited" lifts the default
    assert ring.check("tml-carol-123456").quota == Quota(tokens_per_min=500)
    assert ring.quota_of(owner_of("tml-alice-123456")).runs == 2
    assert parse_entry("admin ops: tml-c2-12345678 runs=0", "x").quota == (("runs", None),)


@pytest.mark.parametrize("entry, word", [("tml-abcdefgh12 turns=3", "unknown quota 'turns'"),
                                         ("tml-abcdefgh12 runs=-1", "runs='-1'"),
                                         ("tml-abcdefgh12 stored_bytes=lots", "stored_bytes='lots'")])
def test_bad_quotas_are_named(entry, word):
    with pytest.raises(AuthConfigError, match=word):
        parse_entry(entry, "OPENRL_API_KEYS entry 1")


def test_tokens_per_minute_window_and_retry_after():
    q, quota = Quotas(), Quota(tokens_per_min=1000)
    q.charge_tokens("o", quota, 600, now=100.0)
    q.charge_tokens("o", quota, 300, now=110.0)
    with pytest.raises(QuotaExceeded) as e:
        q.charge_tokens("o", quota, 200, now=120.0)
    assert e.value.status == 429 and e.value.field == "quota.tokens_per_min" and e.value.category == "user"
    assert e.value.retry_after == pytest.approx(100.0 + WINDOW_S - 120.0)  # when the 600 leave the window
    q.charge_tokens("other-owner", quota, 1000, now=120.0)  # keys are counted apart
    q.charge_tokens("o", quota, 200, now=100.0 + WINDOW_S + 0.1)
    assert q.used_tokens("o", now=100.0 + WINDOW_S + 0.1) == 500
    with pytest.raises(UserError, match="quota.tokens_per_min"):
        q.charge_tokens("o", quota, 1001, now=500.0)  # could never pass: 400, not 429
    q.charge_tokens("o", Quota(), 10**9)  # unlimited
    assert q.rejected == {"tokens_per_min": 1}
