"""The ``diagnose`` mode: heterogeneity Sim, router utilisation and rank-rho subspace divergence.

:func:`run_diagnostics` is pure given its inputs (call records, the expert bank, an embedder and
optionally a backbone activation function) and returns a plain, JSON-serialisable dict;
:func:`render_markdown` turns it into a report. :func:`run_diagnose` is the CLI glue used by
``python -m morse_jax.main --config.mode=diagnose``: it builds the job, restores the latest
checkpoint of the work directory, runs the evaluation split, and writes
``<workdir>/diagnose.json`` and ``<workdir>/diagnose.md``.

Sections of the result:

* ``heterogeneity`` -- paper Eq. 1 per task over node prompts and outputs (Fig. 1 medians).
* ``utilisation`` -- paper Table 5 over routed execute calls (+ per subtask cluster).
* ``clusters`` -- the subtask clusters (records' own "cluster" labels, else TF-IDF + KMeans
  of the execute-node descriptions, K = 8 as in App. L.1).
* ``subspace.experts`` -- per LoRA target and layer, divergence between the two role experts
  and among the subtask experts' updates, against the random-subspace reference 1 - rho/d.
* ``subspace.updates`` -- App. L.1's group pipeline (group subspaces + size-preserving label
  shuffle, T trials) on the calls' composed LoRA updates, grouped by role and by cluster.
* ``subspace.activations`` -- App. L.1 exactly: backbone LoRA-input activations of role-marked
  prompts (role diagnostic) and of execute prompts grouped by cluster (subtask diagnostic).

A part that cannot be computed (no bank, an untrained bank whose B = 0, too few calls per group)
is reported as ``{"skipped": reason}``; nothing is dropped silently.
"""

from __future__ import annotations

import json
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from morse_jax.analysis.activations import role_prompt
from morse_jax.analysis.clustering import kmeans, tfidf
from morse_jax.analysis.heterogeneity import grouped_heterogeneity
from morse_jax.analysis.records import check_records, records_from_traces
from morse_jax.analysis.subspace import (SHUFFLE_TRIALS, RankDeficientError, activation_diagnostic,
                                         expert_divergence, update_group_diagnostic)
from morse_jax.analysis.utilisation import render_utilisation_table, utilisation, utilisation_by

N_CLUSTERS = 8  # App. L.1: K = 8 subtask clusters
MAX_PER_CLUSTER = 50  # App. L.1: up to 50 prompts per cluster
MAX_ROLE_DESCRIPTIONS = 200  # App. L.1: 200 execute-node descriptions for the role diagnostic


def _skip(reason: str) -> dict:
    return {"skipped": reason}


def _clusters(execute: list[dict], n_clusters: int, seed: int) -> tuple[list[str] | None, dict]:
    """Cluster label per execute record, and a summary."""
    if execute and all(r.get("cluster") is not None for r in execute):
        labels = [str(r["cluster"]) for r in execute]
        return labels, {"source": "records", "k": len(set(labels)), "sizes": _sizes(labels)}
    descs = [r["description"] for r in execute]
    x, _ = tfidf(descs)
    distinct = len(np.unique(x, axis=0)) if len(descs) else 0
    if distinct < 2:
        return None, _skip(f"{distinct} distinct execute-node descriptions (TF-IDF); need at least 2 to cluster")
    k = min(n_clusters, distinct)  # KMeans cannot make more clusters than distinct points
    labels = [str(c) for c in kmeans(x, k, seed=seed)]
    return labels, {"source": "tfidf_kmeans", "k": k, "requested_k": n_clusters, "sizes": _sizes(labels)}


def _sizes(labels: Sequence[str]) -> dict:
    return {g: int(sum(1 for x in labels if x == g)) for g in sorted(set(labels))}


def _guard(fn: Callable[[], dict]) -> dict:
    try:
        return fn()
    except RankDeficientError as e:
        return _skip(str(e))


def _expert_section(bank: dict, spec: Any, rho: int) -> dict:
    out = {}
    roles = list(range(spec.num_roles))
    subtasks = [spec.subtask_id(k) for k in range(spec.num_subtask)]
    for t in spec.targets:
        entry = {}
        if len(roles) >= 2:
            r = expert_divergence(bank, t, rho, experts=roles)
            entry["roles"] = {"experts": list(spec.role_names), "per_layer": r["mean"], "undefined": r["undefined"],
                              "random_reference": r["random_reference"]}
        if len(subtasks) >= 2:
            s = expert_divergence(bank, t, rho, experts=subtasks)
            entry["subtasks"] = {"per_layer": s["mean"], "matrix": s["matrix"], "undefined": s["undefined"],
                                 "random_reference": s["random_reference"]}
        out[t] = entry
    return out


