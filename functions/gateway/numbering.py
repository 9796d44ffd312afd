"""Training requests without ``seq_id``: the gateway numbers them (issue 36).

The SDK's request types declare ``seq_id`` optional, and the SDK always sends one: each
``TrainingClient`` numbers its calls 1, 2, 3, ... and the trainer applies a run's requests in
that order, holding a later one back until the gap before it fills (invariant 2). A client that
sends no ``seq_id`` (curl, another language) gets the same ordering from the gateway instead:

* **the rule**: a run's requests without ``seq_id`` are numbered 1, 2, 3, ... in the order the
  gateway accepts them (after their checks pass, when it answers with the future); the number
  is the future's ``request_id`` suffix (``<model_id>:<n>``). The counter lives in the run's
  record (``TrainingRun.seq_numbering`` / ``next_seq_id``, a compare-and-set in the metadata
  KV bucket), so every gateway replica shares it.
* **the race**: two requests sent at once, without waiting for the first one's answer, are
  numbered in whichever order they reach the gateway; a client that needs an order waits for
  each answer (the future handle, not its result) before sending the next request. A request
  without ``seq_id`` is never deduplicated: retrying one after a lost answer applies it again.
* **one numbering per run**: a run whose client sent ``seq_id`` refuses a request without it,
  and a run numbered by the gateway refuses one with it (400 naming ``seq_id``), so the two never
  give one number to two requests. (A numbered request and an unnumbered one sent to a fresh run
  at the same moment can both pass that check; do not mix them.)
* a number given to a request that then fails before it is published (a 429, a refusal that
  needs the number, such as an in-place ``load_weights`` that is not request 1) is skipped, as
  the seq_id of any refused request is (:mod:`functions.gateway.skips`).
"""

from __future__ import annotations

from typing import Awaitable, Callable, TypeVar

from functions.gateway.context import Gateway
from functions.gateway.skips import MAX_SEQ_ID, publish_skip, request_id_for
from openrl.contract.records import TrainingRun
from openrl.errors import NotFound, UserError

SERVER = "server"  # TrainingRun.seq_numbering of a run the gateway numbers

T = TypeVar("T")


class NumberingError(UserError):
    """A request numbered the other way than its run (400 naming ``seq_id``). Its seq_id is not
    skipped (:class:`functions.gateway.skips.SkipRejected` checks ``skip``): on a run the gateway
    numbers, that number may be one the gateway gives out later."""

    skip = False


def check_seq_id(run: TrainingRun, seq_id: int) -> None:
    """A request that carries ``seq_id``: in range, and its run numbered by its client.

    Raises:
        UserError: ``seq_id`` outside [1, MAX_SEQ_ID] (skipped as usual).
        NumberingError: the run is numbered by the gateway.
    """
    if not 1 <= seq_id <= MAX_SEQ_ID:
        raise UserError("seq_id", f"must be between 1 and {MAX_SEQ_ID}, or left out (the gateway numbers the request)")
    if run.seq_numbering == SERVER:
        raise NumberingError("seq_id", f"training run {run.model_id!r} is numbered by the gateway (its requests came "
                             "without seq_id); leave seq_id out of its requests too")


async def next_seq_id(g: Gateway, run: TrainingRun) -> int:
    """Give the next number of a run whose requests come without ``seq_id``.

    Raises:
        NumberingError: the run's client numbered a request already (its ``<model_id>:1`` future
            exists, or the skip of a refused seq_id 1).
        NotFound: the run's record is gone.
    """
    if run.seq_numbering != SERVER:
        first = request_id_for(run.model_id, 1)
        if any([await g.bus.future_get(rid) is not None for rid in (first, first + ":skip")]):
            # request 1 exists: the client's, unless another request without seq_id got number 1
            # since ``run`` was read (the record says so before that future is made)
            fresh = await g.model_record(run.model_id)
            if fresh is None or fresh.seq_numbering != SERVER:
                raise NumberingError("seq_id", f"required: training run {run.model_id!r} is numbered by its client "
                                     "(its requests carry seq_id); give this one the next seq_id too")
    given: list[int] = []

    def bump(old: dict | None) -> dict:
        if old is None:
            raise NotFound("model_id", f"unknown training run {run.model_id!r}")
        rec = TrainingRun.load(old)
        n = rec.next_seq_id if rec.seq_numbering == SERVER and rec.next_seq_id else 1
        rec.seq_numbering, rec.next_seq_id = SERVER, n + 1
        given[:] = [n]
        return rec.stored()

    await g.bus.meta_update(bump, "model", run.model_id)
    return given[0]


async def numbered(g: Gateway, run: TrainingRun, publish: Callable[[int], Awaitable[T]]) -> T:
    """``publish(n)`` with the run's next number ``n`` (:func:`next_seq_id`); if it raises, ``n``
    is skipped (best effort) so that the run's later requests do not wait for it."""
    n = await next_seq_id(g, run)
    try:
        return await publish(n)
    except BaseException:
        try:
            await publish_skip(g, run.model_id, run.shard, n, run.owner)
        except Exception:  # noqa: BLE001 - the trainer's gap timeout ends the wait instead
            pass
        raise
