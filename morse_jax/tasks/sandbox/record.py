"""Run untrusted code in the sandbox, get back the values it computed, compare them outside.

Hidden-test families must never put expected values, or the code that compares against them,
in the process that runs a candidate: that process is the candidate's, and it can patch
``numpy.allclose``, walk frames or the garbage collector to an expected value, return objects
whose ``==`` lies, or print a forged report. So a verifier built on this module works in two
halves:

* **in the sandbox** (:data:`RUNNER_SOURCE`): run the program, then each *case* (a piece of code that
  calls ``__record__(site, *values)``); every recorded value is converted at once to the
  data-only :mod:`~morse_jax.tasks.sandbox.wire_format` and reported on one nonce-tagged stdout line per
  case. No expected value is ever written into the run directory.
* **in the trusted process** (:func:`parse_recorded`): the lines are decoded into plain numpy /
  Python values (size-capped, no pickle, no code) and handed to the family, which compares them
  with its own numpy / scipy.

What a candidate can still do is report arbitrary values for its own cases; without the expected
values that earns nothing. Where a family's checks do not involve an expected value (a
self-consistency assert), the values compared both come from the candidate's process and the
check is only as strong as the candidate is honest; see README "Security and reliability".

One function for a family with hidden input/output tests: :func:`check_outputs` (run the
candidate, record each call's value, compare outside). SciCode builds its test runs on
:func:`recorded_job` / :func:`parse_recorded` (see :mod:`~morse_jax.tasks.scicode.compare`).
"""

from __future__ import annotations

import collections
import dataclasses
import json
import secrets
from typing import Any, Callable, Sequence

from morse_jax.tasks.sandbox import runner as sandbox, wire_format

__all__ = ["RUNNER_SOURCE", "CaseRecord", "CaseResult", "RecordLimits", "RecordedRun", "check_outputs", "equal_values",
           "parse_recorded", "recorded_job", "run_recorded"]

# Runs inside the sandbox. Files: program.py, job.json, morse_wire.py (the wire format), and
# prelude.py (trusted helper definitions for the cases' namespace, may be empty).
RUNNER_SOURCE = r'''
import json, os, signal, sys, traceback
import morse_wire

def _fmt(exc):
    return "".join(traceback.format_exception_only(type(exc), exc)).strip()[-600:]

class _Timeout(Exception):
    pass

def _alarm(signum, frame):
    raise _Timeout("time limit of this test exceeded")

def _main():
    with open("job.json", encoding="utf-8") as f:
        job = json.load(f)
    os.remove("job.json")
    out, tag = sys.stdout, "@@RECORD " + job["nonce"] + " "
    def emit(rec):
        out.write("\n" + tag + json.dumps(rec, allow_nan=False) + "\n")  # own line
        out.flush()
    with open("prelude.py", encoding="utf-8") as f:
        prelude = f.read()
    os.environ.setdefault("MPLBACKEND", "Agg")
    sink = open(os.devnull, "w")
    signal.signal(signal.SIGALRM, _alarm)
    ns = {"__name__": job["module_name"]}
    def run(src, name, space):
        sys.stdout = sink
        try:
            signal.setitimer(signal.ITIMER_REAL, job["case_timeout_s"])
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
    # Cases run in a namespace separate from the program's globals (the program's functions
    # cannot see the cases' variables by name); shared across cases when asked (SciCode runs its
    # tests as one script: RNG state and helpers carry over).
    shared = dict(ns)
    if prelude:
        exec(compile(prelude, "prelude.py", "exec"), shared)
    for k, code in enumerate(job["cases"]):
        events = []
        def record(site, *values, _events=events):
            _events.append([site, [morse_wire.encode(v) for v in values]])  # snapshot now
        space = shared if job["shared"] else dict(shared)
        space["__record__"] = record
        err = run(code, "case%d" % (k + 1), space)
        emit({"case": k, "error": err, "events": [] if err else events})

_main()
'''


@dataclasses.dataclass(frozen=True)
class RecordLimits:
    """Limits of one recorded run: whole run, each case, memory (RLIMIT_AS), captured stdout."""

    timeout_s: float = 60.0
    case_timeout_s: float = 30.0
    memory_mb: int = 2048
    max_output_bytes: int = 64 << 20  # the recorded values travel on stdout


