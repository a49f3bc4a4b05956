"""Plan data types: a DAG of subtasks, and the checks and constructors shared by planners and families.

This is the lowest layer that speaks of plans: task families (``tasks/``) build their fixed plans
here (:func:`step_chain_plan`), and the planner (``morse_jax.tomas.planner``), which turns model
text into a :class:`Plan`, builds on the same checks (:func:`check_text`, :func:`check_steps`,
:func:`derive_title`). Validation and repair of model output live in
:mod:`morse_jax.tomas.planner.validate`.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Sequence

import networkx as nx

_TITLE_CHARS = 60


@dataclasses.dataclass(frozen=True)
class PlanNode:
    """One subtask node i: id, short title, description s_i and parents Pa(i)."""

    id: str
    title: str
    description: str
    depends_on: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class Plan:
    """A validated DAG G = (V, E). ``nodes`` are in a topological order."""

    nodes: tuple[PlanNode, ...]
    repairs: tuple[str, ...] = ()  # human-readable log of repairs applied while parsing

    def node(self, node_id: str) -> PlanNode:
        for n in self.nodes:
            if n.id == node_id:
                return n
        raise KeyError(f"plan has no node {node_id!r}")

    def graph(self) -> nx.DiGraph:
        g = nx.DiGraph()
        for n in self.nodes:
            g.add_node(n.id)
            for p in n.depends_on:
                g.add_edge(p, n.id)
        return g

    def parents(self, node_id: str) -> tuple[str, ...]:
        return self.node(node_id).depends_on

    def is_join(self, node_id: str) -> bool:
        """Nodes with two or more parents get a merge call before their execute call."""
        return len(self.node(node_id).depends_on) > 1

    @staticmethod
    def chain(nodes: Sequence[PlanNode]) -> "Plan":
        """A linear plan where each node depends on the previous one."""
        out, prev = [], None
        for n in nodes:
            out.append(dataclasses.replace(n, depends_on=(prev,) if prev else ()))
            prev = n.id
        return Plan(tuple(out))


def check_text(name: str, value: Any) -> str:
    """``value`` stripped; raises ValueError naming ``name`` unless it is a non-empty string."""
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"{name} must be a non-empty string, got {value!r:.80}")
    return value.strip()


def derive_title(description: str) -> str:
    """A node title from its description: the first sentence (or line), at most 60 characters."""
    first = re.split(r"(?<=[.!?])\s|\n", description, maxsplit=1)[0].strip()
    return first if len(first) <= _TITLE_CHARS else first[: _TITLE_CHARS - 3].rstrip() + "..."


def check_steps(steps: Sequence[tuple[str, str]]) -> list[tuple[str, str]]:
    """Fixed steps as checked ``(step_id, description)`` pairs (stripped, unique ids, in order);
    raises ValueError naming the bad entry."""
    if isinstance(steps, (str, bytes)) or not isinstance(steps, Sequence) or not steps:
        raise ValueError("steps must be a non-empty sequence of (step_id, description) pairs")
    out, seen = [], set()
    for i, st in enumerate(steps):
        if not isinstance(st, (tuple, list)) or len(st) != 2:
            raise ValueError(f"steps[{i}] must be a (step_id, description) pair, got {st!r:.60}")
        sid = check_text(f"steps[{i}] step_id", st[0])
        if sid in seen:
            raise ValueError(f"steps[{i}]: duplicate step_id {sid!r}")
        seen.add(sid)
        out.append((sid, check_text(f"steps[{i}] description", st[1])))
    return out


def step_chain_plan(steps: Sequence[tuple[str, str]]) -> Plan:
    """The chain plan for fixed steps (e.g. SciCode's sub-steps): each step depends on the previous one."""
    return Plan.chain([PlanNode(s, derive_title(d), d) for s, d in check_steps(steps)])
