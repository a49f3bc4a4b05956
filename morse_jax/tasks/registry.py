"""Task families by name: build the family, load its train/eval tasks, compute its metrics."""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

from morse_jax.tasks.base import Task

FAMILIES = ("scicode", "srdd")
# SciCode steps that take > 15 s to score (DESIGN §6); kept out of fast runs when asked.
SLOW_SCICODE_STEPS = ("51.4", "47.4", "10.11")


def build_family(cfg, workdir: Path):
    fam = cfg.data.family
    if fam == "scicode":
        from morse_jax.tasks import scicode as sc

        if cfg.data.scicode_h5:
            targets = sc.H5Targets(cfg.data.scicode_h5)
        else:
            cache = cfg.data.cache_dir or str(Path(workdir).expanduser().parent / ".cache" / "scicode")
            targets = sc.RebuiltTargets(cache)
        return sc.SciCodeFamily(targets)
    if fam == "srdd":
        from morse_jax.tasks.srdd import SRDDFamily

        return SRDDFamily()
    raise ValueError(f"config.data.family must be one of {FAMILIES}, got {fam!r}")


def _select(tasks: list[Task], ids: Sequence[str], limit: int, field: str) -> list[Task]:
    if ids:
        by_id = {t.task_id: t for t in tasks}
        missing = [i for i in ids if str(i) not in by_id]
        if missing:
            raise ValueError(f"config.data.{field}: unknown task id(s) {missing}")
        tasks = [by_id[str(i)] for i in ids]
    return tasks[:limit] if limit else tasks


def _scicode_tasks(cfg, source: str, family) -> list[Task]:
    from morse_jax.tasks import scicode as sc

    if source.startswith("package:") or Path(source).expanduser().exists():
        problems = sc.load_problems(source)
    else:
        problems = sc.load_split(source, Path(cfg.data.dir) / "scicode" / "data")
    tasks = []
    for p in problems:
        if not all(family.targets.can_score(p, s) for s in p.testable_steps):
            continue  # unscorable without test_data.h5 (no ground truth to rebuild targets)
        if cfg.data.skip_slow_steps and any(s.step_id in SLOW_SCICODE_STEPS for s in p.testable_steps):
            continue
        tasks.append(sc.problem_to_task(p))
    return tasks


def load_task_splits(cfg, family) -> tuple[list[Task], list[Task]]:
    """(train tasks, eval tasks) as the config selects them."""
    d = cfg.data
    if d.family == "scicode":
        train = _scicode_tasks(cfg, d.train, family) if d.train else []
        evals = _scicode_tasks(cfg, d.eval, family) if d.eval else []
    else:
        from morse_jax.tasks.srdd import load_srdd

        root = Path(d.dir).expanduser() / "srdd" / "data"
        train = load_srdd(d.train, root) if d.train else []
        evals = load_srdd(d.eval, root) if d.eval else []
    return (_select(train, d.train_ids, d.max_train_tasks, "train_ids"),
            _select(evals, d.eval_ids, d.max_eval_tasks, "eval_ids"))


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
    from morse_jax.tasks.embedding import SentenceEmbedder
    from morse_jax.tasks.srdd import eci_summary, evaluate_codebases, materialise_codebase

    codebases, descs = [], []
    for t in tasks:
        art = result.traces[t.task_id].final_artifact or ""
        codebases.append(materialise_codebase(art) if art else {})
        descs.append(t.description)
    scores = evaluate_codebases(descs, codebases, SentenceEmbedder.load(backend="jax"))
    return dict(eci_summary(scores))
