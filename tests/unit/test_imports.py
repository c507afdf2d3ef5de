"""The import graph of `ringpass` and `lowering` (DESIGN.md, "Two packages"): no module imports itself back through
others, and `lowering` never imports `ringpass`.

An edge A -> B: module A imports B anywhere in its code, at import time or inside a function (a lazy import hides a
cycle, it does not remove it). ``from pkg import name`` imports ``pkg.name`` when that is a module, else ``pkg``; a
package's ``__init__`` is the module ``pkg``, and what it re-exports it imports. The parent packages Python imports
first (``pkg`` before ``pkg.mod``) are not edges: they are not what A asked for, and with them every package whose
``__init__`` re-exports a submodule would be in a cycle with it.
"""

from __future__ import annotations

import ast
from pathlib import Path

import networkx as nx

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("ringpass", "lowering")


def module_files(root: Path, packages=PACKAGES) -> dict[str, Path]:
    """Every module of ``packages`` under ``root`` by its dotted name (a package by its own name)."""
    modules = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def imported_names(module: str, path: Path) -> set[tuple[str, ...]]:
    """What ``module`` imports anywhere in its file: for each name, the modules it may be, first the one Python
    takes when it exists (``from pkg import name``: ``(pkg.name, pkg)``; ``import pkg.mod``: ``(pkg.mod,)``)."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names |= {(alias.name,) for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the package, one level up per further dot
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            names |= {(f"{base}.{alias.name}", base) for alias in node.names}
    return names


def import_graph(modules: dict[str, Path]) -> nx.DiGraph:
    """Module -> the modules of ``modules`` it imports (a name that is none of them, e.g. a module since moved,
    is no edge: importing it fails on its own)."""
    graph = nx.DiGraph()
    graph.add_nodes_from(modules)
    for module, path in modules.items():
        for candidates in imported_names(module, path):
            target = next((name for name in candidates if name in modules), None)
            if target is not None and target != module:
                graph.add_edge(module, target)
    return graph


def cycles(graph: nx.DiGraph) -> set[tuple[str, ...]]:
    """Each set of modules that import one another through others (a strongly connected component of 2 or more)."""
    return {tuple(sorted(component)) for component in nx.strongly_connected_components(graph) if len(component) > 1}


def test_no_module_of_ringpass_or_lowering_imports_itself_back():
    graph = import_graph(module_files(ROOT))
    shown = "\n".join(
        f"  {' <-> '.join(c)}: " + ", ".join(f"{a} -> {b}" for a, b in graph.subgraph(c).edges)
        for c in sorted(cycles(graph))
    )
    assert not shown, f"import cycles (break them: move what both sides need into a module of its own):\n{shown}"


def test_lowering_never_imports_ringpass():
    modules = module_files(ROOT)
    found = sorted(
        f"{module} imports {name}"
        for module, path in modules.items()
        if module.split(".")[0] == "lowering"
        for name, *_ in imported_names(module, path)
        if name.split(".")[0] == "ringpass"
    )
    assert not found, "lowering must not import ringpass (DESIGN.md, 'Two packages'):\n  " + "\n  ".join(found)


def test_the_graph_sees_lazy_relative_and_package_imports(tmp_path):
    """On a package made here: a cycle through an import inside a function, through ``from pkg import module``
    and through a relative import is found; a package re-exporting its submodules is no cycle by itself."""
    files = {
        "pkg/__init__.py": "from pkg.a import f\nfrom pkg import b\n",
        "pkg/a.py": "def f():\n    from pkg.c import g\n    return g()\n",
        "pkg/b.py": "import os\nfrom pkg.sub.d import h\n",
        "pkg/c.py": "from pkg import a\n",
        "pkg/sub/__init__.py": "",
        "pkg/sub/d.py": "from .. import b\nfrom . import e\n",
        "pkg/sub/e.py": "x = 1\n",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    graph = import_graph(module_files(tmp_path, ("pkg",)))
    assert set(graph.edges) == {
        ("pkg", "pkg.a"),
        ("pkg", "pkg.b"),
        ("pkg.a", "pkg.c"),
        ("pkg.c", "pkg.a"),
        ("pkg.b", "pkg.sub.d"),
        ("pkg.sub.d", "pkg.b"),
        ("pkg.sub.d", "pkg.sub.e"),
    }
    assert cycles(graph) == {("pkg.a", "pkg.c"), ("pkg.b", "pkg.sub.d")}


FRONT_ENDS = ("frontend", "inspection", "conversion", "planning", "integrations", "cli")  # README, "Where the code is"


def room(module: str, path: Path) -> str:
    """The folder of ``ringpass`` a module lives in (``fx``, ``passes``, ``frontend`` ...); ``ringpass`` for the
    package's own ``__init__`` (the public names, re-exported from every room) and ``root`` for the modules beside
    it (``options``, ``hardware``, ``version``); ``lowering`` for the runtime."""
    parts = module.split(".")
    if parts[0] == "lowering" or module == "ringpass":
        return parts[0]
    return parts[1] if path.parent != ROOT / "ringpass" else "root"


def test_passes_and_fx_import_no_front_end():
    """The passes and the FX helpers they share never know which front end called them (DESIGN.md, "One pipeline,
    three front ends"): nothing in ``ringpass/passes/`` or ``ringpass/fx/`` imports a front end's room."""
    modules = module_files(ROOT)
    graph = import_graph(modules)
    found = sorted(
        f"{a} imports {b}"
        for a, b in graph.edges
        if room(a, modules[a]) in ("passes", "fx") and room(b, modules[b]) in FRONT_ENDS
    )
    assert not found, "move what both need into ringpass/fx/:\n  " + "\n  ".join(found)


def test_the_rooms_import_each_other_one_way():
    """Between folders the imports form no cycle: each room can be read knowing only the rooms below it
    (lowering, root, fx, passes, frontend, inspection, conversion; planning, integrations, cli beside them)."""
    modules = module_files(ROOT)
    rooms = nx.DiGraph()
    for a, b in import_graph(modules).edges:
        if room(a, modules[a]) != room(b, modules[b]):
            rooms.add_edge(room(a, modules[a]), room(b, modules[b]), example=f"{a} -> {b}")
    shown = "\n".join(
        "  " + ", ".join(rooms.edges[a, b]["example"] for a, b in rooms.subgraph(c).edges) for c in cycles(rooms)
    )
    assert not shown, f"rooms importing each other back:\n{shown}"


def test_every_public_name_imports_from_its_documented_path():
    """What README and docs tell users to import: every name of ``ringpass.__all__`` from ``ringpass`` (the lazy
    ones too), the runtime's own names from ``lowering``, the ``ring`` backend through its entry point and the
    ``ringpass`` command through its own; no public function of ``ringpass`` shares its name with a module."""
    import importlib
    import importlib.metadata
    import pkgutil
    import types

    import ringpass

    for name in ringpass.__all__:
        assert getattr(importlib.import_module("ringpass"), name) is not None, name
    import lowering

    for name in ("ring_attention", "Layout", "simulate_ring"):
        assert getattr(lowering, name), name
    (ring,) = [e for e in importlib.metadata.entry_points(group="torch_dynamo_backends") if e.name == "ring"]
    assert callable(ring.load()) and ring.load().__name__ == "ring"
    (script,) = [e for e in importlib.metadata.entry_points(group="console_scripts") if e.name == "ringpass"]
    assert script.load() is importlib.import_module("ringpass.cli").main
    modules = {m.name for m in pkgutil.walk_packages(ringpass.__path__, "ringpass.")}
    functions = {f"ringpass.{n}" for n in ringpass.__all__ if isinstance(getattr(ringpass, n), types.FunctionType)}
    assert not functions & modules, f"a function hides the module of its name: {sorted(functions & modules)}"
