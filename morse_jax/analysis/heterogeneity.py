"""Agent heterogeneity Sim (paper Eq. 1): mean pairwise cosine similarity of node-level texts.

For one task instance with n agents and texts {t_i} (the node prompts p_i or outputs y_i)::

    Sim({t_i}) = 2 / (n (n - 1)) * sum_{i < j} cos(f(t_i), f(t_j))

under a frozen text encoder f (the paper uses gte-Qwen2-7B-instruct; we use the local
all-MiniLM-L6-v2 of ``morse_jax.tasks.embedding``). Smaller = less redundant. The paper reports,
over instances, the median Sim_prompt, the median Sim_output and the median per-instance shift
Delta = Sim_output - Sim_prompt (Fig. 1).

``embedder`` is anything with ``embed(texts) -> float[N, D]`` (e.g. ``SentenceEmbedder``) or a
plain callable texts -> float[N, D]; rows are re-normalised here, so any scale works.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any, Callable, Mapping, Sequence

import numpy as np

Embedder = Any  # .embed(texts) -> [N, D], or a callable texts -> [N, D]


def embed_texts(embedder: Embedder, texts: Sequence[str]) -> np.ndarray:
    """Embed ``texts`` -> float64[N, D] unit rows, checking what the embedder returned."""
    if isinstance(texts, (str, bytes)):
        raise TypeError("texts must be a sequence of strings, not a single string")
    texts = list(texts)
    for i, t in enumerate(texts):
        if not isinstance(t, str):
            raise TypeError(f"texts[{i}] must be str, got {type(t).__name__}")
    fn: Callable = embedder.embed if hasattr(embedder, "embed") else embedder
    if not callable(fn):
        raise TypeError(f"embedder must have .embed(texts) or be callable, got {type(embedder).__name__}")
    e = np.asarray(fn(texts), np.float64)
    if e.ndim != 2 or e.shape[0] != len(texts):
        raise ValueError(f"embedder returned shape {e.shape} for {len(texts)} texts; expected [N, D]")
    if not np.all(np.isfinite(e)):
        raise ValueError("embedder returned non-finite values")
    norm = np.linalg.norm(e, axis=1, keepdims=True)
    if np.any(norm == 0):
        raise ValueError("embedder returned an all-zero embedding; cosine is undefined")
    return e / norm


def sim_from_embeddings(e: np.ndarray) -> float:
    """Eq. 1 on embeddings e [n, D] (n >= 2): mean over the n(n-1)/2 pairs i < j of cos(e_i, e_j)."""
    e = np.asarray(e, np.float64)
    if e.ndim != 2 or e.shape[0] < 2:
        raise ValueError(f"Sim needs at least 2 texts (Eq. 1 averages over pairs), got shape {e.shape}")
    u = e / np.linalg.norm(e, axis=1, keepdims=True)
    c = u @ u.T
    n = len(u)
    # Sum over i < j via the full matrix: (sum(C) - trace(C)) / 2; trace is n for unit rows.
    return float(np.clip((c.sum() - np.trace(c)) / (n * (n - 1)), -1.0, 1.0))


def heterogeneity(texts: Sequence[str], embedder: Embedder) -> float:
    """Sim({t_i}) of paper Eq. 1 for one set of >= 2 texts; 1 for identical texts."""
    return sim_from_embeddings(embed_texts(embedder, texts))


def _median(xs: list[float]) -> float | None:
    return float(np.median(xs)) if xs else None


def grouped_heterogeneity(records: Sequence[Mapping[str, Any]], embedder: Embedder, *,
                          by_role: bool = True) -> dict:
    """Sim_prompt, Sim_output and their shift per task instance (Fig. 1), plus per-role Sim.

    Args:
      records: one dict per agent call with "task_id", "role" and the texts "prompt" and/or
        "output" (missing or None = not available: a blocked node has no output).
      embedder: see the module docstring. All texts are embedded in one batch.
      by_role: also compute Sim within each role's calls of a task.
    Returns:
      {"per_task": {task_id: {"n_prompt", "n_output", "sim_prompt", "sim_output", "shift"}},
       "median_sim_prompt", "median_sim_output", "median_shift", "tasks_with_prompt_sim",
       "tasks_with_output_sim", "per_role": {role: {"median_sim_prompt", "median_sim_output",
       "median_shift", "tasks"}}}. A task with fewer than 2 texts of a kind has None for that
      Sim (Eq. 1 needs a pair) and is left out of the medians; the counts say how many were used.
    """
    texts: list[str] = []
    slots: dict[tuple[str, str, str], list[int]] = defaultdict(list)  # (task, role|"*", kind) -> rows
    for i, r in enumerate(records):
        if "task_id" not in r:
            raise ValueError(f"records[{i}]: missing field 'task_id'")
        role = str(r.get("role", ""))
        for kind in ("prompt", "output"):
            t = r.get(kind)
            if t is None:
                continue
            if not isinstance(t, str):
                raise TypeError(f"records[{i}].{kind} must be str or None, got {type(t).__name__}")
            slots[(str(r["task_id"]), "*", kind)].append(len(texts))
            if by_role:
                slots[(str(r["task_id"]), role, kind)].append(len(texts))
            texts.append(t)
    emb = embed_texts(embedder, texts) if texts else np.zeros((0, 1))

    def sim(key) -> float | None:
        rows = slots.get(key, [])
        return sim_from_embeddings(emb[rows]) if len(rows) >= 2 else None

    def summarise(role: str) -> tuple[dict, dict]:
        per_task = {}
        for task in sorted({k[0] for k in slots if k[1] == role}):
            sp, so = sim((task, role, "prompt")), sim((task, role, "output"))
            per_task[task] = {"n_prompt": len(slots.get((task, role, "prompt"), [])),
                              "n_output": len(slots.get((task, role, "output"), [])),
                              "sim_prompt": sp, "sim_output": so,
                              "shift": None if sp is None or so is None else so - sp}
        vals = lambda f: [v[f] for v in per_task.values() if v[f] is not None]  # noqa: E731
        summary = {"median_sim_prompt": _median(vals("sim_prompt")), "median_sim_output": _median(vals("sim_output")),
                   "median_shift": _median(vals("shift")), "tasks_with_prompt_sim": len(vals("sim_prompt")),
                   "tasks_with_output_sim": len(vals("sim_output")), "tasks_with_shift": len(vals("shift"))}
        return per_task, summary

    per_task, out = summarise("*")
    out = {"per_task": per_task, **out, "texts_embedded": len(texts)}
    if by_role:
        roles = sorted({k[1] for k in slots if k[1] != "*"})
        out["per_role"] = {role: summarise(role)[1] for role in roles}
    return out
