"""The test tree itself: pytest imports test modules by basename (rootdir, no packages), so two
files of one name in different folders stop the whole run at collection (it happened: a
``tests/unit`` and a ``tests/stack`` file shared a name and CI collected nothing)."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]


def test_test_module_basenames_are_unique():
    names = Counter(p.name for p in TESTS.rglob("test_*.py") if ".venv" not in p.parts)
    assert [n for n, c in names.items() if c > 1] == []
