"""Planner prompts: the structured-output planning request and the re-planning request.

Split out of :mod:`morse_jax.tomas.planner.loop` (one concept per module), which re-exports the
public names defined here. The prompts are adapted from the authors' planner prompt
(appendix E); the reply is parsed by :mod:`~morse_jax.tomas.planner.json_object` and checked by
:mod:`~morse_jax.tomas.planner.validate`.
"""

from __future__ import annotations

import json
from typing import Callable, Sequence

from morse_jax.tasks.plan import check_text
from morse_jax.tomas.planner.validate import check_bounds

Message = dict[str, str]
GenerateFn = Callable[[list[Message]], str]

# The example description in the planning prompt; a plan that echoes it is rejected (by
# ``plan_task`` and the orchestrator's batched planning).
PLACEHOLDER_DESCRIPTION = "What to do and what it delivers."
_ECHO_CHARS = 1500  # how much of a rejected answer is echoed back when re-planning

# The system message of every planner request (planning and dependency inference).
PLANNER_SYSTEM = (
    "You are the planner of a multi-agent system. You decompose a task into a dependency graph "
    "(a DAG) of subtasks. Each subtask is carried out later by its own agent, which sees the task, "
    "its subtask description and the outputs of the subtasks it depends on."
)


def planner_messages(
    task_description: str,
    *,
    min_nodes: int = 2,
    max_nodes: int = 8,
    roles_hint: str | Sequence[str] | None = None,
) -> list[Message]:
    """Chat messages asking the backbone for ``{"nodes": [{id, title, description, depends_on}]}``.

    Adapted from the authors' structured-output planner prompt (appendix E: "the planner uses the
    same backbone with a structured-output prompt"): bounded node count, full coverage of the
    task's requirements, joins that must combine all their parents, JSON only.
    ``roles_hint``: optional domain guidance (a string or a list of rules) added to the rules.
    """
    task = check_text("task_description", task_description)
    check_bounds(min_nodes, max_nodes)
    span = f"{min_nodes}" if min_nodes == max_nodes else f"{min_nodes} to {max_nodes}"
    rules = [
        "Together the descriptions must cover every requirement and detail stated in the task; "
        "make clear which subtask handles each requirement.",
        "Dependencies must form a DAG: refer only to ids of this plan, never to the subtask itself, "
        "and never in a cycle.",
        "Add a dependency only where a subtask really needs that output; independent subtasks may "
        "run in parallel.",
        "A subtask with several dependencies must use and combine the concrete outputs of all of them.",
        "A subtask that several others depend on must produce what they need to proceed consistently.",
    ]
    if isinstance(roles_hint, str) and roles_hint.strip():
        rules.append(roles_hint.strip())
    elif roles_hint is not None and not isinstance(roles_hint, str):
        rules.extend(str(r).strip() for r in roles_hint if str(r).strip())
    example = {"nodes": [
        {"id": "n1", "title": "Short action", "description": PLACEHOLDER_DESCRIPTION, "depends_on": []},
        {"id": "n2", "title": "Short action", "description": PLACEHOLDER_DESCRIPTION, "depends_on": ["n1"]},
    ]}
    user = "\n".join([
        f"Decompose the task below into {span} subtasks. For every subtask give:",
        '- "id": a short unique identifier ("n1", "n2", ...)',
        '- "title": a concise action of a few words',
        '- "description": one or two sentences: the work and the concrete intermediate deliverable',
        '- "depends_on": the ids of the subtasks whose outputs it needs ([] for a starting subtask)',
        "",
        "Rules:",
        *(f"- {r}" for r in rules),
        "",
        "Answer with one JSON object only, with no markdown fences and no text before or after it, "
        "in exactly this shape (the content is a placeholder):",
        json.dumps(example),
        "",
        "Task:",
        task,
    ])
    return [{"role": "system", "content": PLANNER_SYSTEM}, {"role": "user", "content": user}]


def replan_messages(base: list[Message], previous: str, error: str) -> list[Message]:
    """The original request, the rejected answer (truncated) and the reason it was rejected."""
    prev = previous if len(previous) <= _ECHO_CHARS else previous[:_ECHO_CHARS] + " [...]"
    fix = (f"That answer was rejected: {error}\nReply again with the complete corrected plan as "
           "one JSON object only.")
    return [*base, {"role": "assistant", "content": prev}, {"role": "user", "content": fix}]
