"""SciCode with planner-made DAGs (rollout.scicode_dag="planner"): the steps stay the nodes, the
planner's edges make joins, and the join's merge and execute prompts carry the branches' code."""

from __future__ import annotations

import json

import numpy as np

from morse_jax.sampling.sampler import Completion
from morse_jax.tasks.scicode import family as sc
from morse_jax.tasks.base import Task
from morse_jax.tomas.orchestrator import Orchestrator, OrchestratorConfig


def test_planner_dependencies_make_a_scicode_join_with_a_merge():
    problem = next(p for p in sc.load_problems("package:dev") if len(p.testable_steps) >= 3)
    ids = [s.step_id for s in problem.testable_steps]
    task = Task(problem.problem_id, problem.description, "scicode", problem)
    family = sc.SciCodeFamily(targets=None)
    deps = {"dependencies": [{"step": ids[2], "depends_on": [ids[0], ids[1]]}]}  # ids[1] gets no parent
    prompts = []

    def encode(messages):
        prompts.append(messages)
        return [len(prompts)]

    def generate(requests):
        return [Completion([1], json.dumps(deps)[len('{"dependencies": ['):], np.zeros(1, np.float32), "eos", 1)
                for _ in requests]

    orch = Orchestrator({"scicode": family}, None, generate, None, encode,
                        OrchestratorConfig(mode="eval", variant="none", fixed_plan_dependencies="planner",
                                           planner_prefix='{"nodes": ['))
    plan = orch.plan([task])[task.task_id]
    assert [n.id for n in plan.nodes] == [n.id for n in family.fixed_plan(task).nodes]
    assert plan.nodes[1].depends_on == (ids[0],) and plan.nodes[2].depends_on == (ids[0], ids[1])
    assert plan.is_join(ids[2])
    (asked,) = prompts
    assert all(f"Step ID: {i}" in asked[-2]["content"] for i in ids)  # the dependency prompt lists the steps
    branches = [f"def branch_{k}():\n    return {k}\n" for k in range(2)]
    merge = family.merge_messages(task, plan.nodes[2], branches)
    assert all(b.strip() in merge[-1]["content"] for b in branches)
    merged = "```python\n" + "".join(branches) + "```"
    execute = family.execute_messages(task, plan.nodes[2], merged, None)
    assert all(b.strip() in execute[-1]["content"] for b in branches)
