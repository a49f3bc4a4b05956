"""Task families by name: build the family, load its train/eval tasks, compute its metrics."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Sequence

from morse_jax.tasks.base import Task

FAMILIES = ("scicode", "srdd", "pyfuncs")
# SciCode steps that take > 15 s to score (DESIGN §6); kept out of fast runs when asked.
SLOW_SCICODE_STEPS = ("51.4", "47.4", "10.11")


def build_family(cfg, workdir: Path):
    """The config's task family with its options (``config.scicode.*`` / ``config.srdd.*``)."""
    fam = cfg.data.family
    if fam == "scicode":
        from morse_jax.tasks.scicode import family as sc

        if cfg.data.scicode_h5:
            targets = sc.H5Targets(cfg.data.scicode_h5)
        else:
            cache = cfg.data.cache_dir or str(Path(workdir).expanduser().parent / ".cache" / "scicode")
            targets = sc.RebuiltTargets(cache)
        return sc.SciCodeFamily(targets, binary=cfg.scicode.binary_reward, gold_context=cfg.scicode.gold_context)
    if fam == "srdd":
        return srdd_family(cfg)
    if fam == "pyfuncs":
        from morse_jax.tasks.pyfuncs.family import PyFuncsFamily

        return PyFuncsFamily()
    raise ValueError(f"config.data.family must be one of {FAMILIES}, got {fam!r}")


def srdd_family(cfg):
    """SRDDFamily with the config's reward gate, completeness rule and planner hint (also used for
    free-text tasks in mode=solve / plan)."""
    from morse_jax.tasks.srdd.family import SOFTWARE_PROJECT_HINT, SRDDFamily
    from morse_jax.tasks.srdd.scoring import SRDDRewardConfig

    reward = SRDDRewardConfig(use_gate=cfg.srdd.use_gate, completeness_mode=cfg.srdd.completeness_mode)
    return SRDDFamily(reward=reward, planner_hint=SOFTWARE_PROJECT_HINT if cfg.srdd.planner_hint else None)


@dataclasses.dataclass(frozen=True)
class SplitSummary:
    """What one split of the config holds: tasks (and SciCode steps) used, and those left out, with why."""

    field: str  # "train" | "eval"
    source: str  # the config's split name or file
    tasks: int
    steps: int | None  # SciCode testable steps of the tasks used (None: the planner decides, SRDD)
    left_out: tuple[tuple[str, str], ...] = ()  # (task id, reason)

    def line(self) -> str:
        steps = f", {self.steps} steps" if self.steps is not None else ""
        out = f"{self.field} split {self.source!r}: {self.tasks} tasks{steps}"
        if not self.left_out:
            return out + ", none left out"
        reasons: dict[str, list[str]] = {}
        for tid, why in self.left_out:
            reasons.setdefault(why, []).append(tid)
        return out + "; left out " + "; ".join(f"{len(ids)} ({', '.join(ids)}): {why}" for why, ids in reasons.items())


def select_tasks(tasks: list[Task], ids: Sequence[str], limit: int, field: str) -> list[Task]:
    """The tasks named by ``ids`` in that order (all when empty), cut to ``limit`` (0 = no limit);
    an unknown id is an error naming ``config.data.<field>``."""
    if ids:
        by_id = {t.task_id: t for t in tasks}
        missing = [i for i in ids if str(i) not in by_id]
        if missing:
            raise ValueError(f"config.data.{field}: unknown task id(s) {missing}")
        tasks = [by_id[str(i)] for i in ids]
    return tasks[:limit] if limit else tasks


def scicode_problems(cfg, source: str) -> list:
    """The SciCode problems of a split name, ``package:*`` or a JSONL path (no targets needed)."""
    from morse_jax.tasks.scicode import family as sc

    if source.startswith("package:") or Path(source).expanduser().exists():
        return sc.load_problems(source)
    return sc.load_split(source, Path(cfg.data.dir).expanduser() / "scicode" / "data")


def scicode_left_out_reason(cfg, problem, targets) -> str | None:
    """Why a SciCode problem is not used (None: it is). ``targets=None``: assume they exist."""
    if targets is not None and not all(targets.can_score(problem, s) for s in problem.testable_steps):
        return "no test targets (needs data.scicode_h5; only problems with ground truth are rebuilt)"
    if cfg.data.skip_slow_steps and any(s.step_id in SLOW_SCICODE_STEPS for s in problem.testable_steps):
        return f"data.skip_slow_steps (a step takes > 15 s to score: {', '.join(SLOW_SCICODE_STEPS)})"
    return None


