"""SciCode test runs: the in-sandbox harness, its job files and the parsing of its report.

Split out of :mod:`morse_jax.tasks.scicode`, which re-exports every public name defined here.

One sandbox run executes the step's program, then each test in one shared namespace, in one of
two modes: ``score`` (targets given as pickled bytes, unpickled only inside the sandbox) or
``record`` (tests rewritten by :func:`~morse_jax.tasks.scicode_targets.recording_test` report
the values they compare, which become the targets). Result lines carry a per-run nonce so that
output of the code under test cannot pose as a result. Test outcomes (:class:`StepReport`)
are for rewards and logs only; they never reach a prompt.
"""

from __future__ import annotations

import base64
import collections
import dataclasses
import hashlib
import json
import pickle
import re
import secrets
from typing import Sequence

from morse_jax.tasks import sandbox
from morse_jax.tasks.scicode_data import Problem

_SCICODE_IMPORT = re.compile(r"^([ \t]*)(from[ \t]+scicode[\w.]*[ \t]+import[^\n]*|import[ \t]+scicode[^\n]*)$",
                             re.MULTILINE)


def _prepare_test(code: str) -> str:
    # The harness defines SciCode's comparison helpers itself; its package need not be importable.
    return _SCICODE_IMPORT.sub(lambda m: m.group(1) + "pass", code)


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
