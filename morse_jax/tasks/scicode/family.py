"""SciCode task family (DESIGN §3, §5, §6): problems, test targets, step verifier.

This module holds the task family (:class:`SciCodeFamily`: prompts, answer prefix, artifact
extraction, verification) and re-exports the public names of the modules it is built from, so
``from morse_jax.tasks import scicode as sc; sc.<name>`` reaches all of SciCode. The pieces
live in one module per concept (split to keep files under ~500 lines):

* :mod:`~morse_jax.tasks.scicode.data` -- problems and splits: the JSONL format, loading,
  validation (``Problem``, ``Step``, ``load_problems``, ``load_split``, ``SPLITS``).
* :mod:`~morse_jax.tasks.scicode.context` -- code from a reply (``extract_code``), the gate
  (``check_gate``), cumulative artifacts (``join_program``, ``split_program``, ``gold_upstream``).
* :mod:`~morse_jax.tasks.scicode.compare` -- each test split into a sandbox half (computes and
  records values) and a trusted half (the comparisons, made in this process): ``split_test``,
  ``check_test``, ``recorded_target``.
* :mod:`~morse_jax.tasks.scicode.harness` -- one sandbox run per step and its report
  (``run_step_tests``, ``StepReport``, ``ExecLimits``).
* :mod:`~morse_jax.tasks.scicode.targets` -- test targets (``H5Targets``, ``RebuiltTargets``).

Re-exported names are the same objects, but code reads them from the module that defines them:
to monkeypatch one (e.g. ``run_step_tests`` for ``RebuiltTargets``), patch that module.

Design points:

* Problems come from the PyPI package ``nvidia-scicode`` or a JSONL file in its format; steps
  without tests carry code supplied by the benchmark and are not plan nodes.
* Targets come from the official ``test_data.h5`` or are rebuilt by running the ground-truth code
  in the sandbox (cached on disk, data-only format). They never enter a sandbox: the candidate's
  run only computes and records values; every comparison with a target happens in this process.
* A SciCode artifact is the program so far: the upstream code, a marker line, then this step's
  code. Artifacts are cumulative because the orchestrator hands a node only its parents'
  artifacts, while a step may call any earlier step's function.
* The gate is a static rule check (parses, defines the header's function with its parameters,
  has a body); its diagnostic is the only feedback for regeneration. Hidden test results never
  reach a diagnostic or a prompt.
"""

from __future__ import annotations

import ast
import collections
import dataclasses
import logging
from typing import Sequence

from morse_jax.tasks.sandbox import record as sandbox_record, runner as sandbox
from morse_jax.tasks.base import Message, Task, VerifyResult
from morse_jax.tasks.scicode.context import (check_gate, context_code, extract_code, gold_upstream, join_program,
                                          split_program)
from morse_jax.tasks.scicode.data import (PACKAGE_SOURCES, SLOW_STEPS, SPLITS, Problem, SciCodeDataError, Step,
                                          load_problems, load_split, package_data_dir, problem_to_task,
                                          split_path)
from morse_jax.tasks.scicode.compare import SplitTest, TestRewriteError, check_test, recorded_target, split_test
from morse_jax.tasks.scicode.harness import (HARNESS_VERSION, ExecLimits, StepReport, prepared_tests,
                                             run_step_tests, step_job, step_program, step_report)
from morse_jax.tasks.scicode.targets import (H5Targets, RebuiltTargets, TargetRebuildError, TargetSource,
                                             default_cache_dir, summarize)
from morse_jax.tasks.plan import Plan, PlanNode, step_chain_plan

__all__ = [  # defined here, then re-exported from the modules this one is built from
    "SciCodeFamily", "step_pairs", "check_gate", "context_code", "extract_code", "gold_upstream",
    "join_program", "split_program", "PACKAGE_SOURCES", "SLOW_STEPS", "SPLITS", "Problem",
    "SciCodeDataError", "Step", "load_problems", "load_split", "package_data_dir", "problem_to_task",
    "split_path", "SplitTest", "TestRewriteError", "check_test", "recorded_target", "split_test",
    "HARNESS_VERSION", "ExecLimits", "StepReport", "prepared_tests", "run_step_tests", "step_job",
    "step_program", "step_report", "H5Targets", "RebuiltTargets", "TargetRebuildError", "TargetSource",
    "default_cache_dir", "summarize", "sandbox", "sandbox_record",
]


# --------------------------------------------------------------------------------------------
# The task family

log = logging.getLogger(__name__)

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
        return step_chain_plan(step_pairs(self._problem(task)))

    def single_agent_plan(self, task: Task) -> Plan:
        """Single-agent mode (the orchestrator's hook): one call per step in order, SciCode's own
        protocol; a step is the smallest unit the tests score, so the whole problem cannot be one node."""
        return step_chain_plan(step_pairs(self._problem(task)))

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
        if rep.program_error or rep.n_passed < rep.n_tests:  # for logs only, never a prompt
            why = rep.program_error or next(e for e in rep.errors if e)
            log.info("scicode: %d/%d tests passed (%s)", rep.n_passed, rep.n_tests, why[:300])
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
            tests = prepared_tests(step.test_cases, f"step {step.step_id} ")
            targets = self.targets.step_targets(problem, step)
            results = sandbox.run_many([j for j, _ in jobs], max_workers=max_workers, isolate_failures=True)
            for i, (_, nonce), res in zip(waiting, jobs, results):
                out[i] = self._result(step_report(res, nonce, tests, targets))
        return out

    def _job(self, problem: Problem, step: Step, artifact: str):
        tests = prepared_tests(step.test_cases, f"step {step.step_id} ")
        return step_job(step_program(problem, artifact), tests, self.limits)

    def score(self, problem: Problem, step: Step, artifact: str) -> StepReport:
        """Run the step's unit tests on an artifact (no gate); for evaluation and debugging."""
        job, nonce = self._job(problem, step, artifact)
        tests = prepared_tests(step.test_cases, f"step {step.step_id} ")
        return step_report(sandbox.run_python(**dataclasses.asdict(job)), nonce, tests,
                       self.targets.step_targets(problem, step))


def step_pairs(problem: Problem) -> list[tuple[str, str]]:
    """(step_id, description) of the plan nodes, for ``planner.plan_with_fixed_nodes``."""
    return [(s.step_id, s.description) for s in problem.testable_steps]
