"""Batched planning: every task's plan in rounds of one model call each (the orchestrator's first phase).

A family's ``fixed_plan`` (SciCode: its steps as a chain) is used as is, or, with
``fixed_plan_dependencies="planner"``, its nodes are kept and the planner infers their edges from
the step descriptions. Families without a fixed plan get a planner-made DAG. All planner requests
of a round go to the model in one batch; a rejected answer is re-asked in the next round with the
answer and the reason (``replan_messages``); after ``max_replans`` rejections a task falls back to
a single node (or keeps its fixed plan's edges), the reason in ``Plan.repairs`` and the log.

Split out of :mod:`morse_jax.tomas.orchestrator` (one concept per module). The single-task loop
with the same rules is :func:`morse_jax.tomas.planner.loop.plan_task`.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Callable, Mapping

from morse_jax.tasks.base import Task, TaskFamily
from morse_jax.tasks.plan import Plan, PlanNode
from morse_jax.tomas.config import OrchestratorConfig
from morse_jax.tomas.planner.fixed import (DEPENDENCIES_PREFIX, dependencies_plan, infer_dependencies_messages,
                                           with_dependencies_of)
from morse_jax.tomas.planner.json_object import extract_json_object
from morse_jax.tomas.planner.loop import single_node_plan
from morse_jax.tomas.planner.prompts import PLACEHOLDER_DESCRIPTION, planner_messages, replan_messages
from morse_jax.tomas.planner.validate import NODE_LIST_ALIASES, PlanValidationError, validate_plan
from morse_jax.tomas.trace import RunCounters

logger = logging.getLogger("morse_jax.orchestrator")

# One planning round: the chat messages of each request (each ending with its assistant-turn
# start when there is one) -> the model's completion text of each, in order.
CompleteFn = Callable[[list[list[dict]]], list[str]]


def check_plan(plan: Plan, where: str) -> None:
    """Raise ValueError unless ``plan`` is a non-empty DAG with nodes in topological order."""
    if not isinstance(plan, Plan):
        raise ValueError(f"{where}: must be a Plan, got {type(plan).__name__}")
    if not plan.nodes:
        raise ValueError(f"{where}: the plan has no nodes")
    seen: set[str] = set()
    for n in plan.nodes:
        if not isinstance(n, PlanNode) or not n.id or n.id in seen:
            raise ValueError(f"{where}: node {getattr(n, 'id', n)!r} is not a PlanNode with a unique id")
        for p in n.depends_on:
            if p not in seen:
                raise ValueError(f"{where}: node {n.id!r} depends on {p!r}, which is not an earlier node")
        seen.add(n.id)


def planner_start(config: OrchestratorConfig, fixed: Plan | None) -> str:
    """The planner answer's given start: ``planner_prefix``, or its dependency-list counterpart."""
    if not config.planner_prefix:
        return ""
    return config.planner_prefix if fixed is None else DEPENDENCIES_PREFIX


def parse_dependencies(text: str, fixed: Plan) -> Plan:
    """``fixed``'s nodes with the dependencies the model's ``text`` gives; ValueError if unusable."""
    inferred = dependencies_plan(text, [(n.id, n.description) for n in fixed.nodes])
    plan = with_dependencies_of(fixed, inferred)
    check_plan(plan, "inferred dependencies")
    return plan


def parse_plan(text: str, config: OrchestratorConfig) -> Plan:
    """The validated, repaired plan in the model's ``text``; ValueError (PlanParseError /
    PlanValidationError) when there is none or it echoes the prompt's placeholder."""
    obj = extract_json_object(text, prefer_keys=("nodes", *NODE_LIST_ALIASES))
    plan = validate_plan(obj, min_nodes=config.min_nodes, max_nodes=config.max_nodes)
    if any(n.description == PLACEHOLDER_DESCRIPTION for n in plan.nodes):
        raise PlanValidationError("the plan copies the placeholder example instead of planning the task")
    return plan