@dataclasses.dataclass(frozen=True)
class CaseRecord:
    """What one case reported. ``error`` is "" when the case ran to its end in the sandbox;
    ``events`` are the ``__record__(site, *values)`` calls in order, values decoded on this side."""

    error: str
    events: tuple[tuple[Any, tuple[Any, ...]], ...] = ()


@dataclasses.dataclass(frozen=True)
class RecordedRun:
    """Outcome of one :func:`run_recorded`: one :class:`CaseRecord` per case."""

    cases: tuple[CaseRecord, ...]
    program_error: str
    timed_out: bool
    duration_s: float


def recorded_job(program: str, cases: Sequence[str], limits: RecordLimits, *, prelude: str = "",
                 shared_namespace: bool = True, module_name: str = "__main__",
                 ) -> tuple[sandbox.Job, str]:
    """The sandbox job (and its nonce) that runs ``program`` then each case, recording values."""
    if isinstance(cases, str) or not all(isinstance(c, str) for c in cases):
        raise TypeError("recorded_job: cases must be a sequence of code strings")
    nonce = secrets.token_hex(16)
    job = {"nonce": nonce, "cases": list(cases), "case_timeout_s": float(limits.case_timeout_s),
           "shared": bool(shared_namespace), "module_name": module_name}
    files = {"program.py": program, "job.json": json.dumps(job), "morse_wire.py": wire_format.SOURCE,
             "prelude.py": prelude}
    return sandbox.Job(RUNNER_SOURCE, files=files, timeout_s=limits.timeout_s, memory_mb=limits.memory_mb,
                       max_output_bytes=limits.max_output_bytes), nonce


def parse_recorded(res: sandbox.SandboxResult, nonce: str, n_cases: int,
                   max_bytes: int = 64 << 20) -> RecordedRun:
    """Decode the nonce-tagged report lines of a :func:`recorded_job` run (trusted side).

    A case gets an error, never a value, when its line is missing (timeout, crash, early exit),
    cut (output limit), duplicated (forged), malformed or not decodable as data-only values.
    """
    tag = f"@@RECORD {nonce} "
    program_error, lines = None, collections.defaultdict(list)
    budget = max_bytes
    for line in res.stdout.splitlines():
        if not line.startswith(tag):
            continue
        try:
            rec = json.loads(line[len(tag):], parse_constant=_reject_constant)
        except (ValueError, RecursionError):  # cut by the output limit, or not ours
            continue
        if not isinstance(rec, dict):
            continue
        if rec.get("program") is True and isinstance(rec.get("error"), str):
            program_error = rec["error"] if program_error is None else "duplicate program result"
        elif type(rec.get("case")) is int:
            lines[rec["case"]].append(rec)
    if program_error is None:  # the runner reports the program first: later lines are not its own
        why = "timed out" if res.timed_out else f"exited with {res.returncode}"
        program_error = f"the run {why} before the program finished loading: {res.stderr[-400:]}"
        lines.clear()
    cases = []
    for k in range(n_cases):
        got = lines.get(k, [])
        if len(got) > 1:
            cases.append(CaseRecord("duplicate results (forged report lines)"))
        elif not got:
            cases.append(CaseRecord(program_error or _missing(res)))
        else:
            rec, size = got[0], 0
            try:
                error, events = rec["error"], rec["events"]
                if not isinstance(error, str) or not isinstance(events, list):
                    raise wire_format.WireError("malformed case result")
                decoded = []
                for ev in events:
                    if not isinstance(ev, list) or len(ev) != 2 or not isinstance(ev[1], list):
                        raise wire_format.WireError("malformed recorded event")
                    site = ev[0] if isinstance(ev[0], (int, str)) and not isinstance(ev[0], bool) else None
                    if site is None:
                        raise wire_format.WireError("malformed recorded site")
                    size = len(json.dumps(ev[1]))
                    budget -= size
                    if budget < 0:
                        raise wire_format.WireError(f"recorded values exceed {max_bytes} bytes")
                    # each JSON char is at most one 8-byte item or one array byte
                    decoded.append((site, tuple(wire_format.decode(v, 8 * size + 1024) for v in ev[1])))
                cases.append(CaseRecord(error, tuple(decoded)))
            except (KeyError, wire_format.WireError) as e:
                cases.append(CaseRecord(f"bad report: {e}"))
    return RecordedRun(tuple(cases), program_error, bool(res.timed_out), float(res.duration_s))


