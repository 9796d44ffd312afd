"""The ``rich`` console and tables that ``openrl status`` (:mod:`openrl.cli.status`) and
``openrl status --cluster`` (:mod:`openrl.cli.cluster`) print with.

Its own module so that the two commands share it without importing each other (``status``
imports ``cluster`` for ``--cluster``; ``cluster`` imports only this). ``rich`` is imported
when a table is drawn, not at import time (``openrl --help`` stays quick).
"""

from __future__ import annotations


def console():
    """A ``rich`` Console for tables of ids and user data."""
    from rich.console import Console

    # no emoji codes (run ids contain ":train:") and no markup in data
    return Console(soft_wrap=False, emoji=False, highlight=False)


def table(title: str, columns: list[str], rows: list[list], *, fold: tuple[str, ...] = ()):
    """A ``rich`` Table: empty / None cells shown as ``-``, every cell escaped (no markup in
    data); the ``fold`` columns (ids) stay on one line and the others wrap around them."""
    from rich.markup import escape
    from rich.table import Table

    cells = [["-" if v is None or v == "" else escape(str(v)) for v in r] for r in rows]
    t = Table(title=escape(title), title_justify="left", header_style="bold")
    for c in columns:
        if c in fold:  # ids stay on one line; other columns wrap around them
            t.add_column(c, overflow="fold", no_wrap=True)
        else:
            t.add_column(c, overflow="fold")
    for r in cells:
        t.add_row(*r)
    return t


def escape(text) -> str:
    """``text`` with its ``rich`` markup escaped."""
    from rich.markup import escape as _escape

    return _escape(str(text))
