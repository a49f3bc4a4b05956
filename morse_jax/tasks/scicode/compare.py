"""SciCode tests split in two: values computed in the sandbox, comparisons made here.

A SciCode test is a script whose asserts compare values computed by the step's function with
``target`` (``np.allclose(f(x), target)``, ``cmp_tuple_or_list(...)``, ``(a, b) == target`` ...).
:func:`split_test` rewrites each assert into

* a **sandbox half**: ``__record__(i, leaf_0, leaf_1, ...)``, where the leaves are the assert's
  sub-expressions that compute values (calls of the candidate's functions, arithmetic ...), and
* a **trusted half**: the assert's *skeleton* (``and`` / ``or`` / ``not``, comparisons, tuple and
  list displays, constants, ``target`` / ``target[k]``, ``.any()`` / ``.all()``, calls of
  ``np.allclose`` / ``isclose`` / ``array_equal`` / ``array_equiv`` / ``all`` / ``any``, SciCode's
  comparison helpers, and functions the test itself defines when called on ``target``),
  compiled once and evaluated in this process on the decoded leaves with trusted numpy.

:func:`check_test` decides a test from the sandbox's :class:`~morse_jax.tasks.sandbox.record.CaseRecord`:
it passes when the test ran to its end in the sandbox, every recorded assert holds here, and
every assert that reads ``target`` ran at least once (a candidate cannot pass by making an
assert in a loop never run; the ground truth runs every such assert on all 50 development steps).
:func:`recorded_target` rebuilds a target from a ground-truth run: the value each
``cmp(expr, target[k])`` compares with.

Semantics kept from SciCode: the helpers below are SciCode's (``np.allclose`` defaults, dict /
sparse / bool rules); tests still run in order in one namespace in the sandbox. Differences: a
failed assert no longer stops its test inside the sandbox (the test fails here instead), and
all leaves of an assert are computed even where ``and`` / ``or`` would short-circuit.
"""

from __future__ import annotations

import ast
import builtins
import dataclasses
import functools
import re
import types
from typing import Any

from morse_jax.tasks.sandbox.record import CaseRecord

# SciCode's comparison helpers (scicode/compare/cmp.py semantics). Trusted code: evaluated in
# this process for the comparisons, and also given to the tests' namespace in the sandbox for
# tests that call them outside an assert.
HELPERS_SOURCE = r'''
import sys as _sys
import numpy as _np

# scipy.sparse / sympy are looked up, not imported: a sparse matrix or a Symbol can only exist
# once its module is loaded, and importing them costs every run (sympy alone ~0.5 s).
def _sparse():
    return _sys.modules.get("scipy.sparse")

def _dense(m):
    sps = _sparse()
    return m.toarray() if sps is not None and sps.issparse(m) else m

def _sym(v):
    sympy = _sys.modules.get("sympy")
    return str(v) if sympy is not None and isinstance(v, sympy.Symbol) else v

def are_dicts_close(d1, d2, atol=1e-8, rtol=1e-5):
    d1 = {_sym(k): _sym(v) for k, v in d1.items()}
    d2 = {_sym(k): _sym(v) for k, v in d2.items()}
    if d1.keys() != d2.keys():
        return False
    for k, v1 in d1.items():
        v2 = d2[k]
        if isinstance(v1, str):
            if v1 != v2:
                return False
            continue
        v1, v2 = _dense(v1), _dense(v2)
        try:
            if not _np.allclose(v1, v2, atol=atol, rtol=rtol):
                return False
        except ValueError:
            if not v1 == v2:
                return False
    return True

def are_csc_matrix_close(m1, m2):
    return _np.allclose(_dense(m1), _dense(m2))

def cmp_tuple_or_list(a, b):
    if len(a) != len(b):
        return False
    for v1, v2 in zip(a, b):
        if isinstance(v1, dict):
            ok = are_dicts_close(v1, v2)
        elif _sparse() is not None and _sparse().issparse(v1):
            ok = are_csc_matrix_close(v1, v2)
        elif isinstance(v1, bool):
            ok = v1 == v2
        else:
            try:
                ok = _np.allclose(v1, v2)
            except ValueError:
                ok = v1 == v2
        if not ok:
            return False
    return True
'''
_SCICODE_IMPORT = re.compile(r"^([ \t]*)(from[ \t]+scicode[\w.]*[ \t]+import[^\n]*|import[ \t]+scicode[^\n]*)$",
                             re.MULTILINE)


