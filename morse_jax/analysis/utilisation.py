"""Router utilisation in the layout of paper Table 5 (App. J, "Router utilization").

From the routed execute calls of a run (one routing record each) it reports, for the K_s subtask
experts and top-k routing:

* per expert: share of subtasks whose route contains it ("Selected in top-2"; these shares sum
  to k, not 1), its normalised slot share (sums to 1), and its mean routing probability pi_k;
* per expert set (every k-subset, unused ones included): share of subtasks (sums to 1);
* soft routing entropy: mean over subtasks of H(pi(.|s_i)) in nats (paper: 1.374, max ln K_s);
* realised utilisation entropy: H of the slot shares (paper: 1.009; ln k = a fixed set);
* mean max-probability, the most common set and its share, whether every expert is used.

A routing record is a mapping with "route" (router expert indices in [0, K_s), one per top-k
slot) and "probs" (pi(.|s_i), K_s floats). Records without a router decision (merge calls,
variants without a router: "route" empty or missing) are counted in "skipped", never used.
"""

from __future__ import annotations

import itertools
import math
from typing import Any, Mapping, Sequence

import numpy as np


def _entropy(p: np.ndarray) -> np.ndarray:
    """Shannon entropy in nats along the last axis (0 log 0 = 0)."""
    p = np.asarray(p, np.float64)
    return -np.sum(np.where(p > 0, p * np.log(np.where(p > 0, p, 1.0)), 0.0), axis=-1)


def _routed(records: Sequence[Mapping[str, Any]], num_subtask: int | None) -> tuple[np.ndarray, np.ndarray, int]:
    """-> (routes int[n, k], probs float64[n, K_s], skipped)."""
    routes, probs, skipped = [], [], 0
    for i, r in enumerate(records):
        route = r.get("route")
        if route is None or len(route) == 0:
            skipped += 1
            continue
        if r.get("probs") is None:
            raise ValueError(f"records[{i}]: has a route but no 'probs' (the routing distribution)")
        route = [int(k) for k in route]
        p = np.asarray(r["probs"], np.float64).reshape(-1)
        ks = num_subtask if num_subtask is not None else len(p)
        if len(p) != ks:
            raise ValueError(f"records[{i}].probs: expected {ks} probabilities, got {len(p)}")
        if not np.all(np.isfinite(p)) or np.any(p < 0) or abs(p.sum() - 1.0) > 1e-3:
            raise ValueError(f"records[{i}].probs must be a probability vector, got {p.tolist()}")
        if any(not 0 <= k < ks for k in route) or len(set(route)) != len(route):
            raise ValueError(f"records[{i}].route must hold distinct expert indices in [0, {ks}), got {route}")
        if routes and len(route) != len(routes[0]):
            raise ValueError(f"records[{i}].route has {len(route)} experts, earlier routes have {len(routes[0])}")
        routes.append(sorted(route))
        probs.append(p)
        num_subtask = ks
    if not routes:
        return np.zeros((0, 0), np.int64), np.zeros((0, num_subtask or 0)), skipped
    return np.asarray(routes, np.int64), np.stack(probs), skipped


