"""SciCode code handling: code from a model reply, the gate g_i, assembling programs.

Split out of :mod:`morse_jax.tasks.scicode.family`, which re-exports every public name defined here.
Pure text/AST functions: nothing here runs code.

* A SciCode artifact is the program so far: the upstream code, a marker line, then this step's
  code (:func:`join_program` / :func:`split_program`). Artifacts are cumulative because the
  orchestrator hands a node only its parents' artifacts, while a step may call any earlier
  step's function.
* The gate (:func:`check_gate`) is a static rule check (parses, defines the header's function
  with its parameters, has a body); its diagnostic is the only feedback for regeneration.
"""

from __future__ import annotations

import ast
import re

from morse_jax.tasks.scicode.data import Problem, SciCodeDataError, header_def

_FENCE = re.compile(r"```[ \t]*([A-Za-z0-9_+-]*)[^\n]*\n(.*?)```", re.DOTALL)
_PY_TAGS = ("", "python", "py", "python3")


def extract_code(completion: str, function_name: str | None = None) -> str:
    """Python code from a model reply: its fenced blocks, an unclosed fence, or the whole text."""
    blocks = [b for tag, b in _FENCE.findall(completion) if tag.lower() in _PY_TAGS]
    if not blocks:
        opened = re.search(r"```[ \t]*(?:python3?|py)?[ \t]*\n", completion)
        return (completion[opened.end():] if opened else completion).strip("\n")
    joined = "\n\n".join(b.strip("\n") for b in blocks)
    if function_name is None or len(blocks) == 1 or _defines(joined, function_name):
        return joined
    for b in blocks:  # the joined blocks do not parse; keep the block that defines the function
        if _defines(b, function_name):
            return b.strip("\n")
    return joined


def _defines(code: str, name: str) -> bool:
    try:
        tree = ast.parse(code)
    except (SyntaxError, ValueError):
        return False
    return any(getattr(n, "name", None) == name for n in tree.body)


def _params(fn: ast.FunctionDef) -> tuple[list[str], int, list[str], bool, bool]:
    a = fn.args
    pos = [x.arg for x in a.posonlyargs + a.args]
    return pos, len(a.defaults), [x.arg for x in a.kwonlyargs], a.vararg is not None, a.kwarg is not None


def _is_stub(fn: ast.FunctionDef) -> bool:
    body = [s for s in fn.body if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))]
    return all(isinstance(s, ast.Pass) or (isinstance(s, ast.Raise) and "NotImplementedError"
                                           in ast.unparse(s)) for s in body)


def _check_function(fn, want, label: str) -> str | None:
    h_pos, _, h_kw, h_var, _ = _params(want)
    pos, n_def, kw, var, varkw = _params(fn)
    extra = pos[len(h_pos):]
    sig = f"({', '.join(h_pos + h_kw)})"
    if pos[: len(h_pos)] != h_pos or len(extra) > n_def or (h_var and not var) \
            or not (set(h_kw) <= set(kw) or varkw):
        return (f"`{label}` must take the parameters {sig} in that order, as in the header; "
                f"your definition takes ({', '.join(pos + kw)})")
    if _is_stub(fn):
        return f"`{label}` has no implementation (only a docstring, pass or NotImplementedError)"
    return None


def check_gate(code: str, function_header: str) -> str | None:
    """The SciCode gate g_i: None when ``code`` passes, else a diagnostic for the model."""
    if not code.strip():
        return "no Python code found in the reply; put the implementation in a ```python block"
    try:
        tree = ast.parse(code)
    except SyntaxError as e:
        line = (e.text or "").strip()
        return f"the code does not parse: SyntaxError: {e.msg} (line {e.lineno}: `{line[:80]}`)"
    except ValueError as e:  # e.g. null bytes
        return f"the code does not parse: {e}"
    want = header_def(function_header)
    kind = "class" if isinstance(want, ast.ClassDef) else "def"
    tops = {n.name: n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef,
                                                          ast.ClassDef))}
    got = tops.get(want.name)
    if got is None or isinstance(got, ast.ClassDef) != (kind == "class"):
        found = ", ".join(sorted(tops)) or "nothing"
        return (f"the code must define `{kind} {want.name}` at top level, as in the given header; "
                f"it defines: {found}")
    if kind == "def":
        return _check_function(got, want, want.name)
    methods = {n.name: n for n in got.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
    for m in want.body:
        if isinstance(m, (ast.FunctionDef, ast.AsyncFunctionDef)):
            if m.name not in methods:
                return f"class `{want.name}` must define the method `{m.name}` given in the header"
            diag = _check_function(methods[m.name], m, f"{want.name}.{m.name}")
            if diag:
                return diag
    return None


def _marker(step_id: str) -> str:
    return f"# ---- SciCode step {step_id} ----"


def join_program(upstream: str, step_id: str, code: str) -> str:
    """The artifact of a step: upstream code, this step's marker, this step's code."""
    head = upstream.rstrip("\n") + "\n\n" if upstream.strip() else ""
    return f"{head}{_marker(step_id)}\n{code.strip(chr(10))}\n"


def split_program(artifact: str, step_id: str) -> tuple[str, str]:
    """(upstream, this step's code) of an artifact; an artifact without marker is all step code."""
    up, sep, own = artifact.rpartition(_marker(step_id) + "\n")
    return (up, own) if sep else ("", artifact)


def gold_upstream(problem: Problem, step_id: str) -> str:
    """Ground-truth (or supplied) code of every step before ``step_id``."""
    parts = []
    for s in problem.steps_before(step_id):
        code = s.supplied_code if s.supplied_code is not None else s.ground_truth
        if code is None:
            raise SciCodeDataError(f"problem {problem.problem_id}: step {s.step_id} has no ground-truth code")
        parts.append(join_program("", s.step_id, code))
    return "\n".join(parts)


def context_code(context: str) -> str:
    """Code in an upstream context: an artifact as it is, or the fenced blocks of a merge reply."""
    context = context or ""
    try:
        ast.parse(context)
        return context
    except (SyntaxError, ValueError):
        return extract_code(context) if "```" in context else context
