"""Executing sampled SQL safely, and the execution-match reward.

A sampled query is run on a **read-only** connection (``file:...?mode=ro``) that also has

* ``PRAGMA query_only = ON`` and an **authorizer** that allows reading only (SELECT, reads of
  columns, functions, recursive CTEs); INSERT/UPDATE/DELETE, CREATE/DROP/ALTER, ATTACH/DETACH,
  PRAGMA, transactions, ... are refused while the statement is *prepared*, before anything
  runs, so a write attempt never touches the file;
* one statement only (``sqlite3`` refuses a second statement after the first);
* a **time limit**: a progress handler, called every 1,000 virtual-machine instructions,
  interrupts the query once its deadline has passed;
* a **row limit**: rows are fetched ``max_rows + 1`` at most; a result that has more rows
  counts as a failure (no gold answer is that large).

The reward is 1.0 when the sampled query's result set equals the gold query's, else 0.0.
Rows are compared as tuples (column names are ignored; column order matters); the
comparison is order-insensitive (a multiset) unless the question asks for an order.
Floats are rounded to 4 decimals before comparing.
"""

from __future__ import annotations

import re
import sqlite3
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .questions import Example

# The actions a read-only query needs; everything else is denied at prepare time.
_ALLOWED_ACTIONS = {sqlite3.SQLITE_SELECT, sqlite3.SQLITE_READ, sqlite3.SQLITE_FUNCTION}
if hasattr(sqlite3, "SQLITE_RECURSIVE"):
    _ALLOWED_ACTIONS.add(sqlite3.SQLITE_RECURSIVE)
else:  # pragma: no cover - very old Python
    _ALLOWED_ACTIONS.add(33)
# Functions that could reach outside the database file or change the connection.
_DENIED_FUNCTIONS = {"load_extension", "readfile", "writefile", "edit", "fts3_tokenizer"}


@dataclass
class ExecResult:
    """What running one query gave: rows, or an error (``kind`` says which failure)."""

    ok: bool
    rows: list[tuple] = field(default_factory=list)
    error: str | None = None
    kind: str = "ok"  # ok | empty | syntax | denied | timeout | too_many_rows | error
    seconds: float = 0.0


def extract_sql(text: str) -> str:
    """The SQL in a model's answer: the body of a ```sql fence if there is one, else the
    text; trailing whitespace and a trailing ``;`` removed, special tokens dropped."""
    text = re.sub(r"<\|[^|>]*\|>", "", text)
    m = re.search(r"```(?:sql|sqlite)?\s*(.*?)(?:```|$)", text, flags=re.S | re.I)
    if m:
        text = m.group(1)
    text = text.strip()
    while text.endswith(";"):
        text = text[:-1].rstrip()
    return text


def _authorizer(action: int, arg1: Any, arg2: Any, db_name: Any, source: Any) -> int:
    if action not in _ALLOWED_ACTIONS:
        return sqlite3.SQLITE_DENY
    if action == sqlite3.SQLITE_FUNCTION and str(arg2).lower() in _DENIED_FUNCTIONS:
        return sqlite3.SQLITE_DENY
    if action == sqlite3.SQLITE_READ and db_name not in (None, "main"):
        return sqlite3.SQLITE_DENY  # only the main database (no temp tables, nothing attached)
    return sqlite3.SQLITE_OK


def _normalise(value: Any) -> Any:
    if isinstance(value, float):
        r = round(value, 4)
        return int(r) if r.is_integer() else r
    if isinstance(value, bytes):
        return value.hex()
    return value


def same_result(got: list[tuple], gold: list[tuple], ordered: bool) -> bool:
    """Whether two result sets match: as lists if ``ordered``, else as multisets of rows."""
    a = [tuple(_normalise(v) for v in r) for r in got]
    b = [tuple(_normalise(v) for v in r) for r in gold]
    if ordered:
        return a == b
    return Counter(a) == Counter(b)


class SQLEnv:
    """Runs queries against one SQLite file, read-only, with a time and a row limit.

    Args:
        db_path: the database file (it must exist; it is never written).
        timeout_s: wall-clock limit per query.
        max_rows: a result with more rows than this is a failure.
    """

    def __init__(self, db_path: str | Path, timeout_s: float = 1.0, max_rows: int = 1000):
        self.db_path = Path(db_path).resolve()
        if not self.db_path.exists():
            raise FileNotFoundError(self.db_path)
        self.timeout_s = timeout_s
        self.max_rows = max_rows
        self._gold: dict[str, list[tuple]] = {}

    def _connect(self) -> sqlite3.Connection:
        conn = sqlite3.connect(f"{self.db_path.as_uri()}?mode=ro", uri=True, check_same_thread=False,
                               isolation_level=None)
        conn.execute("PRAGMA query_only = ON")
        conn.set_authorizer(_authorizer)
        return conn

    def execute(self, sql: str) -> ExecResult:
        """Run one query; never raises for a bad query (the failure is in the result)."""
        sql = sql.strip()
        t0 = time.monotonic()
        if not sql:
            return ExecResult(False, error="empty query", kind="empty")
        conn = self._connect()
        deadline = t0 + self.timeout_s
        conn.set_progress_handler(lambda: 1 if time.monotonic() > deadline else 0, 1000)
        try:
            cur = conn.execute(sql)
            rows = cur.fetchmany(self.max_rows + 1)
            if len(rows) > self.max_rows:
                return ExecResult(False, error=f"more than {self.max_rows} rows", kind="too_many_rows",
                                  seconds=time.monotonic() - t0)
            return ExecResult(True, rows=[tuple(r) for r in rows], seconds=time.monotonic() - t0)
        except sqlite3.DatabaseError as e:
            msg = str(e)
            if "interrupted" in msg:
                kind = "timeout"
            elif "not authorized" in msg or "readonly" in msg or "query_only" in msg:
                kind = "denied"
            elif "syntax error" in msg or "incomplete input" in msg or "unrecognized token" in msg:
                kind = "syntax"
            else:
                kind = "error"
            return ExecResult(False, error=msg, kind=kind, seconds=time.monotonic() - t0)
        except (sqlite3.Error, ValueError, OverflowError) as e:  # e.g. "one statement at a time"
            return ExecResult(False, error=str(e), kind="error", seconds=time.monotonic() - t0)
        finally:
            conn.close()

    def gold_rows(self, example: Example) -> list[tuple]:
        """The gold query's result (cached).

        Raises:
            RuntimeError: the gold query itself failed (a bug in the templates).
        """
        if example.sql not in self._gold:
            res = self.execute(example.sql)
            if not res.ok:
                raise RuntimeError(f"gold query failed ({res.error}): {example.sql}")
            self._gold[example.sql] = res.rows
        return self._gold[example.sql]

    def score(self, sql: str, example: Example) -> tuple[float, ExecResult]:
        """(reward, execution result) of a query for one question: 1.0 on a matching result set."""
        res = self.execute(sql)
        if not res.ok:
            return 0.0, res
        return (1.0 if same_result(res.rows, self.gold_rows(example), example.ordered) else 0.0), res

    def reward(self, completion: str, example: Example) -> tuple[float, ExecResult]:
        """``score`` of the SQL extracted from a model's answer (see :func:`extract_sql`)."""
        return self.score(extract_sql(completion), example)
