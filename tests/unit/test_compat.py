"""`lowering.compat` holds every private torch / transformers name ringpass uses, and nothing else reaches one.

Two kinds of test. (1) Each name compat lists resolves on the installed torch (a module path, a module attribute,
or an attribute of a sample object compat names), and a name that does not resolve raises `TorchInternalMoved`
saying which name, why ringpass needs it and which versions are tested. (2) A walk of the source of `ringpass` and
`lowering` finds no private upstream name outside `lowering/compat.py`: no import from a module path with a
``_part`` (``torch._dynamo``, ``torch.utils._pytree``) or of a ``_name``, no attribute chain from ``torch`` /
``transformers`` through a ``_part``, no dotted private module path as a string, and no ``obj._name`` attribute
that ringpass does not define itself (``_schema``, ``_base``, ``_from_config`` ...). ATen operators named with an
underscore (``aten._softmax``) are the IR's operator set, not Python-private names: the operator tests cover them.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from lowering import compat

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("ringpass", "lowering")
COMPAT = ROOT / "lowering" / "compat.py"
UPSTREAM = ("torch", "transformers")
STDLIB_PRIVATE = {"_getframe", "_exit", "_replace", "_fields", "_asdict", "_make"}  # sys, os, namedtuple
ACCESSORS = ("getattr", "hasattr", "setattr", "delattr")
PRIVATE_PATH = re.compile(r"(torch|transformers)(\.\w+)*\._\w+(\.\w+)*")


def _private(part: str) -> bool:
    return part.startswith("_") and not (part.startswith("__") and part.endswith("__"))


def _sources() -> list[Path]:
    return [p for package in PACKAGES for p in sorted((ROOT / package).rglob("*.py")) if p != COMPAT]


def _own_private_names(trees: dict[Path, ast.AST]) -> set[str]:
    """Every ``_name`` ringpass defines: functions, classes, names, arguments, and attributes of ``self`` / ``cls``
    (an attribute ringpass sets on another object is its own only when so named: ``_ringpass_...``)."""
    names = set()
    for tree in trees.values():
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                names.add(node.name)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
            elif isinstance(node, ast.Attribute) and getattr(node.value, "id", None) in ("self", "cls"):
                names.add(node.attr)
            elif isinstance(node, ast.arg):
                names.add(node.arg)
            elif isinstance(node, ast.alias) and node.asname:
                names.add(node.asname)
    return {name for name in names if _private(name)}


def _foreign(name: object, own: set[str]) -> bool:
    """A private attribute name ringpass did not define (sys / os / namedtuple's own are public)."""
    return (
        isinstance(name, str)
        and _private(name)
        and name not in own
        and name not in STDLIB_PRIVATE
        and not name.startswith("_ringpass")
    )


def _upstream_aliases(tree: ast.AST) -> set[str]:
    """Local names bound to a torch / transformers module or object: ``torch``, ``F``, ``dist``, ``nn`` ..."""
    aliases = set(UPSTREAM)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            aliases |= {(a.asname or a.name).split(".")[0] for a in node.names if a.name.split(".")[0] in UPSTREAM}
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in UPSTREAM:
            aliases |= {a.asname or a.name for a in node.names}
    return aliases


def _chain(node: ast.Attribute) -> list[str] | None:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    return [node.id, *reversed(parts)] if isinstance(node, ast.Name) else None


def private_uses(paths: list[Path]) -> list[str]:
    """``file:line: what`` for each private upstream name used outside compat."""
    trees = {path: ast.parse(path.read_text(), str(path)) for path in paths}
    own = _own_private_names(trees) | {n for n in dir(compat) if _private(n)}
    found = []
    for path, tree in trees.items():
        aliases = _upstream_aliases(tree)
        where = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path.name
        inner = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
        for node in ast.walk(tree):
            what = None
            if isinstance(node, ast.Import):
                what = next((f"import {a.name}" for a in node.names if any(map(_private, a.name.split(".")))), None)
            elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in UPSTREAM:
                module = node.module
                if any(map(_private, module.split("."))) or any(_private(a.name) for a in node.names):
                    what = f"from {module} import {', '.join(a.name for a in node.names)}"
            elif isinstance(node, ast.Attribute) and id(node) not in inner:
                chain = _chain(node) or [node.attr]
                if "aten" in chain:  # the ATen operator set (aten._softmax): public operators
                    continue
                if (
                    chain[0] in aliases
                    and any(map(_private, chain[1:]))
                    or any(_foreign(part, own) for part in chain[1:] or chain)
                ):
                    what = ".".join(chain)
            elif isinstance(node, ast.Call) and getattr(node.func, "id", None) in ACCESSORS and len(node.args) > 1:
                name = node.args[1].value if isinstance(node.args[1], ast.Constant) else None
                if _foreign(name, own):
                    what = f"{node.func.id}(..., {name!r})"
            elif isinstance(node, ast.Constant) and isinstance(node.value, str) and PRIVATE_PATH.fullmatch(node.value):
                what = repr(node.value)
            if what:
                found.append(f"{where}:{node.lineno}: {what}")
    return sorted(set(found))


def test_no_private_upstream_name_outside_compat():
    uses = private_uses(_sources())
    assert not uses, "private torch / transformers names outside lowering/compat.py:\n" + "\n".join(uses)


def test_the_walk_finds_each_kind_of_private_use(tmp_path):
    """The walk above would catch each way a private name gets in (so its silence means something)."""
    source = tmp_path / "mod.py"
    source.write_text(
        "import torch\nimport torch._dynamo\nimport torch.nn.functional as F\nfrom torch._guards import Source\n"
        "from torch.distributed.distributed_c10d import _get_default_store\n"
        "def f(op, x):\n"
        "    torch._dynamo.reset()\n    F._canonical_mask(x)\n    torch.ops.aten._softmax(x, 0, False)\n"
        "    self._mine = 1\n    return op._schema, x._base, self._mine, 'torch._dynamo.backends.distributed'\n"
    )
    uses = private_uses([source])
    expected = [
        "import torch._dynamo",
        "from torch._guards import Source",
        "_get_default_store",
        "torch._dynamo.reset",
        "F._canonical_mask",
        "._schema",
        "._base",
        "'torch._dynamo.backends.distributed'",
    ]
    for what in expected:
        assert any(what in use for use in uses), (what, uses)
    assert not any("_softmax" in use or "_mine" in use for use in uses), uses


@pytest.mark.parametrize("name", sorted(compat.SYMBOLS))
def test_every_private_name_resolves_on_this_torch(name):
    symbol = compat.SYMBOLS[name]
    assert symbol.why, name
    value = compat.resolve(name)
    assert value is not None or symbol.may_be_none, name


def test_a_moved_name_is_a_clear_error(monkeypatch):
    moved = compat.Private("torch._dynamo.source.NoSuchSource", "names an input's origin for AOTAutograd")
    monkeypatch.setitem(compat.SYMBOLS, "NoSuchSource", moved)
    with pytest.raises(compat.TorchInternalMoved) as raised:
        compat.resolve("NoSuchSource")
    message = str(raised.value)
    assert "torch._dynamo.source.NoSuchSource" in message and "names an input's origin" in message
    assert f"torch {compat.installed_version('torch')}" in message and compat.TESTED_TORCH in message


def test_a_moved_attribute_of_instances_is_a_clear_error(monkeypatch):
    moved = compat.Private("torch._ops.OpOverload._no_such", "reads an op's schema", sample=compat.SAMPLES["op"])
    monkeypatch.setitem(compat.SYMBOLS, "op_no_such", moved)
    with pytest.raises(compat.TorchInternalMoved, match="OpOverload._no_such"):
        compat.resolve("op_no_such")


def _tested(versions: str) -> list[tuple[int, ...]]:
    """``"2.13.0, 2.14.1 and 2.15.0"`` as version tuples."""
    return [tuple(int(n) for n in v.split(".")) for v in re.split(r",\s*|\s+and\s+", versions)]


def test_the_declared_ranges_and_the_readme_say_what_was_tested():
    """pyproject's torch range and its ``hf`` extra's transformers range run from the oldest tested release's
    minor version to below the minor after the newest's, and README's 'Tested versions' table names each."""
    tomllib = pytest.importorskip("tomllib")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    readme = (ROOT / "README.md").read_text().split("## Tested versions", 1)[1].split("\n## ", 1)[0]
    declared = {
        "torch": next(d for d in project["dependencies"] if d.startswith("torch")),
        "transformers": next(d for d in project["optional-dependencies"]["hf"] if d.startswith("transformers")),
    }
    for library, tested in (("torch", compat.TESTED_TORCH), ("transformers", compat.TESTED_TRANSFORMERS)):
        versions = sorted(_tested(tested))
        (oldest_major, oldest_minor, _), (newest_major, newest_minor, _) = versions[0], versions[-1]
        expected = f"{library}>={oldest_major}.{oldest_minor},<{newest_major}.{newest_minor + 1}"
        assert declared[library] == expected, (declared[library], tested)
        for version in versions:
            assert ".".join(map(str, version)) in readme, (library, version)
