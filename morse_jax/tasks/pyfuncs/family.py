"""PyFuncs task family: procedurally generated multi-step Python coding tasks a 135M model can partly solve.

Each task (:mod:`~morse_jax.tasks.pyfuncs.data`) asks for 2-3 small typed helper functions of
distinct kinds (string processing, parsing, list arithmetic, dict aggregation, formatting; the
templates are in :mod:`~morse_jax.tasks.pyfuncs.templates`) and a function ``solve`` that chains
them. Built for "does it learn?" experiments on a laptop (issue 16).

* **Plans come from a template DAG**, not the planner: every helper is a root node ``f1..fL`` and
  ``solve`` depends on all of them (:meth:`PyFuncsFamily.fixed_plan`). ``solve`` is therefore a
  join node: a *merge* call first combines the helpers' code into one program, then an *execute*
  call writes ``solve`` on top of it -- both roles and several subtask kinds occur every task.
* **Answer prefix**: an execute answer starts with the fenced ``def`` line ending at its colon
  (```` ```python\\ndef f(xs: list[int]) -> int: ````); never with a bare trailing newline, which
  silences SmolLM2. A merge answer starts with its first parent function's ``def`` line.
* **Reward** of a node is the fraction of its hidden tests passed, behind a static gate (the code
  parses and defines the function with the right parameters and a body); a merge's reward is the
  fraction of its parents' hidden tests the merged program still passes. Outputs are recorded in
  the sandbox and compared here (:mod:`~morse_jax.tasks.pyfuncs.verify`). Hidden tests never reach
  a prompt; the gate's diagnostic is the only regeneration feedback.
"""

from __future__ import annotations

import ast
import collections
from typing import Sequence

from morse_jax.tasks.base import Message, Task, VerifyResult
from morse_jax.tasks.pyfuncs.data import FAMILY, SOLVE, PyFuncsTask, Step
from morse_jax.tasks.pyfuncs.verify import Limits, score_calls
from morse_jax.tasks.scicode.context import check_gate, context_code, extract_code, join_program, split_program
from morse_jax.tasks.plan import Plan, PlanNode

_SYSTEM = "You are a careful Python programmer. You write short, correct functions."


