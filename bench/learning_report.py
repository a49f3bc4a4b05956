"""Aggregation of bench/learning.py runs: curves, the final table, Welch t-tests, learning.md/.json/.png.

Pure functions over run records (no model), so the statistics are tested on their own. A run
record (one variant, one seed) is the dict bench/learning.py writes to ``<run>/learning_run.json``:

  {"variant": "D", "seed": 0, "wall_s": ..., "evals": [{"step": 0, "iid": {metrics}, "ood": {metrics},
   "router_entropy": float | None, "expert_sets": {"S0+S1": n, ...}}, ...],
   "train": [{"step": 1, "reward_mean": ..., "skipped_within": ..., "groups": ...}, ...]}

``metrics`` are :func:`morse_jax.tasks.pyfuncs.family.pyfuncs_metrics` (fractions; shown here in points =
x 100). Variant A does not train: its single evaluation is its value at every step.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Mapping, Sequence

import numpy as np

NAMES = {"A": "A: MoRSE untrained", "B": "B: single LoRA (r=24) + GRPO", "C": "C: MoLE + flat GRPO",
         "D": "D: MoLE + HGRPO (MoRSE)"}
COLS = (("reward", "Reward"), ("node_pass", "Node Pass"), ("task_pass", "Task Pass"))


def router_entropy(router_probs: Sequence[Mapping]) -> float | None:
    """Mean entropy (nats) of the routing distributions of the evaluated execute nodes."""
    ents = []
    for rec in router_probs:
        p = np.clip(np.asarray(rec["probs"], np.float64), 1e-12, 1.0)
        ents.append(float(-(p * np.log(p)).sum()))
    return float(np.mean(ents)) if ents else None


def value_at(run: Mapping, step: int, split: str, key: str = "reward") -> float:
    """A run's metric at ``step`` (the latest evaluation at or before it; A's only one)."""
    evals = sorted(run["evals"], key=lambda e: e["step"])
    got = [e for e in evals if e["step"] <= step] or evals[:1]
    return float(got[-1][split][key])


def final(run: Mapping, split: str, key: str = "reward") -> float:
    return float(max(run["evals"], key=lambda e: e["step"])[split][key])


def welch(a: Sequence[float], b: Sequence[float]) -> tuple[float, float]:
    """(t, two-sided p) of Welch's t-test; NaN when either side has < 2 values or both are constant."""
    from scipy import stats

    if len(a) < 2 or len(b) < 2 or (np.std(a) == 0 and np.std(b) == 0):
        return math.nan, math.nan
    t, p = stats.ttest_ind(a, b, equal_var=False)
    return float(t), float(p)


def _ms(xs: Sequence[float]) -> str:
    xs = [100 * x for x in xs]
    return f"{np.mean(xs):.1f} ± {np.std(xs, ddof=1):.1f}" if len(xs) > 1 else f"{np.mean(xs):.1f}"


def summarize(runs: Sequence[Mapping]) -> dict:
    """Per-variant finals (per seed), curves (mean, std over seeds), deltas vs A, t-tests of D vs others."""
    by_v: dict[str, list[Mapping]] = {}
    for r in runs:
        by_v.setdefault(r["variant"], []).append(r)
    for v in by_v:
        by_v[v].sort(key=lambda r: r["seed"])
    steps = sorted({e["step"] for r in runs for e in r["evals"]})
    out = {"variants": {}, "steps": steps}
    for v, rs in by_v.items():
        entry = {"seeds": [r["seed"] for r in rs], "final": {}, "curve": {}}
        for split in ("iid", "ood"):
            for key, _ in COLS:
                entry["final"][f"{split}_{key}"] = [final(r, split, key) for r in rs]
            vals = np.array([[value_at(r, s, split) for s in steps] for r in rs])
            entry["curve"][split] = {"mean": vals.mean(0).tolist(), "std": vals.std(0).tolist()}
        entry["skipped_within"] = [float(np.mean([t["skipped_within"] for t in r.get("train", [])]))
                                   if r.get("train") else None for r in rs]
        last = [max(r["evals"], key=lambda e: e["step"]) for r in rs]
        ents = [e.get("router_entropy") for e in last if e.get("router_entropy") is not None]
        entry["router_entropy"] = float(np.mean(ents)) if ents else None
        pairs: dict[str, int] = {}
        for e in last:
            for k, n in (e.get("expert_sets") or {}).items():
                pairs[k] = pairs.get(k, 0) + n
        total = sum(pairs.values())
        entry["expert_pair_shares"] = {k: n / total for k, n in sorted(pairs.items())} if total else {}
        entry["wall_s"] = [r.get("wall_s") for r in rs]
        out["variants"][v] = entry
    a = out["variants"].get("A")
    for v, entry in out["variants"].items():
        if a is None:
            break
        for split in ("iid", "ood"):
            # paired by seed where both have it, else difference of means
            a_by_seed = dict(zip(a["seeds"], a["final"][f"{split}_reward"]))
            own = dict(zip(entry["seeds"], entry["final"][f"{split}_reward"]))
            common = [s for s in entry["seeds"] if s in a_by_seed]
            entry[f"delta_{split}_per_seed"] = {str(s): 100 * (own[s] - a_by_seed[s]) for s in common}
            entry[f"delta_{split}"] = 100 * (float(np.mean(list(own.values()))) - float(np.mean(list(a_by_seed.values()))))
    d = out["variants"].get("D")
    out["welch_D_vs"] = {}
    if d is not None:
        for v, entry in out["variants"].items():
            if v == "D":
                continue
            t, p = welch(d["final"]["iid_reward"], entry["final"]["iid_reward"])
            t2, p2 = welch(d["final"]["ood_reward"], entry["final"]["ood_reward"])
            out["welch_D_vs"][v] = {"iid_t": t, "iid_p": p, "ood_t": t2, "ood_p": p2}
    return out