def _sample(items: list, limit: int, rng: np.random.Generator) -> list:
    if len(items) <= limit:
        return items
    return [items[i] for i in sorted(rng.choice(len(items), size=limit, replace=False))]


def _activation_section(execute: list[dict], labels: list[str] | None, activation_fn: Callable, rho: int,
                        trials: int, seed: int, max_role: int, max_per_cluster: int) -> dict:
    rng = np.random.default_rng(seed)
    descs = _sample(sorted({r["description"] for r in execute}), max_role, rng)
    by_cluster: dict[str, list[str]] = {}
    if labels is not None:
        for r, c in zip(execute, labels):
            if r["description"] not in by_cluster.setdefault(c, []):
                by_cluster[c].append(r["description"])
        by_cluster = {c: _sample(d, max_per_cluster, rng) for c, d in sorted(by_cluster.items())}
    # Both diagnostics embed ROLE=execute prompts; capture each distinct prompt once.
    prompts = sorted({role_prompt(d, "execute") for d in descs}
                     | {role_prompt(d, "merge") for d in descs}
                     | {role_prompt(d, "execute") for ds in by_cluster.values() for d in ds})
    if not prompts:
        return _skip("no execute-node descriptions")
    feats = np.asarray(activation_fn(prompts))
    if feats.ndim != 3 or feats.shape[0] != len(prompts):
        raise ValueError(f"activation_fn returned shape {feats.shape} for {len(prompts)} prompts; expected [N, L, d]")
    row = {p: i for i, p in enumerate(prompts)}
    out = {}
    role_rows = [row[role_prompt(d, role)] for role in ("execute", "merge") for d in descs]
    role_labels = [role for role in ("execute", "merge") for _ in descs]
    out["roles"] = _guard(lambda: activation_diagnostic(feats[role_rows], role_labels, rho, trials=trials, seed=seed))
    if labels is None:
        out["clusters"] = _skip("no subtask clusters")
    else:
        rows = [row[role_prompt(d, "execute")] for ds in by_cluster.values() for d in ds]
        labs = [c for c, ds in by_cluster.items() for _ in ds]
        out["clusters"] = _guard(lambda: activation_diagnostic(feats[rows], labs, rho, trials=trials, seed=seed))
    return out


