"""No import circle among the project's own modules (``openrl/`` and ``functions/``).

Every ``.py`` file under those two packages is parsed with :mod:`ast` (nothing is imported) and
every ``import`` statement in it is collected: module level *and* inside functions, methods and
``try`` blocks, because an import inside a function hides a circle without removing it.

The rules, kept simple:

* ``import a.b.c`` and ``from a.b.c import name`` import the module ``a.b.c``; relative imports
  (``from . import x``, ``from ..m import y``) are resolved against the importing file's package.
* ``from a.b import c`` where ``a/b/c.py`` (or ``a/b/c/``) exists imports the submodule
  ``a.b.c``; where ``c`` is a plain name it imports ``a.b`` (the package's ``__init__``).
* Importing ``a.b.c`` also runs the ``__init__`` of the packages ``a`` and ``a.b``, so those count
  as imported too, *except* the importing module's own enclosing packages: Python has already
  started running those before the importing module, so they are never re-entered. (A package
  ``__init__`` that imports its own submodules is not a circle; a submodule that imports a *name*
  from its package's ``__init__`` while that ``__init__`` imports the submodule is one, and is
  caught by the previous rule.)
* Imports under ``if TYPE_CHECKING:`` are skipped: Python never executes them.
* ``importlib.import_module(...)`` with a constant string argument counts like ``import``; one
  with a computed argument cannot be resolved statically and is not counted.

Only edges between the project's own modules are kept; a circle is a strongly connected
component with more than one module.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("openrl", "functions")


def project_modules(root: Path = ROOT) -> dict[str, Path]:
    """Dotted module name -> file, for every ``.py`` under the project packages."""
    mods: dict[str, Path] = {}
    for pkg in PACKAGES:
        for path in sorted((root / pkg).rglob("*.py")):
            rel = path.relative_to(root).with_suffix("")
            parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
            mods[".".join(parts)] = path
    return mods


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _import_nodes(tree: ast.AST):
    """Every import node, skipping ``if TYPE_CHECKING:`` bodies (their ``else`` still runs)."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            stack.extend(node.orelse)
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif (
            isinstance(node, ast.Call)
            and (
                (isinstance(node.func, ast.Attribute) and node.func.attr == "import_module")
                or (isinstance(node.func, ast.Name) and node.func.id == "import_module")
            )
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            yield node
        stack.extend(ast.iter_child_nodes(node))


def imported_modules(name: str, path: Path, mods: dict[str, Path]) -> set[str]:
    """The project modules that module ``name`` (file ``path``) imports, by the rules above."""
    is_pkg = path.name == "__init__.py"
    package = name if is_pkg else name.rpartition(".")[0]
    targets: set[str] = set()
    for node in _import_nodes(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            targets.update(alias.name for alias in node.names)
        elif isinstance(node, ast.Call):
            targets.add(node.args[0].value)
        else:
            if node.level:
                base_parts = package.split(".")
                base_parts = base_parts[: len(base_parts) - (node.level - 1)]
                base = ".".join(base_parts + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            subs = {f"{base}.{alias.name}" for alias in node.names} & mods.keys()
            targets |= subs
            if len(subs) < len(node.names):  # a plain name (or ``*``) comes from the package
                targets.add(base)
    parts = name.split(".")
    own_parents = {".".join(parts[:i]) for i in range(1, len(parts))}
    found: set[str] = set()
    for target in targets:
        parts = target.split(".")
        for i in range(1, len(parts) + 1):
            mod = ".".join(parts[:i])
            if mod in mods and (mod == target or mod not in own_parents):
                found.add(mod)
    found.discard(name)  # a package naming itself (``from . import x`` in an ``__init__``)
    return found


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    mods = project_modules(root)
    return {name: imported_modules(name, path, mods) for name, path in mods.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with a circle in them (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    found: list[list[str]] = []
    counter = 0
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            for child in children:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    comp = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        comp.append(member)
                        if member == node:
                            break
                    if len(comp) > 1:
                        found.append(sorted(comp))
    return sorted(found)


def _describe(graph: dict[str, set[str]], comp: list[str]) -> str:
    members = set(comp)
    edges = [f"{a} -> {b}" for a in comp for b in sorted(graph[a]) if b in members]
    return " | ".join(edges)


def test_no_import_cycles():
    graph = import_graph()
    found = cycles(graph)
    assert not found, "import circles:\n" + "\n".join(_describe(graph, c) for c in found)


def test_the_graph_sees_lazy_imports_and_cycles(tmp_path):
    """The checker itself: a function-level import closes a circle, and it is reported."""
    (tmp_path / "openrl" / "cli").mkdir(parents=True)
    (tmp_path / "functions").mkdir()
    (tmp_path / "openrl" / "__init__.py").write_text("")
    (tmp_path / "openrl" / "cli" / "__init__.py").write_text("from . import a\n")
    (tmp_path / "functions" / "__init__.py").write_text("")
    (tmp_path / "openrl" / "cli" / "a.py").write_text("from openrl.cli import b\n")
    (tmp_path / "openrl" / "cli" / "b.py").write_text(
        "def f():\n    from .a import g\n    return g\n"
    )
    (tmp_path / "functions" / "c.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import functions.d\n"
    )
    (tmp_path / "functions" / "d.py").write_text(
        "import importlib\ndef f():\n    return importlib.import_module('functions.c')\n"
    )
    graph = import_graph(tmp_path)
    assert graph["openrl.cli"] == {"openrl.cli.a"}
    assert graph["openrl.cli.a"] == {"openrl.cli.b"}  # own package __init__ is not re-entered
    assert graph["openrl.cli.b"] == {"openrl.cli.a"}
    assert graph["functions.c"] == set()  # TYPE_CHECKING only
    assert graph["functions.d"] == {"functions.c"}
    assert cycles(graph) == [["openrl.cli.a", "openrl.cli.b"]]