def plan_tasks(tasks: list[Task], plans: dict[str, Plan], families: Mapping[str, TaskFamily],
               config: OrchestratorConfig, complete: CompleteFn, counters: RunCounters) -> dict[str, Plan]:
    """task_id -> Plan for ``tasks`` (in their order): given ``plans`` checked and kept, the
    single-agent plan in single-agent mode, else the fixed or planner-made plan (module docstring).

    ``complete`` runs one planning round; ``counters`` gets the rounds, requests, re-plans and
    fallbacks.
    """
    cfg, out, todo = config, {}, []
    if cfg.single_agent and plans:
        raise ValueError("plans: explicit plans cannot be combined with single_agent mode")
    for t in tasks:
        fam = families[t.family]
        if t.task_id in plans:
            check_plan(plans[t.task_id], f"plans[{t.task_id!r}]")
            out[t.task_id] = plans[t.task_id]
        elif cfg.single_agent:
            make = getattr(fam, "single_agent_plan", None)
            out[t.task_id] = make(t) if callable(make) else single_node_plan(t.description)
            check_plan(out[t.task_id], f"single-agent plan of task {t.task_id!r}")
        else:
            fixed = fam.fixed_plan(t)
            if fixed is not None:
                check_plan(fixed, f"fixed plan of task {t.task_id!r}")
                if cfg.fixed_plan_dependencies == "planner" and len(fixed.nodes) > 1:
                    todo.append((t, fixed))  # the planner infers the edges among the fixed steps
                else:
                    out[t.task_id] = fixed
            else:
                todo.append((t, None))
    # task_id -> (base messages, current messages, rejection notes, fixed plan or None)
    pending = {}
    for t, fixed in todo:
        if fixed is None:
            base = planner_messages(t.description, min_nodes=cfg.min_nodes, max_nodes=cfg.max_nodes,
                                    roles_hint=getattr(families[t.family], "planner_hint", None))
        else:
            base = infer_dependencies_messages(t.description, [(n.id, n.description) for n in fixed.nodes])
        pending[t.task_id] = (base, base, [], fixed)
    for rnd in range(1, cfg.max_replans + 2):
        if not pending:
            break
        order = list(pending)
        starts = {tid: planner_start(cfg, pending[tid][3]) for tid in order}
        batch = [[*pending[i][1], *([{"role": "assistant", "content": starts[i]}] if starts[i] else [])]
                 for i in order]
        counters.planner_rounds += 1
        counters.planner_requests.append(len(batch))
        if rnd > 1:
            counters.replans += len(batch)
        texts = complete(batch)
        for tid, comp_text in zip(order, texts):
            base, _, notes, fixed = pending[tid]
            text = starts[tid] + comp_text
            try:
                plan = parse_plan(text, cfg) if fixed is None else parse_dependencies(text, fixed)
            except ValueError as e:  # PlanParseError / PlanValidationError
                note = f"planner attempt {rnd} rejected: {e}"
                logger.warning("task %s: %s", tid, note)
                pending[tid] = (base, replan_messages(base, text, str(e)), notes + [note], fixed)
                continue
            for r in plan.repairs:
                logger.info("task %s: plan repair: %s", tid, r)
            out[tid] = dataclasses.replace(plan, repairs=(*notes, *plan.repairs))
            del pending[tid]
    by_id = {t.task_id: t for t in tasks}
    for tid, (_, _, notes, fixed) in pending.items():
        counters.plan_fallbacks += 1
        if fixed is None:
            note = f"fell back to a single-node plan after {cfg.max_replans + 1} rejected planner attempts"
            out[tid] = single_node_plan(by_id[tid].description, [*notes, note])
        else:
            note = (f"kept the fixed plan's dependencies after {cfg.max_replans + 1} rejected "
                    "dependency-planner attempts")
            out[tid] = dataclasses.replace(fixed, repairs=(*fixed.repairs, *notes, note))
        logger.warning("task %s: %s", tid, note)
    return {t.task_id: out[t.task_id] for t in tasks}
