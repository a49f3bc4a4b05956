"""Planner for fixed nodes (SciCode sub-steps): the chain, or dependencies inferred by the model.

Split out of :mod:`morse_jax.tomas.planner.loop` (one concept per module), which re-exports the
public names defined here. The steps themselves are given; only the edges are planned, and a
bad reply degrades edge by edge (or to the chain, :func:`~morse_jax.tasks.plan.step_chain_plan`),
never to an error.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Mapping, Sequence

from morse_jax.tasks.plan import Plan, PlanNode, check_steps, check_text, derive_title, step_chain_plan
from morse_jax.tomas.planner.json_object import extract_json_object
from morse_jax.tomas.planner.prompts import PLANNER_SYSTEM, GenerateFn, Message
from morse_jax.tomas.planner.validate import RepairLog

logger = logging.getLogger("morse_jax.planner")


def infer_dependencies_messages(task_description: str, steps: Sequence[tuple[str, str]]) -> list[Message]:
    """Messages asking which earlier steps each fixed step needs (the authors' SciCode prompt, adapted)."""
    task, steps = check_text("task_description", task_description), check_steps(steps)
    blocks = "\n\n-----\n\n".join(f"Step ID: {s}\n{d}" for s, d in steps)
    user = "\n".join([
        "The task below is already decomposed into ordered steps. Infer only the dependency links "
        "among these steps.",
        "- Do not rewrite, rename or merge steps; use only the listed step ids.",
        "- A step can depend only on steps listed before it.",
        "- Give direct prerequisites only (no redundant transitive ones); prefer a sparse DAG.",
        "Answer with one JSON object only, no markdown and no explanation, in exactly this shape:",
        '{"dependencies": [{"step": "<step id>", "depends_on": ["<step id>", "..."]}]}',
        "", "Task:", task, "", "Ordered steps:", blocks,
    ])
    return [{"role": "system", "content": PLANNER_SYSTEM}, {"role": "user", "content": user}]


def _dependency_rows(obj: Mapping) -> dict[str, Any]:
    """{step id: raw depends_on} from the accepted shapes; raises ValueError otherwise."""
    rows = obj.get("dependencies", obj.get("nodes"))
    if isinstance(rows, Mapping):
        return {str(k).strip(): v for k, v in rows.items()}
    if not isinstance(rows, list):
        raise ValueError("no 'dependencies' list or mapping")
    out = {}
    for j, row in enumerate(rows):
        if not isinstance(row, Mapping):
            raise ValueError(f"dependencies[{j}] is not an object")
        sid = row.get("step", row.get("id"))
        if isinstance(sid, bool) or not isinstance(sid, (str, int)):
            raise ValueError(f"dependencies[{j}] has no step id")
        out[str(sid).strip()] = row.get("depends_on", [])
    return out


DEPENDENCIES_PREFIX = '{"dependencies": ['  # the answer start that matches the prompt's JSON shape


def dependencies_plan(text: str, steps: Sequence[tuple[str, str]]) -> Plan:
    """Plan over the fixed steps with the model's dependencies; raises ValueError (a
    PlanParseError among them) when the reply has no usable dependency JSON.

    Edge-level problems (unknown, self, later or repeated step, bad id type) drop the edge; a
    step after the first that ends with no parent is attached to its predecessor, as in the
    reference implementation, so every later step sees upstream code. All recorded in repairs.
    """
    steps = check_steps(steps)
    order = [s for s, _ in steps]
    rows = _dependency_rows(extract_json_object(text, prefer_keys=("dependencies",)))
    fix, nodes = RepairLog(True), []
    for extra in sorted(set(rows) - set(order)):
        fix(f"ignored dependencies given for unknown step {extra!r}")
    for i, (sid, desc) in enumerate(steps):
        raw = rows.get(sid, [])
        raw = [raw] if isinstance(raw, (str, int)) and not isinstance(raw, bool) else raw
        if not isinstance(raw, list):
            fix(f"step {sid!r}: depends_on is not a list; ignored")
            raw = []
        kept = []
        for d in raw:
            d = str(d).strip() if isinstance(d, (str, int)) and not isinstance(d, bool) else None
            if d in order[:i] and d not in kept:
                kept.append(d)
            else:
                fix(f"step {sid!r}: dropped dependency {d!r} (unknown, repeated, itself or a later step)")
        if i > 0 and not kept:
            kept = [order[i - 1]]
            fix(f"step {sid!r}: no earlier step given; attached to its predecessor {order[i - 1]!r}")
        nodes.append(PlanNode(sid, derive_title(desc), desc, tuple(kept)))
    return Plan(tuple(nodes), tuple(fix.notes))


def with_dependencies_of(fixed: Plan, inferred: Plan) -> Plan:
    """``fixed``'s nodes (ids, titles, descriptions unchanged) with ``inferred``'s edges and repairs."""
    deps = {n.id: n.depends_on for n in inferred.nodes}
    if set(deps) != {n.id for n in fixed.nodes}:
        raise ValueError("the inferred plan's steps differ from the fixed plan's")
    return Plan(tuple(dataclasses.replace(n, depends_on=tuple(deps[n.id])) for n in fixed.nodes),
                (*fixed.repairs, *inferred.repairs))


def parse_inferred_dependencies(text: str, steps: Sequence[tuple[str, str]]) -> Plan:
    """:func:`dependencies_plan`, or the chain (with the reason in repairs) when the reply is unusable."""
    try:
        return dependencies_plan(text, steps)
    except ValueError as e:
        note = f"dependency inference unusable ({e}); used the step chain"
        logger.warning(note)
        return dataclasses.replace(step_chain_plan(steps), repairs=(note,))


def plan_with_fixed_nodes(
    task_description: str, steps: Sequence[tuple[str, str]], generate_fn: GenerateFn
) -> Plan:
    """One model call to infer dependencies among fixed steps; the chain if that fails."""
    return parse_inferred_dependencies(generate_fn(infer_dependencies_messages(task_description, steps)), steps)
