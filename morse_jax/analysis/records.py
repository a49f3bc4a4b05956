"""Call records: the one input format of the analyses, and their extraction from run traces.

A record describes one agent call (an execute call or the merge call of a join node)::

    {"task_id": str, "node_id": str, "role": "execute" | "merge",
     "description": str,                 # the subtask description s_i
     "prompt": str | None,               # node-level prompt p_i (Eq. 1), None if not rendered
     "output": str | None,               # the node's output y_i (artifact), None if none
     "active_set": [[bank_id, weight]],  # the experts the call ran with ([] = no adapter)
     "route": [int],                     # router indices in [0, K_s) ([] = no router decision)
     "probs": [float] | None,            # pi(.|s_i), K_s floats, when the router decided
     "cluster": optional group label}

:func:`check_records` validates a list of them (naming the offending record and field);
:func:`records_from_traces` builds them from ``RunResult.traces`` (``morse_jax.tomas``).
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

ROLES = ("execute", "merge")
_REQUIRED = ("task_id", "node_id", "role", "description")


def check_records(records: Sequence[Mapping[str, Any]]) -> list[dict]:
    """Validate records and return them as plain dicts with defaults filled in.

    Raises ValueError / TypeError naming ``records[i].field`` for a missing or malformed field.
    """
    if isinstance(records, Mapping) or isinstance(records, (str, bytes)):
        raise TypeError("records must be a sequence of record dicts")
    out = []
    for i, r in enumerate(records):
        if not isinstance(r, Mapping):
            raise TypeError(f"records[{i}] must be a mapping, got {type(r).__name__}")
        for f in _REQUIRED:
            if f not in r:
                raise ValueError(f"records[{i}]: missing field {f!r}")
        if r["role"] not in ROLES:
            raise ValueError(f"records[{i}].role must be one of {ROLES}, got {r['role']!r}")
        for f in ("description", "prompt", "output"):
            if r.get(f) is not None and not isinstance(r[f], str):
                raise TypeError(f"records[{i}].{f} must be str or None, got {type(r[f]).__name__}")
        active = []
        for j, pair in enumerate(r.get("active_set") or ()):
            try:
                e, w = pair
                active.append((int(e), float(w)))
            except (TypeError, ValueError) as err:
                raise ValueError(f"records[{i}].active_set[{j}] must be (expert_id, weight), got {pair!r}") from err
        route = [int(k) for k in (r.get("route") or ())]
        probs = r.get("probs")
        if route and probs is None:
            raise ValueError(f"records[{i}]: has a route but no 'probs'")
        rec = {**dict(r), "task_id": str(r["task_id"]), "node_id": str(r["node_id"]),
               "prompt": r.get("prompt"), "output": r.get("output"), "active_set": active, "route": route,
               "probs": None if probs is None else [float(p) for p in probs]}
        out.append(rec)
    return out


def render_messages(messages: Sequence[Mapping[str, str]]) -> str:
    """A chat prompt as plain text: the messages' contents joined by blank lines (no template)."""
    return "\n\n".join(str(m["content"]) for m in messages)


def records_from_traces(traces: Mapping[str, Any], *, family: Any = None) -> list[dict]:
    """Records of every call that ran in ``traces`` ({task_id: TaskTrace}), in plan order.

    Args:
      traces: ``RunResult.traces``.
      family: the run's TaskFamily; when given, "prompt" is the rendered execute / merge prompt
        of the call (its first attempt, without a verifier diagnostic), else None.
    Blocked nodes (never run) give no record. An execute record's output is the propagated
    artifact, or the raw text of a node that failed every attempt.
    """
    out = []
    for task_id, tr in traces.items():
        for pn in tr.plan.nodes:
            nt = tr.nodes[pn.id]
            if nt.status == "blocked":
                continue
            parents = [tr.nodes[p].artifact or "" for p in pn.depends_on]
            ran_merge = nt.merge_attempts > 0 or nt.merge_text is not None or nt.merge_artifact is not None
            if ran_merge:
                out.append({
                    "task_id": task_id, "node_id": pn.id, "role": "merge", "description": pn.description,
                    "prompt": render_messages(family.merge_messages(tr.task, pn, parents)) if family else None,
                    "output": nt.merge_artifact if nt.merge_artifact is not None else nt.merge_text,
                    "active_set": [list(p) for p in nt.merge_active_set], "route": [], "probs": None})
            if nt.execute_attempts > 0 or nt.text is not None:
                probs = None if nt.route_probs is None else [float(p) for p in nt.route_probs]
                out.append({
                    "task_id": task_id, "node_id": pn.id, "role": "execute", "description": pn.description,
                    "prompt": (render_messages(family.execute_messages(tr.task, pn, nt.context or "", None))
                               if family else None),
                    "output": nt.artifact if nt.artifact is not None else nt.text,
                    "active_set": [list(p) for p in nt.active_set],
                    "route": [int(k) for k in nt.route] if probs is not None else [], "probs": probs})
    return out
