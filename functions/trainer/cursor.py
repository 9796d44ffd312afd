"""Where each training run stands in seq_id order: one :class:`RunCursor` per trainer, advanced
by the scheduler as requests finish and read / reset by run durability (flush and restore).

Per run it keeps:

- ``next_seq``: every request with a lower seq_id has been applied, none at or above it
  (invariant 2; "state at cursor N" in functions/trainer/durable.py);
- the results of the most recently applied requests (``keep_done`` of them), so a redelivered
  request is answered with its first result instead of running twice;
- ``lost_at``: set when the run was restored from a periodic (not final) flush at that cursor:
  the trainer that held it may have applied and answered requests from there on that it never
  flushed; a request whose predecessor at ``lost_at`` never comes then fails with category
  "server" (:meth:`gap_error`), not "user".
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Iterable

from openrl.errors import ServerError, UserError


@dataclass
class _Cursor:
    next_seq: int = 1
    done: "OrderedDict[int, Any]" = field(default_factory=OrderedDict)  # seq_id -> result (recent)
    lost_at: int | None = None


class RunCursor:
    """The seq_id cursor of every run on one trainer (see the module docstring).

    Args:
        keep_done: results kept per run for redeliveries.
    """

    def __init__(self, keep_done: int = 64):
        self.keep_done = int(keep_done)
        self._runs: dict[str, _Cursor] = {}

    def known(self, model_id: str) -> bool:
        """Whether the run has a cursor here (created, restored, or sent a request)."""
        return model_id in self._runs

    def next_seq(self, model_id: str) -> int:
        """The run's next seq_id to apply (1 for a run with no cursor)."""
        c = self._runs.get(model_id)
        return c.next_seq if c is not None else 1

    def reset(self, model_id: str, next_seq: int = 1, results: dict[int, Any] | None = None,
              lost_at: int | None = None) -> None:
        """(Re)start the run at ``next_seq`` (create: 1; restore: the flushed cursor), with the
        flushed results of applied requests whose handlers had not returned, and ``lost_at``
        (a restore from a periodic flush: its cursor; a final flush or a create: None)."""
        c = self._runs.setdefault(model_id, _Cursor())
        c.next_seq = int(next_seq)
        c.lost_at = lost_at
        if results:
            for s, r in sorted(results.items()):
                c.done[int(s)] = r
            self._trim(c)

    def forget(self, model_id: str) -> None:
        """Drop the run's cursor (unloaded)."""
        self._runs.pop(model_id, None)

    def finish(self, model_id: str, seq_id: int, result: Any = None, *, ok: bool = True) -> None:
        """Request ``seq_id`` ran: the cursor moves past it when it was the next one (a failed
        request moves it too, its effect nothing); a success's result is kept."""
        c = self._runs.setdefault(model_id, _Cursor())
        if seq_id == c.next_seq:
            c.next_seq += 1
        if ok:
            c.done[seq_id] = result
            self._trim(c)

    def _trim(self, c: _Cursor) -> None:
        while len(c.done) > self.keep_done:
            c.done.popitem(last=False)

    def result(self, model_id: str, seq_id: int) -> tuple[bool, Any]:
        """``(True, result)`` when ``seq_id`` was applied and its result is kept, else ``(False, None)``."""
        c = self._runs.get(model_id)
        if c is not None and seq_id in c.done:
            return True, c.done[seq_id]
        return False, None

    def results(self, model_id: str, seq_ids: Iterable[int]) -> dict[int, Any]:
        """The kept results of those ``seq_ids`` that are below the cursor (applied)."""
        c = self._runs.get(model_id)
        if c is None:
            return {}
        return {s: c.done[s] for s in seq_ids if s < c.next_seq and s in c.done}

    def applied_without_result(self, model_id: str, seq_id: int) -> bool:
        """``seq_id`` is below the run's cursor but its result is no longer kept: it was applied
        and answered (its result is in the futures KV); a redelivery must not run it again."""
        c = self._runs.get(model_id)
        return c is not None and seq_id < c.next_seq and seq_id not in c.done

    def lost_at(self, model_id: str) -> int | None:
        """The cursor of a restore from a periodic flush (requests from there may be lost), else None."""
        c = self._runs.get(model_id)
        return c.lost_at if c is not None else None

    def gap_error(self, model_id: str, seq_id: int, timeout_s: float) -> BaseException:
        """The failure of ``seq_id`` whose predecessor (the cursor) never arrived within
        ``timeout_s``: category "server" when the gap is at :meth:`lost_at` (the trainer that
        held the run died after applying requests it never flushed; they cannot be replayed),
        else "user" (the client skipped a seq_id)."""
        missing = self.next_seq(model_id)
        if self.lost_at(model_id) == missing:
            return ServerError(
                f"seq_id {seq_id} of {model_id} cannot run: the trainer that held the run stopped without "
                f"flushing its state; it was restored at seq_id {missing} from its last flush (at creation or "
                f"periodic, OPENRL_FLUSH_INTERVAL_S), and the requests from seq_id {missing} on that the lost "
                "trainer had applied are gone. Continue from a saved checkpoint (create_training_client_from_state).")
        return UserError("seq_id", f"seq_id {seq_id} waited {timeout_s:.0f}s for seq_id {missing} of {model_id}, "
                         "which never arrived")


__all__ = ["RunCursor"]
