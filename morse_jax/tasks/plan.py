"""Plan data types: a DAG of subtasks. Validation and repair live in ``planner_validate.py`` (re-exported by ``planner.py``)."""

from __future__ import annotations

import dataclasses
from typing import Sequence

import networkx as nx


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
