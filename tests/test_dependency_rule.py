"""The dependency rule written at the top of ``mia_stream/__init__.py``, checked by walking every import.

Every ``import``/``from ... import`` in every module of the package counts, the lazy ones inside functions too:
a lazy import still makes the lower layer depend on the upper one. The rule is parsed from the package's own
docstring, so the test and the documentation cannot drift apart.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import mia_stream

PACKAGE = Path(mia_stream.__file__).parent


def _tiers() -> list[set[str]]:
    """The tiers of the rule, lowest first, read from the ``Dependency rule`` block of the package docstring."""
    doc = mia_stream.__doc__ or ""
    block = doc.split("Dependency rule", 1)[1].split("\n\n", 2)[1]
    tiers = []
    for line in block.splitlines():
        m = re.match(r"\s*tier (\d+):\s*(.+)", line)
        if m:
            tiers.append({name.strip() for name in m.group(2).split(",")})
    assert tiers, "the package docstring lost its dependency rule"
    return tiers


def _unit(module: str) -> str:
    """The unit a module belongs to: its first component under mia_stream (``bus`` for mia_stream.bus.client,
    ``errors`` for mia_stream.errors, ``root`` for mia_stream itself)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "root"


def _modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        rel = path.relative_to(PACKAGE.parent).with_suffix("")
        name = ".".join(rel.parts).removesuffix(".__init__")
        out[name] = path
    return out


def _imports(module: str, path: Path, modules: dict) -> set[str]:
    """Every mia_stream module ``module`` imports, resolved to absolute names (``from a import b`` counts a.b
    where b is a module, else a)."""
    tree = ast.parse(path.read_text(), str(path))
    is_pkg = path.name == "__init__.py"
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("mia_stream"))
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = module.split(".") if is_pkg else module.split(".")[:-1]
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            if base.startswith("mia_stream"):
                names = [f"{base}.{a.name}" for a in node.names]
                submodules = [n for n in names if n in modules]
                found.update(submodules)
                if len(submodules) < len(names):  # names defined in ``base`` itself
                    found.add(base)
    return found


def _violations() -> list[str]:
    tiers = _tiers()
    tier_of = {unit: i for i, names in enumerate(tiers) for unit in names}
    modules = _modules()
    bad = []
    for module, path in sorted(modules.items()):
        unit = _unit(module)
        assert unit in tier_of, f"{module}: its unit {unit!r} is in no tier of the dependency rule"
        for target in sorted(_imports(module, path, modules)):
            if target not in modules:
                continue  # a name imported from a module, counted through the module itself
            dep = _unit(target)
            if dep == unit:
                continue
            if dep == "producer":
                bad.append(f"{module} imports {target}: only vLLM (through the entry point) imports the producer")
            elif dep == "kernels" and unit != "producer":
                bad.append(f"{module} imports {target}: only the producer imports kernels")
            elif tier_of[dep] >= tier_of[unit]:
                bad.append(f"{module} (tier {tier_of[unit]}: {unit}) imports {target} "
                           f"(tier {tier_of[dep]}: {dep})")
    return bad


def test_every_import_in_the_package_follows_the_dependency_rule() -> None:
    assert _violations() == []


def test_the_rule_check_catches_a_wrong_way_import(tmp_path, monkeypatch) -> None:
    """A schemas module importing the bus (a wrong-way import) must be reported, and so must a sibling import
    between two units of one tier: the checker is not vacuous."""
    wrong = PACKAGE / "schemas" / "_dependency_rule_probe.py"
    sibling = PACKAGE / "broker" / "_dependency_rule_probe.py"
    try:
        wrong.write_text("def f():\n    from mia_stream.bus import transport\n")
        sibling.write_text("from mia_stream.consumers import open_stream\n")
        found = _violations()
    finally:
        wrong.unlink(missing_ok=True)
        sibling.unlink(missing_ok=True)
    assert any(v.startswith("mia_stream.schemas._dependency_rule_probe ") and "mia_stream.bus" in v for v in found)
    assert any(v.startswith("mia_stream.broker._dependency_rule_probe ") and "consumers" in v for v in found)
