"""PyFuncs verification: hidden input/output tests through the sandbox's one recorded-check function.

Candidate code runs only inside :func:`morse_jax.tasks.sandbox.record.check_outputs`: it executes
the program in the sandbox, evaluates each call expression ``name(<input literal>)`` there and
sends the value back in the data-only wire format. The expected values never enter the sandbox;
they are compared here, in the trusted process, by :func:`same_value`.

:func:`same_value` is stricter than the sandbox module's default numeric comparison on purpose:
these functions return ints, strings, lists and dicts, and a typed exact match is the
specification (``True`` is not ``1``, ``3.0`` is not ``3``, a tuple is not a list; dict items are
order-free). A candidate cannot pass by returning an object with a forged ``__eq__``: only plain
data crosses the wire, and an ``int`` subclass arrives as the plain ``int`` it holds.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

from morse_jax.tasks.sandbox.record import RecordLimits, check_outputs


@dataclasses.dataclass(frozen=True)
class Limits:
    """Sandbox limits of one verification run (all calls of one node share the run)."""

    timeout_s: float = 20.0
    call_timeout_s: float = 2.0
    memory_mb: int = 1024
    max_output_bytes: int = 1 << 20

    def record_limits(self) -> RecordLimits:
        return RecordLimits(timeout_s=self.timeout_s, case_timeout_s=self.call_timeout_s,
                            memory_mb=self.memory_mb, max_output_bytes=self.max_output_bytes)


def same_value(got: Any, want: Any) -> bool:
    """Exact, typed equality of plain data: same type at every level (bool, int, float, str,
    None, list, tuple, dict), equal scalars, same length and items, same dict keys."""
    if type(got) is not type(want):
        return False
    if isinstance(want, (list, tuple)):
        return len(got) == len(want) and all(same_value(g, w) for g, w in zip(got, want))
    if isinstance(want, dict):
        return got.keys() == want.keys() and all(same_value(got[k], want[k]) for k in want)
    if want is None or isinstance(want, (bool, int, float, str)):
        return got == want
    return False  # PyFuncs never expects any other type


def score_calls(program: str, calls: Sequence[tuple[str, str, Any]], limits: Limits = Limits()) -> list[bool]:
    """For each ``(function name, input repr, expected value)``: did ``program`` return exactly the
    expected value? One sandbox run (:func:`~morse_jax.tasks.sandbox.record.check_outputs`);
    the comparison happens here with :func:`same_value`."""
    results = check_outputs(program, [f"{name}({arg})" for name, arg, _ in calls], [exp for _, _, exp in calls],
                            compare=same_value, limits=limits.record_limits())
    return [r.passed for r in results]