class PyFuncsFamily:
    """PyFuncs as a :class:`~morse_jax.tasks.base.TaskFamily` (template DAG, sandboxed hidden tests)."""

    name = FAMILY
    # Answers end at the closing fence (the opening one is in the answer prefix): what a small
    # model writes after its code (usage, prose) costs decode steps and is never part of the artifact.
    stop_strings = ("```",)

    def __init__(self, limits: Limits | None = None):
        self.limits = limits or Limits()
        self._contexts: collections.OrderedDict = collections.OrderedDict()

    @staticmethod
    def payload(task: Task) -> PyFuncsTask:
        if not isinstance(task.payload, PyFuncsTask):
            raise TypeError(f"task {task.task_id!r}: payload must be a PyFuncsTask, got {type(task.payload).__name__}")
        return task.payload

    def _step(self, task: Task, node: PlanNode) -> tuple[PyFuncsTask, Step]:
        p = self.payload(task)
        return p, p.step(node.id)

    def fixed_plan(self, task: Task) -> Plan:
        p = self.payload(task)
        helpers = [PlanNode(s.node_id, s.spec.name, node_description(s)) for s in p.helpers]
        solve = PlanNode(SOLVE, SOLVE, node_description(p.solve), tuple(s.node_id for s in p.helpers))
        return Plan((*helpers, solve))

    def execute_messages(self, task: Task, node: PlanNode, context: str, diagnostic: str | None) -> list[Message]:
        _, step = self._step(task, node)
        parts = []
        if node.id == SOLVE:
            self._contexts[(task.task_id, node.id)] = context or ""
            while len(self._contexts) > 4096:  # only in-flight nodes need their context
                self._contexts.popitem(last=False)
            parts.append(f"These functions are already defined:\n```python\n{context_code(context).strip()}\n```")
        spec = step.spec
        parts.append(f"Write a Python function `{spec.header[4:-1]}`.\n{spec.doc}")
        parts.append("Examples:\n" + "\n".join(f">>> {spec.name}({c.input_repr})\n{c.expected!r}" for c in step.examples))
        if diagnostic:
            parts.append(f"Your previous answer was rejected: {diagnostic}\nFix this.")
        parts.append("Reply with the function in one ```python block.")
        return [{"role": "system", "content": _SYSTEM}, {"role": "user", "content": "\n\n".join(parts)}]

    def merge_messages(self, task: Task, node: PlanNode, parent_artifacts: Sequence[str]) -> list[Message]:
        blocks = "\n\n".join(f"```python\n{a.strip()}\n```" for a in parent_artifacts)
        user = (f"Here are {len(parent_artifacts)} Python functions:\n\n{blocks}\n\nCombine them into one "
                "Python program that contains each function exactly once, unchanged. Do not add new code. "
                "Reply with the program in one ```python block.")
        return [{"role": "system", "content": _SYSTEM}, {"role": "user", "content": user}]

    def answer_prefix(self, task: Task, node: PlanNode, role: str) -> str:
        """Answers start with a fenced ``def`` line ending at its colon (never a bare newline): an
        execute answer with its own function's, a merge answer with its first parent's (whose code
        it then copies)."""
        p, step = self._step(task, node)
        if role == "merge":
            if not node.depends_on:
                return ""
            return f"```python\n{p.step(node.depends_on[0]).spec.header}"
        return f"```python\n{step.spec.header}"

    def extract_artifact(self, task: Task, node: PlanNode, completion: str, context: str | None = None) -> str:
        """A helper's artifact is its code; solve's is the merged helpers, a marker, then solve's code."""
        p, step = self._step(task, node)
        others = {s.spec.name for s in p.steps if s.node_id != node.id}
        code = definitions_only(extract_code(completion, step.spec.name), drop=others)
        if node.id != SOLVE:
            return code
        if context is None:
            context = self._contexts.get((task.task_id, node.id))
            if context is None:
                raise ValueError(f"node {node.id} of task {task.task_id}: no context; call execute_messages "
                                 "first or pass context=")
        return join_program(context_code(context), SOLVE, code)

    def extract_merge_artifact(self, task: Task, node: PlanNode, completion: str) -> str:
        return extract_code(completion)

    def verify(self, task: Task, node: PlanNode, artifact: str) -> VerifyResult:
        _, step = self._step(task, node)
        upstream, own = split_program(artifact, SOLVE) if node.id == SOLVE else ("", artifact)
        diag = check_gate(own, step.spec.header)
        if diag is None and upstream.strip():
            try:
                ast.parse(upstream)
            except (SyntaxError, ValueError) as e:
                diag = f"the already defined code does not parse ({getattr(e, 'msg', e)})"
        if diag is not None:
            return VerifyResult(False, 0.0, diag)
        return self._score(artifact, [(step.spec.name, c) for c in step.tests])

    def verify_merge(self, task: Task, node: PlanNode, artifact: str) -> VerifyResult:
        p, _ = self._step(task, node)
        parents = [p.step(pid) for pid in node.depends_on]
        if not artifact.strip():
            return VerifyResult(False, 0.0, "no Python code found in the reply; put the program in a ```python block")
        try:
            tree = ast.parse(artifact)
        except (SyntaxError, ValueError) as e:
            return VerifyResult(False, 0.0, f"the program does not parse ({getattr(e, 'msg', e)})")
        defined = {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
        missing = [s.spec.name for s in parents if s.spec.name not in defined]
        if missing:
            return VerifyResult(False, 0.0, "the program must define " + ", ".join(f"`{m}`" for m in missing))
        return self._score(artifact, [(s.spec.name, c) for s in parents for c in s.tests])

    def _score(self, program: str, calls) -> VerifyResult:
        passed = score_calls(program, [(name, c.input_repr, c.expected) for name, c in calls], self.limits)
        frac = sum(passed) / len(passed)
        return VerifyResult(True, frac, "", {"tests_passed": float(sum(passed)), "tests_total": float(len(passed)),
                                              "pass_fraction": frac})

    def reference_artifact(self, task: Task, node: PlanNode) -> str:
        """The artifact a correct solution would give (for tests and calibration)."""
        p, step = self._step(task, node)
        if node.id != SOLVE:
            return step.spec.reference
        return join_program(merged_reference(p), SOLVE, step.spec.reference)


def definitions_only(code: str, drop=()) -> str:
    """The reply's imports, constants, classes and functions, without top-level statements (example
    calls, prints, asserts run at import time) and without functions named in ``drop`` (another
    node's function: a ``solve`` answer that rewrites a helper must not replace the merged one).
    Code that does not parse is returned as it is, for the gate to reject."""
    try:
        tree = ast.parse(code)
    except (SyntaxError, ValueError):
        return code
    keep = []
    for n in tree.body:
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            if n.name not in drop:
                keep.append(n)
        elif isinstance(n, (ast.Import, ast.ImportFrom)):
            keep.append(n)
        elif isinstance(n, (ast.Assign, ast.AnnAssign)) and not any(isinstance(x, ast.Call) for x in ast.walk(n)):
            keep.append(n)
    lines = code.splitlines()
    parts = ["\n".join(lines[(n.decorator_list[0].lineno if getattr(n, "decorator_list", None) else n.lineno) - 1:
                             n.end_lineno]) for n in keep]
    return "\n\n".join(parts) + "\n" if parts else code


def node_description(step: Step) -> str:
    """The subtask text s_i (what the router sees)."""
    return f"Write the Python function `{step.spec.header[4:-1]}`: {step.spec.doc}"


def merged_reference(p: PyFuncsTask) -> str:
    """The helpers' reference code as one program (a correct merge)."""
    return "\n\n".join(s.spec.reference.strip() for s in p.helpers) + "\n"




def pyfuncs_metrics(tasks: Sequence[Task], result) -> dict:
    """Held-out metrics from an eval run's traces (every execute node counts; failed or blocked = 0).

    reward: mean over nodes of the fraction of hidden tests passed (the headline "held-out reward");
    node_pass: fraction of nodes passing all tests; task_pass: tasks whose every node passes all;
    solve_reward: mean reward of the solve (merge-step) nodes.
    """
    rewards, solve, tasks_ok = [], [], []
    for t in tasks:
        trace = result.traces[t.task_id]
        task_r = []
        for s in PyFuncsFamily.payload(t).steps:
            n = trace.nodes.get(s.node_id)
            r = float(n.result.reward) if n is not None and n.status == "passed" and n.result is not None else 0.0
            task_r.append(r)
            if s.node_id == SOLVE:
                solve.append(r)
        rewards += task_r
        tasks_ok.append(all(r == 1.0 for r in task_r))
    if not rewards:
        raise ValueError("pyfuncs metrics need at least one task")
    return {"reward": sum(rewards) / len(rewards), "node_pass": sum(r == 1.0 for r in rewards) / len(rewards),
            "task_pass": sum(tasks_ok) / len(tasks_ok), "solve_reward": sum(solve) / len(solve),
            "n_tasks": float(len(tasks)), "n_nodes": float(len(rewards))}
