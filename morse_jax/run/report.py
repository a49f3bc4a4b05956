"""report.md / report.json and PNG plots in the work directory, in the paper's table layouts, and
which sibling runs' evaluations share its results table (``comparable``, ``sibling_evals``)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping, Sequence

from morse_jax.run.profile import breakdown

# (metric key, column name, format): percentages as in the paper's tables, ECI as a fraction.
SCICODE_COLS = (("step_pass", "Step Pass (%)", "pct"), ("mean_step_pass", "Mean Step Pass (%)", "pct"),
                ("problem_pass", "Problem Pass (%)", "pct"))
PYFUNCS_COLS = (("reward", "Reward (%)", "pct"), ("node_pass", "Node Pass (%)", "pct"),
                ("task_pass", "Task Pass (%)", "pct"), ("solve_reward", "Solve Reward (%)", "pct"))
SRDD_COLS = (("exec", "Exec (%)", "pct"), ("eci_mean", "ECI mean", "frac"), ("eci_product", "ECI product", "frac"))
VARIANT_NAMES = {"A": "A: MoRSE untrained", "B": "B: single LoRA (r=24) + GRPO", "B++": "B++: single LoRA (r=48) + GRPO",
                 "C": "C: MoLE + flat GRPO", "D": "D: MoLE + HGRPO (MoRSE)", "single_agent": "Single agent",
                 "single_agent_rl": "Single-agent LoRA RL (r=24) + GRPO", "base": "Backbone only"}


def _table(rows: Sequence[Mapping[str, Any]], cols) -> list[str]:
    lines = ["| Variant | " + " | ".join(name for _, name, _ in cols) + " |",
             "|---|" + "---|" * len(cols)]
    for r in rows:
        cells = [("–" if not isinstance(r.get(k), (int, float)) else f"{100 * r[k]:.2f}" if fmt == "pct"
                  else f"{r[k]:.3f}") for k, _, fmt in cols]
        lines.append(f"| {VARIANT_NAMES.get(r['variant'], r['variant'])} | " + " | ".join(cells) + " |")
    return lines


def _plots(workdir: Path, train: Sequence[Mapping], evals: Sequence[Mapping]) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    made = []
    if train:
        fig, ax = plt.subplots(figsize=(5, 3))
        ax.plot([r["step"] for r in train], [r["reward_mean"] for r in train], marker="o")
        ax.set_xlabel("HGRPO step")
        ax.xaxis.get_major_locator().set_params(integer=True)
        ax.set_ylabel("mean verifier reward")
        ax.set_title("Reward per step")
        fig.tight_layout()
        fig.savefig(workdir / "reward.png", dpi=120)
        plt.close(fig)
        made.append("reward.png")
    probs = [p for e in evals for p in e.get("router_probs", [])]
    if probs:
        fig, ax = plt.subplots(figsize=(6, max(2.5, 0.3 * len(probs))))
        mat = [p["probs"] for p in probs]
        im = ax.imshow(mat, aspect="auto", cmap="viridis", vmin=0, vmax=1)
        ax.set_yticks(range(len(probs)), [f"{p['task']}/{p['node']}" for p in probs], fontsize=7)
        ax.set_xticks(range(len(mat[0])), [f"S{k}" for k in range(len(mat[0]))])
        ax.set_title("Router probabilities per subtask")
        fig.colorbar(im, ax=ax)
        fig.tight_layout()
        fig.savefig(workdir / "router_probs.png", dpi=120)
        plt.close(fig)
        made.append("router_probs.png")
    sets = {}
    for e in evals:
        for k, v in e.get("expert_sets", {}).items():
            sets[k] = sets.get(k, 0) + v
    if sets:
        fig, ax = plt.subplots(figsize=(5, 3))
        total = sum(sets.values())
        keys = sorted(sets)
        ax.bar(keys, [sets[k] / total for k in keys])
        ax.set_ylabel("share of execute calls")
        ax.set_title("Expert-pair shares")
        fig.tight_layout()
        fig.savefig(workdir / "expert_pairs.png", dpi=120)
        plt.close(fig)
        made.append("expert_pairs.png")
    return made


def step_time_table(step_times: Sequence[Mapping[str, Any]]) -> list[str]:
    """Markdown lines: mean seconds per step and share of the wall per phase (``step_time``
    records of ``run.profile.StepProfile``), the wall and the idle share of the cores."""
    rows = breakdown(list(step_times))
    if not rows:
        return []
    n = len(step_times)
    wall = sum(r.get("time/wall_s", 0.0) for r in step_times) / n
    idle = sum(r.get("time/idle_share", 0.0) for r in step_times) / n
    cores = step_times[-1].get("time/cores", 0)
    lines = [f"Mean over {n} step(s); phases are exclusive and add up to the wall (run/profile.py says "
             "what each covers).", "", "| phase | s per step | share |", "|---|---|---|"]
    lines += [f"| {p} | {s:.2f} | {100 * share:.1f} % |" for p, s, share in rows]
    lines += [f"| **wall** | {wall:.2f} | 100 % |", "",
              f"Idle share of the {cores:.0f} cores: {100 * idle:.1f} % (1 - process and sandbox CPU s / "
              "(wall x cores)).", ""]
    return lines


def write_report(workdir: str | Path, *, family: str, evals: Sequence[Mapping[str, Any]],
                 train: Sequence[Mapping[str, Any]] = (), run_info: Mapping[str, Any] | None = None,
                 step_times: Sequence[Mapping[str, Any]] = ()) -> Path:
    """Write report.md, report.json and plots; returns the path of report.md. ``step_times``:
    the run's ``step_time`` records (the per-phase breakdown of a training step)."""
    workdir = Path(workdir)
    cols = {"scicode": SCICODE_COLS, "pyfuncs": PYFUNCS_COLS}.get(family, SRDD_COLS)
    plots = _plots(workdir, train, evals)
    md = [f"# morse_jax report ({family})", ""]
    if run_info:
        md += [f"- {k}: {v}" for k, v in run_info.items()] + [""]
    md += ["## Results (paper Table 1/2 layout)", ""] + _table(evals, cols) + [""]
    md += ["## Router utilisation (paper Table 5 layout)", ""]
    for e in evals:
        util = e.get("utilisation")
        if util and util.get("subtasks"):
            from morse_jax.analysis.utilisation import render_utilisation_table

            md += [f"**{VARIANT_NAMES.get(e['variant'], e['variant'])}**", "", render_utilisation_table(util), ""]
    if train:
        md += ["## Training", "", "| step | reward mean | reward std | skipped routes | sequences | update s |",
               "|---|---|---|---|---|---|"]
        md += [f"| {r['step']} | {r['reward_mean']:.3f} | {r['reward_std']:.3f} | {r['skipped_within']:.2f} | "
               f"{r['sequences']} | {r.get('update_s', 0):.1f} |" for r in train]
        md.append("")
    if step_times:
        md += ["## Where a step's time goes", ""] + step_time_table(step_times)
    md += [f"![{p}]({p})" for p in plots]
    (workdir / "report.md").write_text("\n".join(md) + "\n")
    (workdir / "report.json").write_text(json.dumps({"family": family, "evals": list(evals), "train": list(train),
                                                     "step_times": list(step_times),
                                                     "run": dict(run_info or {}), "plots": plots}, indent=2,
                                                    default=str))
    return workdir / "report.md"


def comparable(cfg) -> dict:
    """What must match for two runs' evaluations to share one results table."""
    d = cfg.data
    return {"model": cfg.model.path, "family": d.family, "eval": d.eval, "eval_ids": list(d.eval_ids),
            "max_eval_tasks": d.max_eval_tasks, "eval_max_new_tokens": cfg.rollout.eval_max_new_tokens}


def sibling_evals(workdir: Path, cfg) -> list[dict]:
    """Evaluations of other variants next to this work directory on the same model and eval set,
    so report.md's Table 1/2 lists every variant that was run (e.g. runs/quickstart_B)."""
    out = []
    for f in sorted(workdir.resolve().parent.glob("*/eval.json")):
        if f.parent == workdir.resolve():
            continue
        try:
            rec = json.loads(f.read_text())
        except (OSError, ValueError):
            continue
        if rec.get("comparable") == json.loads(json.dumps(comparable(cfg))) and \
                rec["metrics"].get("variant") != cfg.variant:
            out.append(rec["metrics"])
    return out
