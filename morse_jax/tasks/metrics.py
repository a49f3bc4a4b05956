"""SciCode evaluation metrics (DESIGN §3): Step Pass, Mean Step Pass, Problem Pass.

A step *passes* when every one of its unit tests passes (the official SciCode rule), whatever
training reward (pass fraction or binary) was used. The caller supplies one :class:`StepResult`
per testable step of every evaluated problem, including steps that were never attempted
(``n_passed=0``): a problem with a missing step would otherwise look better than it is.
"""

from __future__ import annotations

import dataclasses
from typing import Iterable, Mapping, Sequence


@dataclasses.dataclass(frozen=True)
class StepResult:
    """Outcome of one SciCode step: ``n_passed`` of ``n_tests`` unit tests passed."""

    problem_id: str
    step_id: str
    n_passed: int
    n_tests: int

    def __post_init__(self):
        if not isinstance(self.n_tests, int) or self.n_tests < 1:
            raise ValueError(f"StepResult.n_tests must be a positive int, got {self.n_tests!r} "
                             f"(step {self.step_id})")
        if not isinstance(self.n_passed, int) or not 0 <= self.n_passed <= self.n_tests:
            raise ValueError(f"StepResult.n_passed must be an int in [0, n_tests={self.n_tests}], "
                             f"got {self.n_passed!r} (step {self.step_id})")

    @property
    def passed(self) -> bool:
        return self.n_passed == self.n_tests


def _by_problem(results: Iterable[StepResult]) -> dict[str, list[StepResult]]:
    groups: dict[str, list[StepResult]] = {}
    seen: set[tuple[str, str]] = set()
    for r in results:
        if not isinstance(r, StepResult):
            raise TypeError(f"expected StepResult, got {type(r).__name__}")
        key = (r.problem_id, r.step_id)
        if key in seen:
            raise ValueError(f"duplicate result for problem {r.problem_id!r} step {r.step_id!r}")
        seen.add(key)
        groups.setdefault(r.problem_id, []).append(r)
    if not groups:
        raise ValueError("SciCode metrics need at least one StepResult")
    return groups


def step_pass(results: Sequence[StepResult]) -> float:
    """Micro average: passed steps / all steps, over every problem."""
    groups = _by_problem(results)
    steps = [r for rs in groups.values() for r in rs]
    return sum(r.passed for r in steps) / len(steps)


def mean_step_pass(results: Sequence[StepResult]) -> float:
    """Macro average: each problem's fraction of passed steps, averaged over problems."""
    groups = _by_problem(results)
    return sum(sum(r.passed for r in rs) / len(rs) for rs in groups.values()) / len(groups)


def problem_pass(results: Sequence[StepResult]) -> float:
    """Fraction of problems whose every step passes."""
    groups = _by_problem(results)
    return sum(all(r.passed for r in rs) for rs in groups.values()) / len(groups)


def scicode_metrics(results: Sequence[StepResult]) -> Mapping[str, float]:
    """All three metrics as fractions in [0, 1] plus the counts they are computed from."""
    groups = _by_problem(results)
    return {
        "step_pass": step_pass(results),
        "mean_step_pass": mean_step_pass(results),
        "problem_pass": problem_pass(results),
        "n_problems": float(len(groups)),
        "n_steps": float(sum(len(rs) for rs in groups.values())),
    }