def run_diagnostics(records: Sequence[Mapping[str, Any]], bank: dict | None, spec: Any, embedder: Any, *,
                    seed: int = 0, activation_fn: Callable[[Sequence[str]], np.ndarray] | None = None,
                    rho: int | None = None, n_clusters: int = N_CLUSTERS, trials: int = SHUFFLE_TRIALS,
                    max_role_descriptions: int = MAX_ROLE_DESCRIPTIONS,
                    max_per_cluster: int = MAX_PER_CLUSTER) -> dict:
    """All diagnostics for one set of calls (see the module docstring for the sections).

    Args:
      records: call records (``morse_jax.analysis.records``), e.g. from ``records_from_traces``.
      bank: the expert bank pytree {"a": {t: [E, L, d_in, r]}, "b": {t: [E, L, r, d_out]}}, or None.
      spec: its ``ExpertBankSpec`` (None without a bank).
      embedder: ``SentenceEmbedder`` (or any ``.embed`` / callable); None skips heterogeneity.
      seed: seeds clustering, sampling and every shuffle baseline (same seed -> same result).
      activation_fn: texts -> float[N, L, d] LoRA-input activations
        (``analysis.activations.activation_fn_for``); None skips the App. L.1 activation part.
      rho: subspace rank, default the LoRA rank (``spec.rank``, 8 in the paper).
      n_clusters, trials, max_role_descriptions, max_per_cluster: App. L.1's K, T and sample caps.
    Returns:
      A JSON-serialisable dict with keys "calls", "heterogeneity", "utilisation", "clusters",
      "subspace" ({"experts", "updates", "activations"}), "settings".
    """
    recs = check_records(records)
    if bank is not None and spec is None:
        raise ValueError("spec: an ExpertBankSpec is required with a bank")
    if rho is None:
        rho = spec.rank if spec is not None else 8
    if not isinstance(rho, int) or rho < 1:
        raise ValueError(f"rho must be a positive int, got {rho!r}")
    execute = [r for r in recs if r["role"] == "execute"]
    result: dict[str, Any] = {
        "calls": {"total": len(recs), "execute": len(execute), "merge": len(recs) - len(execute),
                  "tasks": len({r["task_id"] for r in recs})},
        "settings": {"seed": seed, "rho": rho, "n_clusters": n_clusters, "trials": trials,
                     "max_role_descriptions": max_role_descriptions, "max_per_cluster": max_per_cluster},
    }
    result["heterogeneity"] = (grouped_heterogeneity(recs, embedder) if embedder is not None
                               else _skip("no embedder"))
    num_subtask = spec.num_subtask if spec is not None and spec.num_subtask > 0 else None
    labels, result["clusters"] = _clusters(execute, n_clusters, seed)
    util = utilisation(execute, num_subtask=num_subtask)
    if labels is not None and util.get("subtasks"):
        routed = [dict(r, cluster=c) for r, c in zip(execute, labels)]
        util["by_cluster"] = utilisation_by(routed, "cluster", num_subtask=num_subtask)
    result["utilisation"] = util

    sub: dict[str, Any] = {}
    if bank is None:
        sub["experts"] = sub["updates"] = _skip("no expert bank (variant without MoLE)")
    else:
        sub["experts"] = _expert_section(bank, spec, rho)
        updates = {}
        adapted = [r for r in recs if r["active_set"]]
        for t in spec.targets:
            entry = {}
            roles = [r["role"] for r in adapted]
            entry["roles"] = (_guard(lambda: update_group_diagnostic(
                bank, t, spec.scaling, [r["active_set"] for r in adapted], roles, rho, trials=trials, seed=seed))
                if len(set(roles)) >= 2 else _skip("calls of only one role ran with adapters"))
            ex = [(r, c) for r, c in zip(execute, labels or []) if r["active_set"]]
            entry["clusters"] = (_guard(lambda: update_group_diagnostic(
                bank, t, spec.scaling, [r["active_set"] for r, _ in ex], [c for _, c in ex], rho, trials=trials,
                seed=seed)) if len({c for _, c in ex}) >= 2 else _skip("fewer than 2 clusters of adapted calls"))
            updates[t] = entry
        sub["updates"] = updates
    sub["activations"] = (_activation_section(execute, labels, activation_fn, rho, trials, seed,
                                              max_role_descriptions, max_per_cluster)
                          if activation_fn is not None else _skip("no activation function (backbone) given"))
    result["subspace"] = sub
    return result


# --------------------------------------------------------------------------- markdown


def _f(x: Any, nd: int = 3) -> str:
    return "n/a" if x is None or (isinstance(x, float) and not np.isfinite(x)) else f"{x:.{nd}f}"


def _group_table(title: str, d: Mapping[str, Any]) -> list[str]:
    if "skipped" in d:
        return [f"*{title}*: skipped ({d['skipped']})", ""]
    lines = [f"*{title}* -- groups {d['sizes']}, rho={d['rho']}, {d['trials']} shuffles: "
             f"mean real {_f(d['mean_real'])} vs shuffle {_f(d['mean_shuffle'])} (gap {_f(d['mean_gap'])})", "",
             "| layer | real | shuffle mean ± σ | gap |", "|---|---|---|---|"]
    for i, layer in enumerate(d["layers"]):
        lines.append(f"| {layer} | {_f(d['real_mean'][i])} | {_f(d['shuffle_mean'][i])} ± "
                     f"{_f(d['shuffle_std'][i])} | {_f(d['gap'][i])} |")
    return lines + [""]


