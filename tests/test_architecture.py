"""The package's shape, checked from its source (docs/ARCHITECTURE.md): no import cycles, no reaching
into another module's private names, no doubly-jitted functions, files of a readable size.

The layers themselves are an import-linter contract in pyproject.toml (`lint-imports`, run by
`make lint` and CI); the cycle check here is written independently of that tool, from the
definition: a cycle is a strongly connected component of more than one module in the graph of
``import`` statements (module level or inside functions, as both execute).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "morse_jax"
MAX_LINES = 400
# A longer file states why in its module docstring with this phrase.
LONG_FILE_REASON = "longer than 400 lines because"


def _modules() -> dict[str, Path]:
    mods = {}
    for p in sorted(PACKAGE.rglob("*.py")):
        parts = p.relative_to(ROOT).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        mods[name] = p
    return mods


MODULES = _modules()


def _imported_modules(name: str, path: Path) -> set[str]:
    """Modules of this package that ``name`` imports (``from a import b`` counts ``a.b`` when it is a module)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            targets = [f"{mod}.{a.name}" if f"{mod}.{a.name}" in MODULES else mod for a in node.names]
        else:
            continue
        for t in targets:
            while t and t not in MODULES:  # a name inside a module -> that module
                t = t.rpartition(".")[0]
            if t and t != name:
                found.add(t)
    return found


def _strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's algorithm; components of size > 1 are import cycles."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_cycle_finder_finds_a_cycle():
    assert _strongly_connected({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _strongly_connected({"a": {"b"}, "b": set()}) == []


def test_no_import_cycles_between_modules():
    graph = {name: _imported_modules(name, path) for name, path in MODULES.items()}
    # A package's __init__ importing its own submodules is how packages re-export; a submodule
    # importing its package __init__ back would be the cycle, and that edge is kept.
    for name in graph:
        if MODULES[name].name == "__init__.py":
            graph[name] = {m for m in graph[name] if not m.startswith(name + ".")}
    assert _strongly_connected(graph) == []


def test_no_module_imports_another_modules_private_names():
    offenders = []
    for name, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("morse_jax"):
                offenders += [f"{name}: from {node.module} import {a.name}" for a in node.names
                              if a.name.startswith("_") and not a.name.startswith("__")]
    assert offenders == []


# Attributes that start with "_" by the owner's own convention and are public API there.
_PUBLIC_UNDERSCORE = {"_replace", "_asdict", "_fields", "_make", "_exit", "_getframe"}


def test_no_access_to_private_attributes_of_other_objects():
    """``x._y`` only on ``self``/``cls`` (a class's own state), never on another object or module."""
    offenders = []
    for name, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if (isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")
                    and node.attr not in _PUBLIC_UNDERSCORE
                    and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))):
                offenders.append(f"{name}:{node.lineno}: .{node.attr}")
    assert offenders == []


_JIT = re.compile(r"^(jax\.)?jit$|^(jax\.)?jit\(|partial\((jax\.)?jit\b")


def _is_jit(decorator: ast.expr) -> bool:
    """``@jax.jit``, ``@jit``, ``@jax.jit(...)``, ``@functools.partial(jax.jit, ...)``."""
    return bool(_JIT.search(ast.unparse(decorator)))


def test_jit_decorator_recognised():
    parse = lambda s: ast.parse(s).body[0].decorator_list  # noqa: E731
    src = "@jax.jit\n@functools.partial(jax.jit, static_argnames='n')\n@jit_cache\ndef f(): pass"
    assert [_is_jit(d) for d in parse(src)] == [True, True, False]


def test_no_function_is_jitted_twice_by_decorators():
    offenders = []
    for name, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                if sum(_is_jit(d) for d in node.decorator_list) > 1:
                    offenders.append(f"{name}.{node.name}")
    assert offenders == []


@pytest.mark.parametrize("name", sorted(MODULES))
def test_file_is_readable_length_or_says_why(name):
    path = MODULES[name]
    text = path.read_text(encoding="utf-8")
    n = text.count("\n")
    if n <= MAX_LINES:
        return
    doc = ast.get_docstring(ast.parse(text)) or ""
    assert LONG_FILE_REASON in doc.lower(), (
        f"{path.relative_to(ROOT)} has {n} lines; split it by concept or say in its module docstring "
        f"'{LONG_FILE_REASON} ...'")
