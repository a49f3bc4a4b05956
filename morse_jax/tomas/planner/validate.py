"""Planner: parsed JSON -> validated, repaired DAG (:func:`validate_plan`), and input checks.

Split out of :mod:`morse_jax.tomas.planner.loop` (one concept per module), which re-exports the
public names defined here.

* Node-list aliases: ``subtasks``, ``steps`` or ``tasks`` are accepted when ``nodes`` is
  absent and exactly one alias holds a list; two aliases at once is an error (ambiguous).
* Repairs (each recorded in ``Plan.repairs`` and logged on ``morse_jax.planner``): unknown
  dependency dropped; self-dependency dropped; repeated dependency de-duplicated;
  ``depends_on`` given as a string (comma-separated ids) or a single int turned into a list;
  ``dependencies``/``deps``/``parents`` accepted for ``depends_on``; missing title derived
  from the description; each cycle broken by removing the back edge that the depth-first
  search (roots and children in the model's node order) meets first, repeated until acyclic.
* Errors (``PlanValidationError``): no node list, zero nodes or a count outside
  [min_nodes, max_nodes], a node that is not an object, missing/empty/duplicate id, empty or
  non-string description, a ``depends_on`` of another type. With ``repair=False`` (used for
  user-written plan files) every repair above is an error instead.
"""

from __future__ import annotations

import logging
from typing import Any, Mapping, Sequence

import networkx as nx

from morse_jax.tasks.plan import Plan, PlanNode, derive_title

logger = logging.getLogger("morse_jax.planner")

NODE_LIST_ALIASES = ("subtasks", "steps", "tasks")
DEPENDS_ALIASES = ("dependencies", "deps", "parents")


class PlanValidationError(ValueError):
    """A JSON plan violates the schema or the DAG rules; the message names the node and field."""


# ---------------------------------------------------------------------------------------------
# Input checks


def check_bounds(min_nodes: int, max_nodes: int | None) -> None:
    """Raise ValueError unless 1 <= min_nodes <= max_nodes (max_nodes None = unbounded)."""
    if not isinstance(min_nodes, int) or min_nodes < 1:
        raise ValueError(f"min_nodes must be an int >= 1, got {min_nodes!r}")
    if max_nodes is not None and (not isinstance(max_nodes, int) or max_nodes < min_nodes):
        raise ValueError(f"max_nodes must be an int >= min_nodes ({min_nodes}), got {max_nodes!r}")


# ---------------------------------------------------------------------------------------------
# Validation and repair


class RepairLog:
    """Collects repairs (``notes``, each logged), or turns each into a PlanValidationError when
    repairs are not allowed. Shared by :func:`validate_plan` and the fixed-node planner."""

    def __init__(self, allow: bool):
        self.allow, self.notes = allow, []

    def __call__(self, note: str) -> None:
        if not self.allow:
            raise PlanValidationError(note + " (repairs are disabled)")
        self.notes.append(note)
        logger.info("plan repair: %s", note)


def _coerce_id(value: Any, where: str) -> str:
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        raise PlanValidationError(f"{where}: must be a string or an int, got {value!r:.60}")
    out = str(value).strip()
    if not out:
        raise PlanValidationError(f"{where}: is empty")
    return out


def _node_list(obj: Any, fix: RepairLog) -> list:
    if isinstance(obj, list):
        return obj
    if not isinstance(obj, Mapping):
        raise PlanValidationError(f"plan must be a JSON object with a 'nodes' list, got {type(obj).__name__}")
    if "nodes" in obj:
        key = "nodes"
    else:
        present = [k for k in NODE_LIST_ALIASES if isinstance(obj.get(k), list)]
        if len(present) > 1:
            raise PlanValidationError(f"plan has no 'nodes' and several candidate lists {present}: ambiguous")
        if not present:
            raise PlanValidationError(f"plan has no 'nodes' list (keys found: {sorted(map(str, obj))[:10]})")
        key = present[0]
        fix(f"read the node list from key {key!r} instead of 'nodes'")
    if not isinstance(obj[key], list):
        raise PlanValidationError(f"field {key!r} must be a list of nodes, got {type(obj[key]).__name__}")
    return obj[key]


def _raw_deps(raw: Mapping, nid: str, fix: RepairLog) -> list[str]:
    where = f"node {nid!r}: field 'depends_on'"
    if "depends_on" in raw:
        deps = raw["depends_on"]
    else:
        present = [k for k in DEPENDS_ALIASES if k in raw]
        if len(present) > 1:
            raise PlanValidationError(f"node {nid!r}: several dependency fields {present}: ambiguous")
        deps = raw[present[0]] if present else None
        if present:
            fix(f"node {nid!r}: read dependencies from field {present[0]!r}")
    if deps is None:
        return []
    if isinstance(deps, str):
        parts = [p.strip() for p in deps.split(",") if p.strip()]
        fix(f"{where} was the string {deps!r}; read it as the list {parts}")
        return parts
    if isinstance(deps, int) and not isinstance(deps, bool):
        fix(f"{where} was the number {deps}; read it as the list ['{deps}']")
        return [str(deps)]
    if not isinstance(deps, list):
        raise PlanValidationError(f"{where} must be a list of ids, got {type(deps).__name__}")
    return [_coerce_id(d, f"{where}[{j}]") for j, d in enumerate(deps)]


