"""API keys: who may call the gateway, and which owner id each caller gets.

The gateway is configured with a set of keys; every ``/api/v1`` route (except
``/api/v1/healthz``, for probes) needs one of them in the ``X-API-Key`` header, as the
``tinker`` SDK sends it. ``/api/v1/client/config`` is protected too: the SDK sends the key
there first, so a wrong key fails at client construction with ``AuthenticationError``
instead of at the first call. (``/metrics`` and the signed ``/download/*`` URLs live outside
``/api/v1`` and carry no key.) A missing or wrong key gets 401 and
``{"detail": ..., "category": "user", "field": "X-API-Key"}``. Keys are held and compared only as sha256 digests (``hmac.compare_digest``), so
neither the process memory nor a key file needs the plain key (see ``sha256:`` below).

Sources (their union is used):

* ``OPENRL_API_KEYS``: comma-separated entries;
* ``OPENRL_API_KEYS_FILE``: a file (e.g. a mounted Kubernetes Secret), one entry a line;
  blank lines and lines starting with ``#`` are ignored.

An entry is ``[admin] [NAME:] KEY``:

    tml-3f...                       a user key
    alice: tml-9a...                a user key named "alice" (the name is only for logs)
    admin tml-c2...                 an admin key: listings with ``access_scope=all`` (or the
                                    SDK's ``accessible``) show every key's objects
    admin ops: sha256:5e8f...       the same, given as the sha256 hex digest of the key

A key must start with ``tml-`` (the SDK refuses to send anything else, JWTs aside).

Per-key quotas follow the key as ``NAME=VALUE`` words (:class:`Quota`; the gateway answers 429
with ``Retry-After`` and ``field: quota.<name>`` when one is exceeded)::

    alice: tml-9a... runs=4 tokens_per_min=200000 stored_bytes=20G
    bob: tml-77... tokens_per_min=unlimited

``runs``: concurrent training runs (runs of the key whose session is alive); ``tokens_per_min``:
trained plus sampled tokens admitted in any 60 s window (forward / forward_backward: the
datums' tokens; sample: prompt + num_samples x max_tokens); ``stored_bytes``: bytes of the
key's live checkpoints (a save is refused once they reach it; suffixes K, M, G, T = 1024^n).
A quota a key does not name comes from ``OPENRL_QUOTA_RUNS`` / ``OPENRL_QUOTA_TOKENS_PER_MIN``
/ ``OPENRL_QUOTA_STORED_BYTES``; 0 or ``unlimited`` means no limit (the default).

Owner ids: every object a caller creates carries ``owner = sha256(key)[:16]`` (hex); another
key's objects answer 404 and are left out of listings (invariant 6).

No keys configured: :func:`load_keys` raises :class:`AuthConfigError` (the gateway refuses to
start) unless ``OPENRL_INSECURE_ANY_KEY=1``, which accepts any ``tml-`` key, each still its own
owner, and warns loudly at start and in every ``create_session`` answer. The embedded stack
(``openrl serve`` / ``openrl run``) always configures its generated ``<state>/api_key``.

Internal sinks: ``/events/*`` (result CloudEvents pushed by Knative Eventing or the local
dispatcher) are not for API keys. With ``OPENRL_INTERNAL_TOKEN`` set they need it in the
``X-OpenRL-Internal-Token`` header (or a ``?token=`` query parameter, for Trigger URIs that
cannot carry headers); without it they are open and must only be reachable cluster-locally.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from openrl.config import Settings

log = logging.getLogger("openrl.edge.auth")

KEY_PREFIX = "tml-"
HEADER = "X-API-Key"
INTERNAL_HEADER = "X-OpenRL-Internal-Token"


class AuthConfigError(ValueError):
    """The key configuration is unusable (no keys, a malformed entry, an unreadable file)."""


class AuthError(Exception):
    """A request without a valid key. ``status`` is 401; ``message`` and ``field`` name the
    header (:data:`HEADER`, or :data:`INTERNAL_HEADER` for the ``/events/*`` sinks)."""

    status = 401

    def __init__(self, message: str, field: str = HEADER):
        super().__init__(message)
        self.message = message
        self.field = field


def digest(key: str) -> bytes:
    """sha256 digest (32 bytes) of an API key."""
    return hashlib.sha256(key.encode()).digest()


def owner_of_digest(d: bytes) -> str:
    """Owner id of a key from its digest: the first 16 hex characters of sha256(key)."""
    return d.hex()[:16]


def owner_of(key: str | None) -> str:
    """Owner id of an API key: the first 16 hex characters of sha256(key)."""
    return owner_of_digest(digest(key or ""))


QUOTA_NAMES = ("runs", "tokens_per_min", "stored_bytes")
_SIZE_SUFFIX = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


@dataclass(frozen=True)
class Quota:
    """Per-key limits (None = unlimited).

    runs: concurrent training runs. tokens_per_min: trained + sampled tokens admitted per 60 s.
    stored_bytes: bytes of live checkpoints (saves are refused at or above it).
    """

    runs: int | None = None
    tokens_per_min: int | None = None
    stored_bytes: int | None = None



def parse_quota_value(name: str, text: str | int | None, where: str) -> int | None:
    """A quota value: a non-negative integer (``stored_bytes`` may end in K/M/G/T), ``unlimited``;
    0 and ``unlimited`` give None (no limit).

    Raises:
        AuthConfigError: naming ``where`` and the quota.
    """
    if text is None:
        return None
    t = str(text).strip()
    if t.lower() in ("", "unlimited", "none"):
        return None
    mult = 1
    if name == "stored_bytes" and t[-1:].upper() in _SIZE_SUFFIX:
        mult, t = _SIZE_SUFFIX[t[-1].upper()], t[:-1]
    try:
        v = int(t) * mult
    except ValueError:
        v = -1
    if v < 0:
        raise AuthConfigError(f"{where}: quota {name}={text!r} must be a non-negative integer or 'unlimited'")
    return v or None


def default_quota(cfg: Settings | Mapping[str, str] | None = None) -> Quota:
    """The quota of keys that name none: ``OPENRL_QUOTA_RUNS``, ``OPENRL_QUOTA_TOKENS_PER_MIN``,
    ``OPENRL_QUOTA_STORED_BYTES`` (0 = unlimited).

    Raises:
        AuthConfigError: a malformed value.
    """
    if cfg is None or isinstance(cfg, Settings):
        cfg = cfg if cfg is not None else Settings()
        vals = {n: getattr(cfg, f"quota_{n}") for n in QUOTA_NAMES}
    else:
        vals = {n: cfg.get(f"OPENRL_QUOTA_{n.upper()}") for n in QUOTA_NAMES}
    return Quota(**{n: parse_quota_value(n, v, f"OPENRL_QUOTA_{n.upper()}") for n, v in vals.items()})


@dataclass(frozen=True)
class Caller:
    """The identity behind a request's key.

    owner: owner id stamped on every object the caller creates.
    admin: may list every owner's objects (``access_scope=all``).
    name: label from the key entry (logs only; may be empty).
    quota: the key's :class:`Quota`.
    """

    owner: str
    admin: bool = False
    name: str = ""
    quota: Quota = Quota()


@dataclass(frozen=True)
class KeyEntry:
    """One configured key: its sha256 ``digest`` (32 bytes), ``admin`` flag, ``name`` label and the
    quotas it names (``quota``: name -> value, None = unlimited; absent = the default)."""

    digest: bytes
    admin: bool
    name: str
    quota: tuple[tuple[str, int | None], ...] = ()


def parse_entry(text: str, where: str) -> KeyEntry:
    """Parse one ``[admin] [NAME:] KEY [QUOTA=VALUE ...]`` entry (KEY may be ``sha256:<64 hex>``;
    quotas as :data:`QUOTA_NAMES`, see the module doc).

    Raises:
        AuthConfigError: empty entry, a key not starting with ``tml-``, a bad digest, an unknown
            or malformed quota.
    """
    words = text.split()
    if not words:
        raise AuthConfigError(f"{where}: empty key entry")
    quota: dict[str, int | None] = {}
    while len(words) > 1 and "=" in words[-1]:
        name, _, value = words.pop().partition("=")
        if name not in QUOTA_NAMES:
            raise AuthConfigError(f"{where}: unknown quota {name!r} (known: {', '.join(QUOTA_NAMES)})")
        quota[name] = parse_quota_value(name, value, where)
    q = tuple(sorted(quota.items()))
    admin = False
    if words[0] == "admin" and len(words) > 1:
        admin, words = True, words[1:]
    name = ""
    if len(words) > 1 and words[0].endswith(":"):
        name, words = words[0][:-1], words[1:]
    elif len(words) == 1 and ":" in words[0] and not words[0].startswith(("sha256:", KEY_PREFIX)):
        name, _, rest = words[0].partition(":")  # "alice:tml-..." without a space
        words = [rest]
    if len(words) != 1:
        raise AuthConfigError(f"{where}: expected '[admin] [NAME:] KEY', got {len(words)} words after the markers")
    key = words[0]
    if key.startswith("sha256:"):
        hexd = key[len("sha256:"):]
        try:
            d = bytes.fromhex(hexd)
        except ValueError:
            d = b""
        if len(d) != 32:
            raise AuthConfigError(f"{where}: sha256: needs 64 hex characters")
        return KeyEntry(d, admin, name, q)
    if not key.startswith(KEY_PREFIX) or len(key) < len(KEY_PREFIX) + 8:
        raise AuthConfigError(f"{where}: a key must start with {KEY_PREFIX!r} and have at least 8 more characters")
    return KeyEntry(digest(key), admin, name, q)


class KeyRing:
    """The configured keys (as digests) and the policy for requests without keys.

    Args:
        entries: the accepted keys.
        allow_any: accept any ``tml-`` key (development only; see the module doc).
        internal_token: shared secret of the ``/events/*`` sinks (None: open sinks).
    """

    def __init__(self, entries: list[KeyEntry], *, allow_any: bool = False, internal_token: str | None = None,
                 quota: Quota | None = None):
        self.entries = list(entries)
        self.allow_any = allow_any
        self._internal = digest(internal_token) if internal_token else None
        self.default_quota = quota or Quota()
        self._quotas = {owner_of_digest(e.digest): Quota(**{**{n: getattr(self.default_quota, n) for n in QUOTA_NAMES},
                                                            **dict(e.quota)})  # a written quota wins, unlimited too
                        for e in self.entries}

    def quota_of(self, owner: str) -> Quota:
        """The :class:`Quota` of owner id ``owner`` (the default for keys accepted by ``allow_any``)."""
        return self._quotas.get(owner, self.default_quota)

    @property
    def has_internal_token(self) -> bool:
        return self._internal is not None

    def check(self, key: str | None) -> Caller:
        """The caller behind ``key``.

        Every configured digest is compared (``hmac.compare_digest``), so the time taken does
        not depend on which entry matched.

        Raises:
            AuthError: no key, or a key that is not configured (status 401).
        """
        if not key:
            raise AuthError(f"missing API key: send it in the {HEADER} header")
        d = digest(key)
        found: KeyEntry | None = None
        for e in self.entries:
            if hmac.compare_digest(d, e.digest):
                found = e
        if found is not None:
            owner = owner_of_digest(d)
            return Caller(owner, found.admin, found.name, self.quota_of(owner))
        if self.allow_any and key.startswith(KEY_PREFIX):
            return Caller(owner_of_digest(d), quota=self.default_quota)
        raise AuthError(f"invalid API key in the {HEADER} header")

    def check_internal(self, token: str | None) -> None:
        """Check the token of an ``/events/*`` request; a no-op when no token is configured.

        Raises:
            AuthError: the token is missing or wrong (status 401).
        """
        if self._internal is None:
            return
        if not token or not hmac.compare_digest(digest(token), self._internal):
            raise AuthError(f"internal sink: missing or wrong {INTERNAL_HEADER} header", INTERNAL_HEADER)


def _split_env(value: str) -> list[str]:
    return [p.strip() for p in value.split(",") if p.strip()]


def load_keys(env: Mapping[str, str] | Settings | None = None) -> KeyRing:
    """Build the :class:`KeyRing` from ``OPENRL_API_KEYS`` / ``OPENRL_API_KEYS_FILE``,
    ``OPENRL_INSECURE_ANY_KEY``, ``OPENRL_INTERNAL_TOKEN`` and the default quotas
    ``OPENRL_QUOTA_*`` (:func:`default_quota`).

    Args:
        env: a :class:`openrl.config.Settings` (its ``api_keys``, ``api_keys_file``,
            ``insecure_any_key``, ``internal_token``), or a mapping of those variable names
            to strings that replaces the environment (tests); default ``Settings()``.

    Raises:
        AuthConfigError: a malformed entry, an unreadable key file, or no keys at all
            without ``OPENRL_INSECURE_ANY_KEY=1``.
    """
    if env is None or isinstance(env, Settings):
        cfg = env if env is not None else Settings()
        api_keys, path = cfg.api_keys or "", cfg.api_keys_file
        allow_any, token = cfg.insecure_any_key, cfg.internal_token or None
    else:
        api_keys, path = env.get("OPENRL_API_KEYS", ""), env.get("OPENRL_API_KEYS_FILE")
        allow_any = env.get("OPENRL_INSECURE_ANY_KEY", "").lower() in ("1", "true", "yes")
        token = env.get("OPENRL_INTERNAL_TOKEN") or None
    entries: list[KeyEntry] = []
    for i, item in enumerate(_split_env(api_keys)):
        entries.append(parse_entry(item, f"OPENRL_API_KEYS entry {i + 1}"))
    if path:
        try:
            lines = Path(path).read_text().splitlines()
        except OSError as exc:
            raise AuthConfigError(f"OPENRL_API_KEYS_FILE={path}: {exc}") from None
        for n, line in enumerate(lines, 1):
            line = line.strip()
            if line and not line.startswith("#"):
                entries.append(parse_entry(line, f"{path}:{n}"))
    if not entries and not allow_any:
        raise AuthConfigError(
            "no API keys configured: set OPENRL_API_KEYS (comma-separated) or OPENRL_API_KEYS_FILE "
            "(one key a line), or OPENRL_INSECURE_ANY_KEY=1 to accept any tml- key (development only)")
    if allow_any:
        log.warning("OPENRL_INSECURE_ANY_KEY=1: ANY 'tml-' API key is accepted; runs are still separated by key, "
                    "but anyone who can reach this gateway can use it. Do not expose it.")
    if token is None:
        log.warning("OPENRL_INTERNAL_TOKEN is not set: /events/* accept unauthenticated result events; "
                    "route them cluster-locally only")
    quota = default_quota(env)
    return KeyRing(entries, allow_any=allow_any, internal_token=token, quota=quota)