def render_markdown(result: Mapping[str, Any]) -> str:
    """A human-readable report of :func:`run_diagnostics`' result."""
    c = result["calls"]
    out = ["# Diagnostics", "",
           f"{c['tasks']} tasks, {c['total']} calls ({c['execute']} execute, {c['merge']} merge). "
           f"Settings: {json.dumps(result['settings'])}.", "", "## Heterogeneity (paper Eq. 1)", ""]
    h = result["heterogeneity"]
    if "skipped" in h:
        out += [f"skipped ({h['skipped']})", ""]
    else:
        out += ["Mean pairwise cosine of node texts per task (smaller = less redundant); medians over tasks.", "",
                "| calls | median Sim_prompt | median Sim_output | median shift | tasks (prompt / output) |",
                "|---|---|---|---|---|",
                f"| all | {_f(h['median_sim_prompt'])} | {_f(h['median_sim_output'])} | {_f(h['median_shift'])} | "
                f"{h['tasks_with_prompt_sim']} / {h['tasks_with_output_sim']} |"]
        for role, s in h.get("per_role", {}).items():
            out.append(f"| {role} | {_f(s['median_sim_prompt'])} | {_f(s['median_sim_output'])} | "
                       f"{_f(s['median_shift'])} | {s['tasks_with_prompt_sim']} / {s['tasks_with_output_sim']} |")
        out.append("")
    util = result["utilisation"]
    out += ["## Router utilisation (paper Table 5)", "", render_utilisation_table(util)]
    if util.get("by_cluster"):
        out += ["Per subtask cluster (most common set, its share, soft entropy):", ""]
        out += [f"- cluster {c}: {u['subtasks']} subtasks, {tuple(u['top_set'])} {100 * u['top_set_share']:.1f}%, "
                f"{_f(u['soft_entropy'])} nats" for c, u in util["by_cluster"].items() if u.get("subtasks")]
        out.append("")
    cl = result["clusters"]
    out += ["## Subtask clusters", "", f"skipped ({cl['skipped']})" if "skipped" in cl else
            f"{cl['k']} clusters ({cl['source']}), sizes {cl['sizes']}", ""]
    sub = result["subspace"]
    out += ["## Subspace divergence (paper App. L)", "",
            "div = 1 - ||V_a^T V_b||_F^2 / rho; 0 = same rank-rho subspace, 1 = orthogonal.", "",
            "### Between experts (LoRA update dW = A B, input side)", ""]
    if "skipped" in sub["experts"]:
        out += [f"skipped ({sub['experts']['skipped']})", ""]
    else:
        for t, e in sub["experts"].items():
            for kind in ("roles", "subtasks"):
                if kind in e:
                    vals = ", ".join(_f(x) for x in e[kind]["per_layer"])
                    note = f"; undefined (rank < rho) at {len(e[kind]['undefined'])} (layer, expert)" \
                        if e[kind]["undefined"] else ""
                    out.append(f"- {t} {kind}: per layer [{vals}] (random subspaces: "
                               f"{_f(e[kind]['random_reference'])}){note}")
        out.append("")
    out += ["### Between call groups (composed LoRA updates, label-shuffle baseline)", ""]
    if "skipped" in sub["updates"]:
        out += [f"skipped ({sub['updates']['skipped']})", ""]
    else:
        for t, e in sub["updates"].items():
            out += _group_table(f"{t}, roles", e["roles"]) + _group_table(f"{t}, subtask clusters", e["clusters"])
    out += ["### Backbone activations (App. L.1: LoRA input at the last token)", ""]
    a = sub["activations"]
    if "skipped" in a:
        out += [f"skipped ({a['skipped']})", ""]
    else:
        out += _group_table("roles (ROLE=execute vs ROLE=merge prompts)", a["roles"])
        out += _group_table("subtask clusters (ROLE=execute prompts)", a["clusters"])
    return "\n".join(out)


# --------------------------------------------------------------------------- CLI glue


def run_diagnose(cfg) -> int:
    """``--config.mode=diagnose``: evaluate with the latest checkpoint, then run every diagnostic."""
    from morse_jax.analysis.activations import activation_fn_for, adapted_layers
    from morse_jax.run.build import Job
    from morse_jax.tasks.embedding import SentenceEmbedder

    job = Job(cfg)
    state = job.restore()
    print(f"diagnose: variant={cfg.variant} model={job.backbone.source} trainable={state} "
          f"eval_tasks={len(job.eval_tasks)}")
    result = job.run_tasks(job.eval_tasks, "eval", "diagnose")
    records = records_from_traces(result.traces, family=job.family)
    bank = job.trainable["bank"] if job.trainable is not None and job.spec is not None else None
    n_adapt = job.spec.n_adapt if job.spec is not None else 8
    act = activation_fn_for(job.backbone.params, job.backbone.config, job.encode,
                            adapted_layers(job.backbone.config, min(n_adapt, job.backbone.config.num_layers)))
    out = run_diagnostics(records, bank, job.spec, SentenceEmbedder.load(), seed=cfg.seed, activation_fn=act)
    out["run"] = {"variant": cfg.variant, "model": str(job.backbone.source), "trainable": state}
    (job.workdir / "diagnose.json").write_text(json.dumps(out, indent=1, default=float))
    md = render_markdown(out)
    (job.workdir / "diagnose.md").write_text(md)
    print(md)
    print(f"diagnose: wrote {job.workdir / 'diagnose.md'} and diagnose.json")
    return 0