def _missing(res: sandbox.SandboxResult) -> str:
    if res.timed_out:
        return "no result: the run timed out"
    if "[sandbox: stdout truncated" in res.stdout[-200:]:
        return "no result: the output limit was reached"
    return f"no result: the process died ({res.stderr[-300:]})"


def _reject_constant(name):
    raise ValueError(f"bare {name}")


def run_recorded(program: str, cases: Sequence[str], limits: RecordLimits | None = None, *,
                 prelude: str = "", shared_namespace: bool = True) -> RecordedRun:
    """One sandbox run of ``program`` then ``cases``; see the module docstring."""
    limits = limits or RecordLimits()
    job, nonce = recorded_job(program, cases, limits, prelude=prelude, shared_namespace=shared_namespace)
    return parse_recorded(sandbox.run_python(**dataclasses.asdict(job)), nonce, len(cases),
                          limits.max_output_bytes)


# ============================================================================ hidden I/O tests


@dataclasses.dataclass(frozen=True)
class CaseResult:
    """Outcome of one hidden test of :func:`check_outputs`; ``reason`` is for logs, never prompts."""

    passed: bool
    reason: str = ""


def equal_values(got: Any, want: Any, rtol: float = 1e-5, atol: float = 1e-8) -> bool:
    """Trusted default comparison: numbers and arrays with ``np.allclose`` tolerances (shapes must
    match), str / None / bool exactly, lists / tuples / dicts element-wise (same type and keys)."""
    import numpy as np

    if isinstance(want, (list, tuple)):
        return type(got) is type(want) and len(got) == len(want) and all(
            equal_values(g, w, rtol, atol) for g, w in zip(got, want))
    if isinstance(want, dict):
        return isinstance(got, dict) and got.keys() == want.keys() and all(
            equal_values(got[k], want[k], rtol, atol) for k in want)
    if want is None or isinstance(want, (str, bool, np.bool_)):
        return type(got) is type(want) and got == want
    if isinstance(got, (bool, np.bool_, str)) or got is None:
        return False
    try:
        g, w = np.asarray(got), np.asarray(want)
        if g.shape != w.shape or g.dtype.kind not in "biufc" or w.dtype.kind not in "biufc":
            return False
        return bool(np.allclose(g, w, rtol=rtol, atol=atol, equal_nan=False))
    except (TypeError, ValueError):
        return False


def check_outputs(program: str, calls: Sequence[str], expected: Sequence[Any], *,
                  compare: Callable[[Any, Any], bool] = equal_values,
                  limits: RecordLimits | None = None) -> list[CaseResult]:
    """Hidden input/output tests: run ``program`` in the sandbox, evaluate each expression of
    ``calls`` (e.g. ``"solve(3, [1, 2])"``) there and record its value, then compare it here
    with ``compare(value, expected[i])``. ``expected`` never enters the sandbox.
    """
    if len(calls) != len(expected):
        raise ValueError(f"check_outputs: {len(calls)} calls for {len(expected)} expected values")
    for i, c in enumerate(calls):
        try:
            compile(c, f"calls[{i}]", "eval")
        except SyntaxError as e:
            raise ValueError(f"check_outputs: calls[{i}] is not an expression: {e.msg}") from None
    run = run_recorded(program, [f"__record__(0, ({c}))" for c in calls], limits, shared_namespace=False)
    out = []
    for case, want in zip(run.cases, expected):
        if case.error:
            out.append(CaseResult(False, case.error))
        elif len(case.events) != 1:
            out.append(CaseResult(False, f"expected one recorded value, got {len(case.events)}"))
        else:
            try:
                ok = bool(compare(case.events[0][1][0], want))
            except Exception as e:  # noqa: BLE001 -- a comparison that raises means "not equal"
                ok, why = False, f"comparison raised {type(e).__name__}: {e}"
            else:
                why = "" if ok else "wrong value"
            out.append(CaseResult(ok, why))
    return out

