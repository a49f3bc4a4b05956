"""PyFuncs verification: candidate outputs recorded in the sandbox, compared in the trusted process.

:func:`record_outputs` is the only function that runs candidate code: one sandbox run executes
the program, then calls the named functions on literal inputs (``ast.literal_eval``), each under
its own time limit, and prints one nonce-tagged JSON line per call with the *encoded* return
value (:func:`encode_value`) or the error. Nothing is compared in the sandbox: :func:`score_calls`
encodes the expected values with the same :func:`encode_value` here and compares. The encoding
is exact and typed (``True`` is not ``1``, a tuple is not a list, dict items are order-free), so
a candidate cannot pass by returning an object with a forged ``__eq__``.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import secrets
from typing import Any, Sequence

from morse_jax.tasks.sandbox import runner as sandbox

MAX_DEPTH = 8


def encode_value(v, depth=0):
    """A JSON-able, typed, canonical encoding of a Python value (also run inside the sandbox)."""
    if depth > MAX_DEPTH:
        return ["deep"]
    t = type(v)  # exact types only: a subclass could forge its encoding (e.g. an int with its own __str__)
    if v is None:
        return ["none"]
    if t is bool:
        return ["bool", v]
    if t is int:
        return ["int", str(v)]
    if t is float:
        return ["float", repr(v)]
    if t is str:
        return ["str", v]
    if t is list or t is tuple:
        return [t.__name__, [encode_value(x, depth + 1) for x in v]]
    if t is dict:
        items = [[encode_value(k, depth + 1), encode_value(x, depth + 1)] for k, x in v.items()]
        return ["dict", sorted(items, key=lambda kv: json.dumps(kv[0]))]
    if t is set or t is frozenset:
        return ["set", sorted((encode_value(x, depth + 1) for x in v), key=json.dumps)]
    return ["other", type(v).__name__]


# Runs inside the sandbox: program.py, job.json. encode_value's source is prepended.
_HARNESS = r'''
import ast, json, os, signal, sys, traceback

class _Timeout(Exception):
    pass

def _alarm(signum, frame):
    raise _Timeout("time limit of this call exceeded")

def _main():
    with open("job.json", encoding="utf-8") as f:
        job = json.load(f)
    os.remove("job.json")
    out, tag = sys.stdout, "@@PYFUNCS " + job["nonce"] + " "
    def emit(rec):
        out.write("\n" + tag + json.dumps(rec) + "\n")
        out.flush()
    sink = open(os.devnull, "w")
    signal.signal(signal.SIGALRM, _alarm)
    ns = {"__name__": "__pyfuncs__"}
    def guarded(fn):
        sys.stdout = sink
        try:
            signal.setitimer(signal.ITIMER_REAL, job["call_timeout_s"])
            return fn(), ""
        except BaseException as exc:
            return None, ("".join(traceback.format_exception_only(type(exc), exc)).strip()[-300:]
                          or type(exc).__name__)
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            sys.stdout = out
    with open("program.py", encoding="utf-8") as f:
        src = f.read()
    _, err = guarded(lambda: exec(compile(src, "program.py", "exec"), ns))
    emit({"program": True, "error": err})
    if err:
        return
    for k, (name, arg) in enumerate(job["calls"]):
        fn = ns.get(name)
        if not callable(fn):
            emit({"call": k, "error": "%s is not defined" % name})
            continue
        value, err = guarded(lambda: encode_value(fn(ast.literal_eval(arg))))
        emit({"call": k, "error": err} if err else {"call": k, "value": value})

_main()
'''


@dataclasses.dataclass(frozen=True)
class Limits:
    """Sandbox limits of one verification run."""

    timeout_s: float = 20.0
    call_timeout_s: float = 2.0
    memory_mb: int = 1024
    max_output_bytes: int = 1 << 20


@dataclasses.dataclass(frozen=True)
class Recorded:
    """Outcome of one call: the encoded value, or an error ("" when the call returned)."""

    value: Any = None
    error: str = ""


def record_outputs(program: str, calls: Sequence[tuple[str, str]], limits: Limits = Limits()) -> list[Recorded]:
    """Run ``program`` in the sandbox, then each ``(function name, input repr)`` call; the
    encoded return values in call order. The only place candidate code runs."""
    nonce = secrets.token_hex(16)
    job = {"nonce": nonce, "calls": [list(c) for c in calls], "call_timeout_s": float(limits.call_timeout_s)}
    harness = "import json\nMAX_DEPTH = %d\n" % MAX_DEPTH + inspect.getsource(encode_value) + _HARNESS
    res = sandbox.run_python(harness, files={"program.py": program, "job.json": json.dumps(job)},
                             timeout_s=limits.timeout_s, memory_mb=limits.memory_mb,
                             max_output_bytes=limits.max_output_bytes)
    tag = f"@@PYFUNCS {nonce} "
    program_error, got = None, {}
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
            program_error = str(rec.get("error", "")) if program_error is None else "duplicate program result"
        elif isinstance(rec.get("call"), int) and program_error is not None:
            got[rec["call"]] = "duplicate" if rec["call"] in got else rec
    if program_error is None:
        why = "timed out" if res.timed_out else f"exited with {res.returncode}"
        return [Recorded(error=f"the program did not load ({why})")] * len(calls)
    if program_error:
        return [Recorded(error=f"the program raised: {program_error}")] * len(calls)
    out = []
    for k in range(len(calls)):
        rec = got.get(k)
        if rec is None:
            out.append(Recorded(error="no result (timed out or died)"))
        elif rec == "duplicate":
            out.append(Recorded(error="duplicate results"))
        elif rec.get("error"):
            out.append(Recorded(error=str(rec["error"])))
        else:
            out.append(Recorded(value=rec.get("value")))
    return out


def score_calls(program: str, calls: Sequence[tuple[str, str, Any]], limits: Limits = Limits()) -> list[bool]:
    """For each ``(function name, input repr, expected value)``: did the program return exactly
    the expected value? Outputs come from :func:`record_outputs`; the comparison happens here."""
    recorded = record_outputs(program, [(n, x) for n, x, _ in calls], limits)
    return [not r.error and r.value == json.loads(json.dumps(encode_value(exp)))
            for r, (_, _, exp) in zip(recorded, calls)]
