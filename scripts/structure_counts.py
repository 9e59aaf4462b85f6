"""Counts of how data walks through specstack, read from the source with ``ast`` (issue 58's measures).

Each count is a place where a layer knows what another should own: a drafter named by string outside the
drafter registry, a target asked with ``getattr``/``hasattr`` in the server, an event read as a dict,
an engine or policy built outside the one loader, the engine writing a ``Generation``'s attributes.
Run from the repository root::

    python scripts/structure_counts.py            # the counts
    python scripts/structure_counts.py --where    # and every place counted
"""

from __future__ import annotations

import argparse
import ast
import sys
from pathlib import Path
from typing import Iterator

PACKAGE = Path(__file__).resolve().parent.parent / "specstack"


def _modules(under: Path = PACKAGE) -> Iterator[tuple[Path, ast.Module]]:
    for path in sorted(under.rglob("*.py")):
        yield path, ast.parse(path.read_text(), str(path))


def _rel(path: Path) -> str:
    return path.relative_to(PACKAGE.parent).as_posix()


def drafter_literals() -> list[str]:
    """Registered drafter names written as string literals outside ``drafters/`` and ``loading.py``.

    ``"none"`` is left out: it is also an API word (``tool_choice``, ``reasoning_format``), so its literals
    say nothing about drafters. ``"suffix"`` is also infill's request field; those places are listed too.
    """
    sys.path.insert(0, str(PACKAGE.parent))
    from specstack.drafters import available

    names = set(available()) - {"none"}
    out = []
    for path, tree in _modules():
        rel = _rel(path)
        if rel.startswith("specstack/drafters/") or rel == "specstack/loading.py":
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in names:
                out.append(f"{rel}:{node.lineno} {node.value!r}")
    return out


def _is_target(node: ast.AST) -> bool:
    text = ast.unparse(node)
    return "target" in text or text in {"t", "model"}


def target_probes() -> list[str]:
    """``getattr``/``hasattr`` whose object is a target, in ``server/``."""
    out = []
    for path, tree in _modules(PACKAGE / "server"):
        for node in ast.walk(tree):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                    and node.func.id in {"getattr", "hasattr"} and node.args and _is_target(node.args[0])):
                out.append(f"{_rel(path)}:{node.lineno} {ast.unparse(node)}")
    return out


def event_reads() -> list[str]:
    """Events read as dicts: ``event["..."]`` (and ``ev``/``e``) subscripts with a string key."""
    out = []
    for path, tree in _modules():
        for node in ast.walk(tree):
            if (isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name)
                    and node.value.id in {"event", "ev"} and isinstance(node.slice, ast.Constant)
                    and isinstance(node.slice.value, str)):
                out.append(f"{_rel(path)}:{node.lineno} {ast.unparse(node)}")
    return out


def built_outside_loading() -> list[str]:
    """``Engine(`` and ``FixedK(`` calls outside ``loading.py`` (the one loader)."""
    out = []
    for path, tree in _modules():
        if _rel(path) == "specstack/loading.py":
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Call):
                name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
                if name in {"Engine", "FixedK"}:
                    out.append(f"{_rel(path)}:{node.lineno} {name}(")
    return out


def engine_methods() -> list[str]:
    """The methods (and properties) of ``engine.Engine``."""
    tree = ast.parse((PACKAGE / "engine.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == "Engine":
            return [f.name for f in node.body if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))]
    return []


def _generation_attributes() -> set[str]:
    tree = ast.parse((PACKAGE / "generation.py").read_text())
    attrs: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and node.name == "Generation":
            attrs.update(f.name for f in node.body if isinstance(f, ast.FunctionDef))
            for sub in ast.walk(node):
                if isinstance(sub, ast.Attribute) and isinstance(sub.value, ast.Name) and sub.value.id == "self":
                    attrs.add(sub.attr)
    return attrs


_MUTATORS = {"append", "extend", "clear", "pop", "insert", "update", "popleft", "appendleft", "remove"}


def _is_gen(node: ast.AST) -> bool:
    return isinstance(node, ast.Name) and node.id in {"gen", "g"}


def generation_writes() -> list[str]:
    """``Generation`` attributes the engine assigns, changes in place or calls when private, in ``engine.py``."""
    attrs = _generation_attributes()
    tree = ast.parse((PACKAGE / "engine.py").read_text())
    found: dict[str, int] = {}
    for node in ast.walk(tree):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
            node, (ast.AugAssign, ast.AnnAssign)) else []
        for t in [e for t in targets for e in (t.elts if isinstance(t, ast.Tuple) else [t])]:
            if isinstance(t, ast.Attribute) and _is_gen(t.value):
                found.setdefault(t.attr, node.lineno)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            owner = node.func.value
            if _is_gen(owner) and node.func.attr.startswith("_"):  # a private method: gen._emit(...)
                found.setdefault(node.func.attr, node.lineno)
            if isinstance(owner, ast.Attribute) and _is_gen(owner.value) and node.func.attr in _MUTATORS:
                found.setdefault(owner.attr, node.lineno)  # a list or dict of its changed in place
    return [f"specstack/engine.py:{line} gen.{name}" for name, line in sorted(found.items()) if name in attrs]


COUNTS = {
    "drafter names as string literals outside drafters/ and loading.py": drafter_literals,
    "getattr/hasattr on targets in server/": target_probes,
    "event[...] reads": event_reads,
    "Engine( and FixedK( outside loading.py": built_outside_loading,
    "Engine methods": engine_methods,
    "Generation attributes the engine writes": generation_writes,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--where", action="store_true", help="list every place counted")
    args = parser.parse_args()
    for label, count in COUNTS.items():
        places = count()
        print(f"{len(places):4d}  {label}")
        if args.where:
            for place in places:
                print(f"        {place}")


if __name__ == "__main__":
    main()