def _scicode_split(cfg, field: str, family) -> tuple[list[Task], SplitSummary]:
    from morse_jax.tasks.scicode import family as sc

    source = cfg.data[field]
    tasks, left = [], []
    for p in scicode_problems(cfg, source):
        why = scicode_left_out_reason(cfg, p, family.targets)
        if why is None:
            tasks.append(sc.problem_to_task(p))
        else:
            left.append((p.problem_id, why))
    tasks = select_tasks(tasks, cfg.data[f"{field}_ids"], cfg.data[f"max_{field}_tasks"], f"{field}_ids")
    steps = sum(len(t.payload.testable_steps) for t in tasks)
    return tasks, SplitSummary(field, source, len(tasks), steps, tuple(left))


def srdd_split(cfg, field: str) -> tuple[list[Task], SplitSummary]:
    """The SRDD tasks of split ``config.data.<field>`` as the config selects them, and their summary."""
    from morse_jax.tasks.srdd.family import load_srdd

    source = cfg.data[field]
    tasks = load_srdd(source, Path(cfg.data.dir).expanduser() / "srdd" / "data")
    tasks = select_tasks(tasks, cfg.data[f"{field}_ids"], cfg.data[f"max_{field}_tasks"], f"{field}_ids")
    return tasks, SplitSummary(field, source, len(tasks), None)


def _pyfuncs_split(cfg, field: str) -> tuple[list[Task], SplitSummary]:
    """Generated tasks: the split name's task list, cut by the config's ids / limit."""
    from morse_jax.tasks.pyfuncs.data import load_split

    source = cfg.data[field]
    tasks = load_split(source, 0 if cfg.data[f"{field}_ids"] else cfg.data[f"max_{field}_tasks"])
    tasks = select_tasks(tasks, cfg.data[f"{field}_ids"], cfg.data[f"max_{field}_tasks"], f"{field}_ids")
    return tasks, SplitSummary(field, source, len(tasks), sum(len(t.payload.steps) for t in tasks))


def load_splits(cfg, family) -> tuple[list[Task], list[Task], list[SplitSummary]]:
    """(train tasks, eval tasks, a summary per configured split) as the config selects them."""
    out, summaries = {}, []
    for field in ("train", "eval"):
        out[field] = []
        if not cfg.data[field]:
            continue
        if cfg.data.family == "scicode":
            out[field], summary = _scicode_split(cfg, field, family)
        elif cfg.data.family == "pyfuncs":
            out[field], summary = _pyfuncs_split(cfg, field)
        else:
            out[field], summary = srdd_split(cfg, field)
        summaries.append(summary)
    return out["train"], out["eval"], summaries


def load_task_splits(cfg, family) -> tuple[list[Task], list[Task]]:
    """(train tasks, eval tasks) as the config selects them."""
    train, evals, _ = load_splits(cfg, family)
    return train, evals


def family_metrics(cfg, family, tasks: Sequence[Task], result) -> dict:
    """The paper's metrics for the family from an eval run's traces."""
    if cfg.data.family == "scicode":
        from morse_jax.tasks.metrics import StepResult, scicode_metrics

        steps = []
        for t in tasks:
            trace = result.traces[t.task_id]
            for s in t.payload.testable_steps:
                node = trace.nodes.get(s.step_id)
                n_tests = len(s.test_cases)
                n_passed = 0
                if node is not None and node.status == "passed" and node.result is not None:
                    n_passed = int(node.result.components.get("tests_passed", 0))
                steps.append(StepResult(t.task_id, s.step_id, n_passed, n_tests))
        return dict(scicode_metrics(steps))
    if cfg.data.family == "pyfuncs":
        from morse_jax.tasks.pyfuncs.family import pyfuncs_metrics

        return pyfuncs_metrics(tasks, result)
    from morse_jax.tasks.embedding import SentenceEmbedder
    from morse_jax.tasks.srdd.family import eci_summary, evaluate_codebases, materialise_codebase

    codebases, descs = [], []
    for t in tasks:
        art = result.traces[t.task_id].final_artifact or ""
        codebases.append(materialise_codebase(art) if art else {})
        descs.append(t.description)
    scores = evaluate_codebases(descs, codebases, SentenceEmbedder.load(backend="jax"))
    return dict(eci_summary(scores))
