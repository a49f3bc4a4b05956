"""Planner: task description -> chat prompt -> model text -> validated, repaired DAG (``Plan``).

The model's output is untrusted text. ``extract_json_object`` finds the JSON in it,
``validate_plan`` turns it into a :class:`Plan` (strict checks, plus a few repairs whose
outcome is unambiguous), and ``plan_task`` wraps both with bounded re-planning and a final
single-node fallback, so no model output can crash the orchestrator.

This module holds the planning loop (:func:`plan_task`, :func:`single_node_plan`,
:func:`load_plan_file`) and :func:`render_plan`, and re-exports the public names of the modules
it is built from, one concept each (split to keep files under ~500 lines):

* :mod:`~morse_jax.tomas.planner.prompts` -- the planning and re-planning prompts
  (``planner_messages``, ``replan_messages``).
* :mod:`~morse_jax.tomas.planner.json_object` -- the JSON in model output (``extract_json_object``,
  ``PlanParseError``); its docstring lists the parsing choices.
* :mod:`~morse_jax.tomas.planner.validate` -- schema, DAG rules and repairs (``validate_plan``,
  ``PlanValidationError``); its docstring lists every repair and error.
* :mod:`~morse_jax.tomas.planner.fixed` -- dependencies over fixed nodes, SciCode's sub-steps
  (``plan_with_fixed_nodes``, ``parse_inferred_dependencies``); the chain over fixed steps is
  :func:`morse_jax.tasks.plan.step_chain_plan` (families build it without the planner).

All of them log on the one logger ``morse_jax.planner``. Re-exported names are the same objects,
but code reads them from the module that defines them: to monkeypatch one, patch that module.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path
from typing import Sequence

from morse_jax.tasks.plan import Plan, PlanNode, check_text, derive_title
from morse_jax.tomas.planner.fixed import (infer_dependencies_messages, parse_inferred_dependencies,
                                           plan_with_fixed_nodes)
from morse_jax.tomas.planner.json_object import PlanParseError, extract_json_object
from morse_jax.tomas.planner.prompts import (PLACEHOLDER_DESCRIPTION, GenerateFn, Message, planner_messages,
                                             replan_messages)
from morse_jax.tomas.planner.validate import (DEPENDS_ALIASES, NODE_LIST_ALIASES, PlanValidationError,
                                              validate_plan)

__all__ = [  # defined here, then re-exported from the modules this one is built from
    "single_node_plan", "plan_task", "load_plan_file", "render_plan",
    "planner_messages", "replan_messages", "GenerateFn", "Message",
    "extract_json_object", "PlanParseError",
    "validate_plan", "PlanValidationError", "NODE_LIST_ALIASES", "DEPENDS_ALIASES",
    "infer_dependencies_messages", "parse_inferred_dependencies", "plan_with_fixed_nodes",
]

logger = logging.getLogger("morse_jax.planner")


# ---------------------------------------------------------------------------------------------
# Planning with the backbone


def single_node_plan(task_description: str, repairs: Sequence[str] = ()) -> Plan:
    """The fallback: one node whose description is the whole task."""
    task = check_text("task_description", task_description)
    return Plan((PlanNode("n1", derive_title(task), task, ()),), tuple(repairs))


def plan_task(
    task_description: str,
    generate_fn: GenerateFn,
    *,
    min_nodes: int = 2,
    max_nodes: int = 8,
    max_replans: int = 2,
    roles_hint: str | Sequence[str] | None = None,
    log: logging.Logger | None = None,
) -> Plan:
    """Ask the backbone for a plan; re-plan on bad output; fall back to a single node.

    ``generate_fn(messages) -> str`` is the model call (the sampler with the backbone). Each
    rejected attempt is re-asked with the rejected answer and the reason. After
    ``1 + max_replans`` failures the result is :func:`single_node_plan`. Rejections, the
    fallback and repairs are all in ``Plan.repairs`` and logged on ``log`` (default
    ``morse_jax.planner``). Exceptions raised by ``generate_fn`` itself propagate.
    """
    log = log or logger
    if not isinstance(max_replans, int) or max_replans < 0:
        raise ValueError(f"max_replans must be an int >= 0, got {max_replans!r}")
    base = planner_messages(task_description, min_nodes=min_nodes, max_nodes=max_nodes,
                            roles_hint=roles_hint)
    messages, notes = base, []
    for attempt in range(1, max_replans + 2):
        text = generate_fn(messages)
        if not isinstance(text, str):
            raise TypeError(f"generate_fn must return a str, got {type(text).__name__}")
        try:
            plan = validate_plan(extract_json_object(text, prefer_keys=("nodes", *NODE_LIST_ALIASES)),
                                 min_nodes=min_nodes, max_nodes=max_nodes)
            if any(n.description == PLACEHOLDER_DESCRIPTION for n in plan.nodes):
                raise PlanValidationError("the plan copies the placeholder example instead of planning the task")
        except ValueError as e:  # PlanParseError / PlanValidationError
            note = f"planner attempt {attempt} rejected: {e}"
            notes.append(note)
            log.warning(note)
            messages = replan_messages(base, text, str(e))
            continue
        return dataclasses.replace(plan, repairs=(*notes, *plan.repairs))
    note = f"fell back to a single-node plan after {max_replans + 1} rejected planner attempts"
    log.warning(note)
    return single_node_plan(task_description, [*notes, note])


def load_plan_file(path: str | Path, *, min_nodes: int = 1, max_nodes: int | None = None) -> Plan:
    """A user-written plan (JSON ``{"nodes": [...]}``), validated strictly: repairs are errors.

    Raises FileNotFoundError, or PlanValidationError whose message starts with the file path.
    """
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise FileNotFoundError(f"plan file {str(path)!r} does not exist") from None
    try:
        obj = json.loads(text)
    except ValueError as e:
        raise PlanValidationError(f"{path}: not valid JSON: {e}") from None
    try:
        return validate_plan(obj, min_nodes=min_nodes, max_nodes=max_nodes, repair=False)
    except PlanValidationError as e:
        raise PlanValidationError(f"{path}: {e}") from None


# ---------------------------------------------------------------------------------------------
# Rendering


def render_plan(plan: Plan) -> str:
    """Readable text rendering of the DAG: order, ids, titles, parents, joins, repairs."""
    n_edges = sum(len(n.depends_on) for n in plan.nodes)
    joins = [n.id for n in plan.nodes if plan.is_join(n.id)]
    lines = [f"Plan: {len(plan.nodes)} nodes, {n_edges} edges, {len(joins)} join(s)"]
    width = max(len(n.id) for n in plan.nodes) if plan.nodes else 0
    for k, n in enumerate(plan.nodes, 1):
        tag = f"   [join: merge of {', '.join(n.depends_on)}]" if plan.is_join(n.id) else ""
        lines.append(f"{k:>3}. {n.id:<{width}}  {n.title}{tag}")
        lines.append(f"     {'':<{width}}  after: {', '.join(n.depends_on) or '(root)'}")
    if plan.repairs:
        lines.append("Repairs:")
        lines.extend(f"  - {r}" for r in plan.repairs)
    return "\n".join(lines)
