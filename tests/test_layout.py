"""The package's shape: no import cycles among moebit's modules, imports at module top."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import moebit

SRC = Path(moebit.__file__).parent


def _modules() -> dict[str, Path]:
    out = {}
    for p in SRC.rglob("*.py"):
        rel = p.relative_to(SRC.parent).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = p
    return out


def _target(name: str, modules: dict[str, Path]) -> str | None:
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def _imports_in(nodes: list[ast.AST], modules: dict[str, Path], self_name: str) -> set[str]:
    """The moebit modules the import statements in (and under) ``nodes`` name."""
    found: set[str] = set()
    for node in nodes:
        for sub in ast.walk(node):
            if isinstance(sub, ast.Import):
                names = [a.name for a in sub.names]
            elif isinstance(sub, ast.ImportFrom) and sub.module and sub.level == 0:
                names = [f"{sub.module}.{a.name}" for a in sub.names]
            else:
                continue
            for n in names:
                t = _target(n, modules) if n.startswith("moebit") else None
                if t and t != self_name:
                    found.add(t)
    return found


def _top_level_imports(path: Path, modules: dict[str, Path], self_name: str) -> set[str]:
    """moebit modules imported when ``path`` is imported (module level, not under a def)."""
    body = [n for n in ast.parse(path.read_text()).body
            if not isinstance(n, (ast.FunctionDef, ast.ClassDef))]
    return _imports_in(body, modules, self_name)


def test_no_import_cycles():
    modules = _modules()
    graph = {m: _top_level_imports(p, modules, m) for m, p in modules.items()}
    state: dict[str, int] = {}  # 1: on the stack, 2: done
    stack: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                cycle = stack[stack.index(n):] + [n]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if n not in state:
                visit(n)
        stack.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)


# The declared order of moebit's packages, lowest first. A package may import packages of
# lower layers only; packages of one layer do not import each other. docs/architecture.md
# states the same order (checked below).
LAYERS: list[tuple[str, ...]] = [
    ("testing", "comm"),
    ("moe", "optim"),
    ("checkpoint",),
    ("runs",),
    ("models",),
    ("inference",),
    ("training",),
    ("distill", "upcycle", "hf"),
    ("serve",),
    ("bench",),
    ("plan",),
    ("cli",),
]


def _package(module: str) -> str:
    """``moebit.training.loop`` -> ``training``; the package's face (``moebit``) -> ``""``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def _all_imports(path: Path, modules: dict[str, Path], self_name: str) -> set[str]:
    """Every moebit module ``path`` imports, at module level or inside a function."""
    return _imports_in([ast.parse(path.read_text())], modules, self_name)


def layer_violations(graph: dict[str, set[str]], layers: list[tuple[str, ...]]) -> list[str]:
    """'a imports b' for every import of a package at the same or a higher layer."""
    rank = {pkg: i for i, layer in enumerate(layers) for pkg in layer}
    out = []
    for m, deps in sorted(graph.items()):
        a = _package(m)
        if not a:
            continue  # the package's face may re-export anything
        for n in sorted(deps):
            b = _package(n)
            if b and b != a and rank[b] >= rank[a]:
                out.append(f"{m} ({a}, layer {rank[a]}) imports {n} ({b}, layer {rank[b]})")
    return out


def test_every_package_has_a_layer():
    packages = {_package(m) for m in _modules()} - {""}
    declared = {p for layer in LAYERS for p in layer}
    assert packages == declared, (f"undeclared: {sorted(packages - declared)}, "
                                  f"gone: {sorted(declared - packages)}")


def test_no_package_imports_one_above_it():
    modules = _modules()
    graph = {m: _all_imports(p, modules, m) for m, p in modules.items()}
    assert layer_violations(graph, LAYERS) == []


def test_an_injected_violation_is_caught():
    """The checker itself: a library package reaching up into the CLI, and two packages of
    one layer importing each other, are both reported."""
    graph = {"moebit.comm.collectives": {"moebit.cli.launch"},
             "moebit.moe.layer": {"moebit.optim.base", "moebit.comm.stats"},
             "moebit.cli.train": {"moebit.training.loop"}}
    found = layer_violations(graph, LAYERS)
    assert len(found) == 2 and "moebit.comm.collectives" in found[0] and "moebit.moe.layer" in found[1]


def test_the_top_level_holds_only_the_face():
    """Only ``__init__`` (the public API) and ``testing`` sit outside a package."""
    loose = sorted(p.name for p in SRC.glob("*.py"))
    assert loose == ["__init__.py", "testing.py"], loose


def test_architecture_doc_states_the_order_and_existing_paths():
    doc = (SRC.parent.parent / "docs" / "architecture.md").read_text()
    line = next(x for x in doc.splitlines() if x.startswith("Layers, lowest first:"))
    stated = [tuple(p.strip(" `") for p in part.split(",")) for part in
              line.removeprefix("Layers, lowest first:").strip().rstrip(".").split("<")]
    assert stated == LAYERS, line
    for path in re.findall(r"`((?:[a-z_]+/)+[a-z_]*(?:\.py)?)`", doc):
        where = [SRC / path, SRC.parent.parent / path]  # a package path, or the repository's
        assert any(w.exists() for w in where), f"docs/architecture.md names {path}, which does not exist"
    for row in re.findall(r"^\| `([a-z_]+)/` \|(.*)$", doc, flags=re.M):  # the package table
        pkg, text = row
        for name in re.findall(r"`([a-z_]+\.py)`", text):
            assert list((SRC / pkg).rglob(name)), f"docs/architecture.md: {pkg}/ has no {name}"


def test_lower_layers_import_nothing_above_them():
    """comm/, moe/ and optim/ are libraries: they never reach up into models, the loop or the CLI."""
    modules = _modules()
    layers = {"moebit.comm": {"moebit.comm"},
              "moebit.moe": {"moebit.comm", "moebit.moe"},
              "moebit.optim": {"moebit.comm", "moebit.optim"}}
    for m, p in modules.items():
        for layer, allowed in layers.items():
            if m == layer or m.startswith(layer + "."):
                for n in _top_level_imports(p, modules, m):
                    assert any(n == a or n.startswith(a + ".") for a in allowed), f"{m} imports {n}"


def test_files_and_functions_stay_small():
    """No module above about 450 lines and no function above about 100: a newcomer reads
    one job per file, and the loop reads as its named phases."""
    big_files, big_funcs = [], []
    for p in SRC.rglob("*.py"):
        text = p.read_text()
        if text.count("\n") > 460:
            big_files.append(f"{p.relative_to(SRC)}: {text.count(chr(10))} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1  # type: ignore[operator]
                if n > 100:
                    big_funcs.append(f"{p.relative_to(SRC)}:{node.lineno} {node.name}: {n} lines")
    assert not big_files and not big_funcs, big_files + big_funcs
