"""The package's shape: no import cycles among moebit's modules, imports at module top."""

from __future__ import annotations

import ast
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


def _top_level_imports(path: Path, modules: dict[str, Path], self_name: str) -> set[str]:
    """moebit modules imported when ``path`` is imported (module level, not under a def)."""
    tree = ast.parse(path.read_text())
    found: set[str] = set()
    for node in tree.body:
        for sub in ast.walk(node) if not isinstance(node, (ast.FunctionDef, ast.ClassDef)) else ():
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
