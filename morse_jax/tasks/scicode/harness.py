"""SciCode test runs: one sandbox run per step, comparisons in this process, the step report.

Split out of :mod:`morse_jax.tasks.scicode.family`, which re-exports every public name defined here.

One sandbox run (:mod:`~morse_jax.tasks.sandbox.record`) executes the step's program, then the
sandbox half of each test (:func:`~morse_jax.tasks.scicode.compare.split_test`) in one shared
namespace, and reports the recorded values in the data-only wire format. The tests are decided
here, against targets that never enter the sandbox (:func:`~morse_jax.tasks.scicode.compare.check_test`);
a ground-truth run of the same job rebuilds the targets instead. Test outcomes
(:class:`StepReport`) are for rewards and logs only; they never reach a prompt.
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Any, Sequence

from morse_jax.tasks.sandbox import record as sandbox_record, runner as sandbox, wire_format
from morse_jax.tasks.scicode.compare import (HELPERS_SOURCE, SplitTest, TestRewriteError, check_test,
                                             recorded_target, split_test)
from morse_jax.tasks.scicode.data import Problem

@dataclasses.dataclass(frozen=True)
class StepReport:
    """Per-test outcome of one step. ``errors[k]`` is "" when test k passed.

    The errors are for logs and developers; they never go into a prompt.
    """

    errors: tuple[str, ...]
    program_error: str = ""
    timed_out: bool = False
    duration_s: float = 0.0
    targets: tuple[Any, ...] | None = None  # rebuild runs: the target of each test

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
    max_output_bytes: int = 64 << 20  # the recorded values travel on stdout


def step_job(program: str, tests: Sequence[SplitTest], limits: ExecLimits) -> tuple[sandbox.Job, str]:
    """The sandbox job running ``program`` then each test's sandbox half, and its report nonce."""
    return sandbox_record.recorded_job(
        program, [t.sandbox_code for t in tests], sandbox_record.RecordLimits(
            limits.timeout_s, limits.test_timeout_s, limits.memory_mb, limits.max_output_bytes),
        prelude=HELPERS_SOURCE, shared_namespace=True, module_name="__scicode__")


def step_report(res: sandbox.SandboxResult, nonce: str, tests: Sequence[SplitTest],
            targets: Sequence[Any] | None, where: str = "") -> StepReport:
    """Decode the sandbox's recorded values and decide each test here (``targets=None``:
    rebuild the targets from them instead, see :func:`recorded_target`)."""
    run = sandbox_record.parse_recorded(res, nonce, len(tests))
    if targets is not None and len(targets) != len(tests):
        raise ValueError(f"got {len(targets)} targets for {len(tests)} tests")
    errors, rebuilt = [], []
    for k, (split, case) in enumerate(zip(tests, run.cases)):
        if targets is not None:
            errors.append(check_test(split, case, targets[k]))
            continue
        err, value = case.error, None
        if not err:
            try:
                value = recorded_target(split, case, f"{where}test {k + 1}")
            except TestRewriteError as e:
                err = str(e)
        errors.append(err)
        rebuilt.append(value)
    return StepReport(tuple(errors), run.program_error, run.timed_out, run.duration_s,
                      tuple(rebuilt) if targets is None else None)


def run_step_tests(program: str, tests: Sequence[SplitTest], limits: ExecLimits, *,
                   targets: Sequence[Any] | None = None, where: str = "") -> StepReport:
    """Run ``program`` then each test's sandbox half; decide the tests here against ``targets``
    (with ``targets=None``: rebuild the targets from the recorded values instead)."""
    job, nonce = step_job(program, tests, limits)
    return step_report(sandbox.run_python(**dataclasses.asdict(job)), nonce, tests, targets, where)


def step_program(problem: Problem, artifact: str) -> str:
    """The program run before a step's tests: the problem's imports, then the artifact."""
    return f"{problem.dependencies}\n\n{artifact}"


def prepared_tests(tests: Sequence[str], where: str) -> list[SplitTest]:
    """:func:`split_test` of each test of a step (cached per test text)."""
    return [split_test(t, f"{where}test {k + 1}") for k, t in enumerate(tests)]


# Changes whenever what a run records changes: keys the rebuilt-target cache.
HARNESS_VERSION = hashlib.sha256("\0".join([sandbox_record.RUNNER_SOURCE, HELPERS_SOURCE, wire_format.SOURCE,
                                            "split-v1"]).encode()).hexdigest()[:12]