def utilisation(records: Sequence[Mapping[str, Any]], *, num_subtask: int | None = None) -> dict:
    """Table 5 statistics of the routed records (see the module docstring).

    Args:
      records: routing records ({"route": [k ints], "probs": [K_s floats], ...}).
      num_subtask: K_s; default: the length of the first record's "probs".
    Returns:
      A plain dict: "subtasks" (routed records used), "skipped", "num_subtask", "top_k",
      "experts": [{"expert", "selected_share", "slot_share", "mean_prob", "count"}],
      "sets": [{"set": [..], "share", "count"}] for every k-subset (sorted by share, then set),
      "mean_max_prob", "soft_entropy", "utilisation_entropy", "max_entropy" (ln K_s),
      "fixed_set_entropy" (ln k), "top_set", "top_set_share", "all_experts_used",
      "greedy_fraction" (routes equal to the top-k of their probs). With no routed records:
      only "subtasks" = 0 and "skipped".
    """
    routes, probs, skipped = _routed(records, num_subtask)
    n = len(routes)
    if n == 0:
        return {"subtasks": 0, "skipped": skipped}
    ks, k = probs.shape[1], routes.shape[1]
    counts = np.bincount(routes.reshape(-1), minlength=ks)
    slot = counts / (n * k)
    set_counts = {c: 0 for c in itertools.combinations(range(ks), k)}
    for r in routes:
        set_counts[tuple(int(x) for x in r)] += 1
    sets = sorted(({"set": list(s), "count": c, "share": c / n} for s, c in set_counts.items()),
                  key=lambda d: (-d["count"], d["set"]))
    greedy = np.sort(np.argsort(-probs, axis=1, kind="stable")[:, :k], axis=1)
    return {
        "subtasks": n, "skipped": skipped, "num_subtask": ks, "top_k": k,
        "experts": [{"expert": e, "count": int(counts[e]), "selected_share": float(counts[e] / n),
                     "slot_share": float(slot[e]), "mean_prob": float(probs[:, e].mean())} for e in range(ks)],
        "sets": sets,
        "mean_max_prob": float(probs.max(axis=1).mean()),
        "soft_entropy": float(_entropy(probs).mean()),
        "utilisation_entropy": float(_entropy(slot)),
        "max_entropy": math.log(ks), "fixed_set_entropy": math.log(k),
        "top_set": sets[0]["set"], "top_set_share": sets[0]["share"],
        "all_experts_used": bool(np.all(counts > 0)),
        "greedy_fraction": float(np.mean(np.all(greedy == routes, axis=1))),
    }


def utilisation_by(records: Sequence[Mapping[str, Any]], key: str, *, num_subtask: int | None = None) -> dict:
    """:func:`utilisation` per value of ``records[i][key]`` (e.g. "cluster"); records lacking it are rejected."""
    groups: dict[str, list] = {}
    for i, r in enumerate(records):
        if key not in r:
            raise ValueError(f"records[{i}]: missing field {key!r} to group by")
        groups.setdefault(str(r[key]), []).append(r)
    return {g: utilisation(rs, num_subtask=num_subtask) for g, rs in sorted(groups.items())}


def _fmt_set(s: Sequence[int]) -> str:
    return "(" + ", ".join(str(x) for x in s) + ")"


def render_utilisation_table(u: Mapping[str, Any]) -> str:
    """Markdown table in the layout of paper Table 5, followed by the summary statistics."""
    if not u.get("subtasks"):
        return f"No routed subtasks (skipped {u.get('skipped', 0)} records without a router decision).\n"
    k = u["top_k"]
    used = [s for s in u["sets"] if s["count"] > 0]
    unused = [s for s in u["sets"] if s["count"] == 0]
    set_rows = [(_fmt_set(s["set"]), f"{100 * s['share']:.1f}%") for s in used]
    if unused:  # as in Table 5: the never-chosen sets share one 0% row
        set_rows.append((", ".join(_fmt_set(s["set"]) for s in unused), "0%"))
    lines = [f"| Expert | Selected in top-{k} | Mean routing prob. | Expert set (top-{k}) | Share of subtasks |",
             "|---|---|---|---|---|"]
    for i in range(max(len(u["experts"]), len(set_rows))):
        e = u["experts"][i] if i < len(u["experts"]) else None
        s = set_rows[i] if i < len(set_rows) else ("", "")
        left = (f"{e['expert']} | {100 * e['selected_share']:.1f}% | {e['mean_prob']:.3f}" if e else " |  | ")
        lines.append(f"| {left} | {s[0]} | {s[1]} |")
    lines.append("")
    lines.append(
        f"{u['subtasks']} routed subtasks ({u['skipped']} records without a router decision). "
        f"Soft routing entropy {u['soft_entropy']:.3f} nats, realised top-{k} utilisation entropy "
        f"{u['utilisation_entropy']:.3f} nats (max ln {u['num_subtask']} = {u['max_entropy']:.3f}; "
        f"a fixed set gives {u['fixed_set_entropy']:.3f}); mean max-probability {u['mean_max_prob']:.3f}; "
        f"most common set {_fmt_set(u['top_set'])} carries {100 * u['top_set_share']:.1f}%; "
        f"every expert used: {'yes' if u['all_experts_used'] else 'no'}; "
        f"routes equal to the greedy top-{k}: {100 * u['greedy_fraction']:.1f}%.")
    return "\n".join(lines) + "\n"