def headline(summary: Mapping) -> str:
    """``learning: D-A +X.X points on held-out iid tasks (seeds S1 S2 ...)``."""
    v = summary["variants"]
    if "D" not in v or "A" not in v:
        return "learning: D-A n/a (D or A was not run)"
    seeds = " ".join(str(s) for s in v["D"]["seeds"])
    return f"learning: D-A {v['D']['delta_iid']:+.1f} points on held-out iid tasks (seeds {seeds})"


def _fmt(x) -> str:
    return "–" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.3g}"


def render_markdown(summary: Mapping, info: Mapping) -> str:
    order = [v for v in ("A", "B", "C", "D") if v in summary["variants"]]
    order += [v for v in summary["variants"] if v not in order]
    md = ["# Does it learn? (PyFuncs, bench/learning.py)", ""]
    md += [f"- {k}: {v}" for k, v in info.items()] + [""]
    md += ["## Final held-out evaluation (paper Table 1/3 layout; points, mean ± std over seeds)", ""]
    head = [f"iid {n}" for _, n in COLS] + [f"OOD {n}" for _, n in COLS] + ["Δ iid vs A", "Δ OOD vs A"]
    md += ["| Variant | seeds | " + " | ".join(head) + " |", "|---|---|" + "---|" * len(head)]
    for v in order:
        e = summary["variants"][v]
        cells = [_ms(e["final"][f"{s}_{k}"]) for s in ("iid", "ood") for k, _ in COLS]
        cells += [f"{e.get('delta_iid', float('nan')):+.1f}", f"{e.get('delta_ood', float('nan')):+.1f}"]
        md.append(f"| {NAMES.get(v, v)} | {' '.join(map(str, e['seeds']))} | " + " | ".join(cells) + " |")
    md += ["", "Per-seed Δ iid reward vs A (points): " + "; ".join(
        f"{v}: " + ", ".join(f"s{s} {d:+.1f}" for s, d in summary["variants"][v].get("delta_iid_per_seed", {}).items())
        for v in order if v != "A"), ""]
    if summary.get("welch_D_vs"):
        md += ["## Welch t-tests of D against each variant (final reward, over seeds)", "",
               "| D vs | iid t | iid p | OOD t | OOD p |", "|---|---|---|---|---|"]
        for v, w in summary["welch_D_vs"].items():
            md.append(f"| {v} | {_fmt(w['iid_t'])} | {_fmt(w['iid_p'])} | {_fmt(w['ood_t'])} | {_fmt(w['ood_p'])} |")
        md.append("")
    md += ["## Training diagnostics", "", "| Variant | skipped-group fraction (mean over steps) | router entropy "
           "(nats, final eval) | expert-pair shares (final eval) |", "|---|---|---|---|"]
    for v in order:
        e = summary["variants"][v]
        sk = [x for x in e["skipped_within"] if x is not None]
        shares = ", ".join(f"{k} {100 * s:.0f}%" for k, s in e["expert_pair_shares"].items()) or "–"
        md.append(f"| {v} | {_fmt(float(np.mean(sk))) if sk else '–'} | {_fmt(e['router_entropy'])} | {shares} |")
    md += ["", "## Held-out reward vs step (points, mean over seeds)", "",
           "| step | " + " | ".join(f"{v} iid | {v} OOD" for v in order) + " |", "|---|" + "---|---|" * len(order)]
    for i, s in enumerate(summary["steps"]):
        md.append(f"| {s} | " + " | ".join(f"{100 * summary['variants'][v]['curve']['iid']['mean'][i]:.1f} | "
                                           f"{100 * summary['variants'][v]['curve']['ood']['mean'][i]:.1f}"
                                           for v in order) + " |")
    md += ["", "![held-out reward vs step](learning.png)", "", headline(summary), ""]
    return "\n".join(md)


def plot(summary: Mapping, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6), sharey=True)
    steps = np.array(summary["steps"])
    for ax, split in zip(axes, ("iid", "ood")):
        for v, e in summary["variants"].items():
            m = 100 * np.array(e["curve"][split]["mean"])
            s = 100 * np.array(e["curve"][split]["std"])
            ax.plot(steps, m, marker="o", label=NAMES.get(v, v), linestyle="--" if v == "A" else "-")
            ax.fill_between(steps, m - s, m + s, alpha=0.2)
        ax.set_title(f"held-out {split} tasks")
        ax.set_xlabel("training step")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("reward (points, mean ± std over seeds)")
    axes[1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_outputs(workdir: Path, runs: Sequence[Mapping], info: Mapping) -> dict:
    """learning.json, learning.md and learning.png in ``workdir``; returns the summary."""
    summary = summarize(runs)
    (workdir / "learning.json").write_text(json.dumps({"info": dict(info), "summary": summary, "runs": list(runs)},
                                                      indent=1, default=str))
    (workdir / "learning.md").write_text(render_markdown(summary, info))
    plot(summary, workdir / "learning.png")
    return summary
