"""Stability records: what the sampler records for ``stable_reinforce`` when a sample request
sets ``record_stability_info``, and how sequences and sessions are named.

Tinker's contract (SDK 0.38 ``SamplingClient(record_stability_info=True)``): "every sample
records stability information for its sequences; recorded data is referenced from training
requests by ``sequence_id``, is session-scoped, and expires after inactivity". openrl's terms:

- **what**: per sampled sequence, its sampled tokens and the sampler's logprob of each one
  (:class:`SequenceRecord`), plus the prompt length (so prompt spans can be bounds-checked),
  the owner, the client session and the sampling session;
- **where**: the JetStream KV bucket :data:`BUCKET`, key = ``sequence_id``
  (:class:`openrl.transport.stability.StabilityStore`);
- **how long**: :data:`TTL_S` (one day) after sampling, and each training use (a
  ``stable_reinforce`` forward_backward naming the sequence) restarts the day;
- **scope**: only training runs of the same client session (``session_id``) may name it.

Ids are the gateway's: a sample request ``<sampling_session_id>:<seq_id>`` (the future id) names
its sequences ``<request_id>:<i>`` (:func:`sequence_ids`, sent back as the future's
``sample_sequence_ids``, which the SDK stamps on ``SampledSequence.sequence_id``); sampling
sessions are ``<session_id>:sample:<n>`` and training runs ``<session_id>:train:<n>``, so the
client session of any of these ids is :func:`session_of` it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np

#: JetStream KV bucket of the records (key: ``openrl.transport.bus.kv_key(sequence_id)``).
BUCKET = "OPENRL_STABILITY"
#: Seconds a record stays trainable after sampling or after its last training use.
TTL_S = 86400.0
_FORMAT = "openrl.stability.v1"


def sequence_ids(request_id: str, num_samples: int) -> list[str]:
    """The ``sequence_id`` of each of the ``num_samples`` sequences of sample request
    ``request_id`` (in the response's sequence order)."""
    return [f"{request_id}:{i}" for i in range(num_samples)]


def session_of(any_id: str) -> str | None:
    """The client session id inside a training-run, sampling-session or sequence id
    (``<session_id>:train:...`` / ``<session_id>:sample:...``); None for an id of another form."""
    for sep in (":sample:", ":train:"):
        head, found, _ = any_id.partition(sep)
        if found and head:
            return head
    return None


@dataclass
class SequenceRecord:
    """One recorded sequence.

    Attributes:
        owner: the owner id of the API key that sampled it (None if the event carried none).
        session_id: the client session of the sampling session.
        sampler_id: the sampling session id.
        prompt_len: number of prompt tokens of the request.
        tokens: int32 [N] sampled token ids (stop token included when emitted).
        logprobs: float32 [N] the sampler's logprob of each sampled token (as returned to the client).
        used_at: unix seconds of sampling or of the last training use (the TTL counts from here).
    """

    owner: str | None
    session_id: str
    sampler_id: str
    prompt_len: int
    tokens: np.ndarray
    logprobs: np.ndarray
    used_at: float

    def to_bytes(self) -> bytes:
        """A JSON header line, then tokens (int32 LE) and logprobs (float32 LE): 8 bytes a token."""
        head = {"format": _FORMAT, "owner": self.owner, "session_id": self.session_id,
                "sampler_id": self.sampler_id, "prompt_len": int(self.prompt_len), "n": int(len(self.tokens)),
                "used_at": float(self.used_at)}
        return (json.dumps(head, separators=(",", ":")).encode() + b"\n"
                + np.asarray(self.tokens, dtype="<i4").tobytes() + np.asarray(self.logprobs, dtype="<f4").tobytes())

    @classmethod
    def from_bytes(cls, raw: bytes) -> "SequenceRecord":
        """Inverse of :meth:`to_bytes`.

        Raises:
            ValueError: not a record of this format.
        """
        head_raw, sep, body = bytes(raw).partition(b"\n")
        head = json.loads(head_raw) if sep else {}
        if head.get("format") != _FORMAT:
            raise ValueError(f"not a {_FORMAT} record")
        n = int(head["n"])
        if len(body) != 8 * n:
            raise ValueError(f"record body has {len(body)} bytes for {n} tokens")
        return cls(owner=head.get("owner"), session_id=head["session_id"], sampler_id=head["sampler_id"],
                   prompt_len=int(head["prompt_len"]),
                   tokens=np.frombuffer(body[:4 * n], dtype="<i4").astype(np.int64),
                   logprobs=np.frombuffer(body[4 * n:], dtype="<f4").astype(np.float32),
                   used_at=float(head["used_at"]))