def strip_scicode_imports(code: str) -> str:
    """``code`` with each import of the ``scicode`` package replaced by ``pass``: the harness
    defines SciCode's comparison helpers itself, so the package need not be importable."""
    return _SCICODE_IMPORT.sub(lambda m: m.group(1) + "pass", code)


HELPER_NAMES = ("are_dicts_close", "are_csc_matrix_close", "cmp_tuple_or_list")
NUMPY_COMPARISONS = ("allclose", "isclose", "array_equal", "array_equiv", "all", "any")
_NUMPY_NAMES = ("np", "numpy")


class TestRewriteError(ValueError):
    """A test reads ``target`` in a way that cannot be evaluated outside the sandbox."""


@dataclasses.dataclass(frozen=True)
class _Assert:
    line: int
    n_leaves: int
    skeleton: types.CodeType  # evaluates the assert's condition from __leaf__ and __target__
    reads_target: bool
    sites: tuple[tuple[int | None, types.CodeType], ...] | None  # None: target not inferable


@dataclasses.dataclass(frozen=True)
class SplitTest:
    """One test, split: ``sandbox_code`` runs in the sandbox; the rest stays here."""

    sandbox_code: str
    asserts: tuple[_Assert, ...]
    comparators: str  # source of the test's own top-level functions, when a skeleton calls one

    @property
    def reads_target(self) -> bool:
        return any(a.reads_target for a in self.asserts)


def _is_target(node: ast.AST) -> tuple[bool, int | None]:
    if isinstance(node, ast.Name) and node.id == "target":
        return True, None
    if (isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name) and node.value.id == "target"
            and isinstance(node.slice, ast.Constant) and type(node.slice.value) is int):
        return True, node.slice.value
    return False, None


def _reads_target(node: ast.AST) -> bool:
    return any(isinstance(x, ast.Name) and x.id == "target" for x in ast.walk(node))


def _numpy_function(func: ast.expr) -> str | None:
    if (isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name)
            and func.value.id in _NUMPY_NAMES and func.attr in NUMPY_COMPARISONS):
        return func.attr
    return None