def _find_back_edge(order: Sequence[str], children: Mapping[str, list[str]]):
    """First back edge (u, v) of a DFS over parent->child edges in node order, with its cycle."""
    color = dict.fromkeys(order, 0)  # 0 unseen, 1 on the DFS path, 2 finished
    for root in order:
        if color[root]:
            continue
        color[root], path, stack = 1, [root], [iter(children[root])]
        while stack:
            for child in stack[-1]:
                if color[child] == 1:
                    return path[-1], child, path[path.index(child):] + [child]
                if color[child] == 0:
                    color[child] = 1
                    path.append(child)
                    stack.append(iter(children[child]))
                    break
            else:
                color[path.pop()] = 2
                stack.pop()
    return None


def validate_plan(
    obj: Any, *, min_nodes: int = 2, max_nodes: int | None = 8, repair: bool = True
) -> Plan:
    """Parsed JSON -> :class:`Plan` with nodes in stable topological order (ties: input order).

    Args:
      obj: ``{"nodes": [...]}`` (or an alias, or the list itself), as parsed from JSON.
      min_nodes, max_nodes: allowed node count (max_nodes None = unbounded).
      repair: apply the repairs listed in the module docstring; if False each is an error.
    Raises: PlanValidationError naming the node and field.
    """
    check_bounds(min_nodes, max_nodes)
    fix = RepairLog(repair)
    raw_nodes = _node_list(obj, fix)
    if not raw_nodes:
        raise PlanValidationError("plan has zero nodes")
    if len(raw_nodes) < min_nodes or (max_nodes is not None and len(raw_nodes) > max_nodes):
        raise PlanValidationError(
            f"plan has {len(raw_nodes)} nodes; allowed is {min_nodes} to {max_nodes or 'any'}")
    ids, fields = [], []
    for i, raw in enumerate(raw_nodes):
        if not isinstance(raw, Mapping):
            raise PlanValidationError(f"nodes[{i}] must be an object, got {type(raw).__name__}")
        if "id" not in raw:
            raise PlanValidationError(f"nodes[{i}]: field 'id' is missing")
        nid = _coerce_id(raw["id"], f"nodes[{i}]: field 'id'")
        if nid in ids:
            raise PlanValidationError(f"nodes[{i}]: duplicate id {nid!r} (also nodes[{ids.index(nid)}])")
        ids.append(nid)
        desc = raw.get("description")
        if not isinstance(desc, str) or not desc.strip():
            raise PlanValidationError(f"node {nid!r}: field 'description' is missing, empty or not a string")
        title = raw.get("title")
        if title is not None and not isinstance(title, (str, int, float)):
            raise PlanValidationError(f"node {nid!r}: field 'title' must be a string")
        title = str(title).strip() if title is not None else ""
        if not title:
            title = derive_title(desc.strip())
            fix(f"node {nid!r}: title missing; derived {title!r} from the description")
        fields.append((title, desc.strip(), _raw_deps(raw, nid, fix)))
    known = set(ids)
    deps: dict[str, list[str]] = {}
    for nid, (_, _, raw_deps) in zip(ids, fields):
        kept = []
        for d in raw_deps:
            if d == nid:
                fix(f"node {nid!r}: dropped dependency on itself")
            elif d not in known:
                fix(f"node {nid!r}: dropped unknown dependency {d!r}")
            elif d in kept:
                fix(f"node {nid!r}: dropped repeated dependency {d!r}")
            else:
                kept.append(d)
        deps[nid] = kept
    while True:
        children: dict[str, list[str]] = {n: [] for n in ids}
        for nid in ids:
            for d in deps[nid]:
                children[d].append(nid)
        back = _find_back_edge(ids, children)
        if back is None:
            break
        u, v, cycle = back
        deps[v].remove(u)
        fix(f"node {v!r}: dropped dependency on {u!r} to break the cycle {' -> '.join(cycle)}")
    g = nx.DiGraph()
    g.add_nodes_from(ids)
    g.add_edges_from((d, n) for n in ids for d in deps[n])
    assert nx.is_directed_acyclic_graph(g)  # the loop above removed every back edge
    rank = {n: i for i, n in enumerate(ids)}
    order = list(nx.lexicographical_topological_sort(g, key=rank.__getitem__))
    nodes = {n: PlanNode(n, f[0], f[1], tuple(deps[n])) for n, f in zip(ids, fields)}
    return Plan(tuple(nodes[n] for n in order), tuple(fix.notes))