class _Splitter:
    """Converts one assert condition into its skeleton, collecting the leaves."""

    def __init__(self, own_functions: frozenset[str], where: str):
        self.own, self.where = own_functions, where
        self.leaves: list[ast.expr] = []
        self.converted: dict[int, ast.expr] = {}
        self.uses_own = False

    def convert(self, node: ast.expr) -> ast.expr:
        new = self._convert(node)
        self.converted[id(node)] = new
        return new

    def _plain_call(self, node: ast.Call) -> bool:
        return not any(isinstance(a, ast.Starred) for a in node.args) and all(k.arg for k in node.keywords)

    def _convert(self, node: ast.expr) -> ast.expr:
        is_t, key = _is_target(node)
        if is_t:
            t = ast.Name("__target__", ast.Load())
            return t if key is None else ast.Subscript(t, ast.Constant(key), ast.Load())
        if isinstance(node, ast.Constant):
            return ast.Constant(node.value)
        if isinstance(node, ast.BoolOp):
            return ast.BoolOp(node.op, [self.convert(v) for v in node.values])
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
            return ast.UnaryOp(ast.Not(), self.convert(node.operand))
        if isinstance(node, ast.Compare):
            return ast.Compare(self.convert(node.left), node.ops, [self.convert(c) for c in node.comparators])
        if isinstance(node, (ast.Tuple, ast.List)) and not any(isinstance(e, ast.Starred) for e in node.elts):
            return type(node)([self.convert(e) for e in node.elts], ast.Load())
        if isinstance(node, ast.Call) and self._plain_call(node):
            func = None
            np_name = _numpy_function(node.func)
            if np_name is not None:
                func = ast.Attribute(ast.Name("__np__", ast.Load()), np_name, ast.Load())
            elif isinstance(node.func, ast.Name) and node.func.id in HELPER_NAMES:
                func = ast.Name(node.func.id, ast.Load())
            elif isinstance(node.func, ast.Name) and node.func.id in self.own and _reads_target(node):
                func = ast.Name(node.func.id, ast.Load())
                self.uses_own = True
            elif (isinstance(node.func, ast.Attribute) and node.func.attr in ("any", "all")
                  and not node.args and not node.keywords):
                return ast.Call(ast.Attribute(self.convert(node.func.value), node.func.attr, ast.Load()), [], [])
            if func is not None:
                return ast.Call(func, [self.convert(a) for a in node.args],
                                [ast.keyword(k.arg, self.convert(k.value)) for k in node.keywords])
        if _reads_target(node):
            raise TestRewriteError(f"{self.where}: `{ast.unparse(node)[:120]}` reads `target` in a way "
                                   "that cannot be evaluated outside the sandbox")
        self.leaves.append(node)
        return ast.Subscript(ast.Name("__leaf__", ast.Load()), ast.Constant(len(self.leaves) - 1), ast.Load())

    def sites(self, test: ast.expr, n_refs: int) -> tuple[tuple[int | None, types.CodeType], ...] | None:
        """(key, code of the value compared with target[key]) per comparison, or None."""
        out = []
        for sub in ast.walk(test):
            pair = None
            if isinstance(sub, ast.Call) and not sub.keywords and len(sub.args) == 2:
                pair = sub.args
            elif isinstance(sub, ast.Compare) and len(sub.ops) == 1 and isinstance(sub.ops[0], ast.Eq):
                pair = [sub.left, sub.comparators[0]]
            if pair:
                keys = [_is_target(x) for x in pair]
                if keys[0][0] != keys[1][0]:
                    i = 0 if keys[0][0] else 1
                    other = self.converted.get(id(pair[1 - i]))
                    if other is None or _reads_target(pair[1 - i]):
                        return None
                    out.append((keys[i][1], _compile_expr(other, self.where)))
        return tuple(out) if len(out) == n_refs else None


def _compile_expr(node: ast.expr, where: str) -> types.CodeType:
    tree = ast.fix_missing_locations(ast.Expression(node))
    return compile(tree, f"<{where}: trusted comparison>", "eval")


def _own_functions(tree: ast.Module) -> tuple[frozenset[str], str]:
    """Top-level functions of the test that are safe to define here (no decorators, constant
    defaults): candidates for comparators such as ``are_equivalent(x, target)``."""
    defs = []
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and not node.decorator_list and all(
                isinstance(d, ast.Constant) for d in node.args.defaults + [
                    d for d in node.args.kw_defaults if d is not None]):
            defs.append(node)
    return frozenset(d.name for d in defs), "\n\n".join(ast.unparse(d) for d in defs)


@functools.lru_cache(maxsize=4096)
def split_test(code: str, where: str) -> SplitTest:
    """Split a SciCode test (see the module docstring). Raises :class:`TestRewriteError` when
    ``target`` is read outside an assert or inside a value computation."""

    tree = ast.parse(strip_scicode_imports(code))
    own, own_source = _own_functions(tree)
    asserts: list[_Assert] = []
    uses_own = False

    class _Rewrite(ast.NodeTransformer):
        def visit_Assert(self, node: ast.Assert):
            nonlocal uses_own
            sp = _Splitter(own, f"{where} line {node.lineno}")
            skeleton = sp.convert(node.test)
            uses_own |= sp.uses_own
            n_refs = sum(isinstance(x, ast.Name) and x.id == "target" for x in ast.walk(node.test))
            asserts.append(_Assert(node.lineno, len(sp.leaves), _compile_expr(skeleton, where), n_refs > 0,
                                   sp.sites(node.test, n_refs) if n_refs else ()))
            call = ast.Call(ast.Name("__record__", ast.Load()), [ast.Constant(len(asserts) - 1), *sp.leaves], [])
            return ast.copy_location(ast.Expr(call), node)

    tree = ast.fix_missing_locations(_Rewrite().visit(tree))
    if _reads_target(tree):
        raise TestRewriteError(f"{where}: reads `target` outside an assert")
    return SplitTest(ast.unparse(tree), tuple(asserts), own_source if uses_own else "")


@functools.lru_cache(maxsize=1)
def _helpers() -> dict[str, Any]:
    space: dict[str, Any] = {"__name__": "morse_jax_scicode_helpers"}
    exec(compile(HELPERS_SOURCE, "<scicode helpers>", "exec"), space)  # trusted constant source
    return {name: space[name] for name in HELPER_NAMES}


@functools.lru_cache(maxsize=256)
def _comparators(source: str) -> dict[str, Any]:
    import numpy as np

    space: dict[str, Any] = {"__builtins__": builtins, "np": np, "numpy": np, **_helpers()}
    if source:
        exec(compile(source, "<scicode test comparators>", "exec"), space)  # data-set code, defs only
    return space


def _evaluate(split: SplitTest, code: types.CodeType, leaves: tuple, target: Any) -> Any:
    import numpy as np

    env = dict(_comparators(split.comparators))
    # Real builtins: numpy's C methods import lazily through the calling frame's __import__
    # (ndarray.any). The skeleton itself names no builtin: every other name became a leaf.
    env.update(__builtins__=builtins, __np__=np, __leaf__=leaves, __target__=target)
    return eval(code, env)  # noqa: S307 -- compiled from the data set's assert, on decoded data


def check_test(split: SplitTest, case: CaseRecord, target: Any) -> str:
    """"" when the test passes on the recorded values, else why (for logs, never prompts)."""
    if case.error:
        return case.error
    ran = set()
    for site, leaves in case.events:
        if type(site) is not int or not 0 <= site < len(split.asserts) \
                or len(leaves) != split.asserts[site].n_leaves:
            return "malformed recorded event"
        a = split.asserts[site]
        try:
            ok = bool(_evaluate(split, a.skeleton, leaves, target))
        except Exception as e:  # noqa: BLE001 -- as an exception inside the assert: the test fails
            return f"assert at line {a.line}: {type(e).__name__}: {str(e)[:300]}"
        if not ok:
            return f"assert at line {a.line} failed"
        ran.add(site)
    for i, a in enumerate(split.asserts):
        if a.reads_target and i not in ran:
            return f"assert at line {a.line} never ran"
    return ""


def recorded_target(split: SplitTest, case: CaseRecord, where: str) -> Any:
    """The target a ground-truth run implies: the value each ``cmp(expr, target[k])`` compared
    (last run of each assert); a tuple when the test reads ``target[0]``, ``target[1]`` ...
    Raises TestRewriteError when it cannot be inferred."""
    last = {site: leaves for site, leaves in case.events}
    found: dict[int | None, Any] = {}
    for i, a in enumerate(split.asserts):
        if not a.reads_target:
            continue
        if a.sites is None:
            raise TestRewriteError(f"{where}: cannot infer the target from the assert at line {a.line}")
        if i not in last:
            raise TestRewriteError(f"{where}: the ground truth never ran the assert at line {a.line}")
        for key, code in a.sites:
            found[key] = _evaluate(split, code, last[i], None)
    if not found:
        return None
    if None in found:
        if len(found) > 1:
            raise TestRewriteError(f"{where}: compares both `target` and `target[k]`")
        return found[None]
    if sorted(found) != list(range(len(found))):
        raise TestRewriteError(f"{where}: target indices {sorted(found)} are not 0..n-1")
    return tuple(found[i] for i in range(len(found)))
