"""What one invocation does around the job: log verbosity, the work directory (a fresh start,
the config record) and the train / eval course (train, evaluate, eval.json, report.md)."""

from __future__ import annotations

import json
import logging
import time
import warnings
from pathlib import Path


def quiet_logs() -> None:
    """Library INFO records off, ``morse_jax`` INFO on: progress bars and our own summary lines
    are the user-facing output."""
    # absl routes every library's INFO records (orbax prints whole option dumps) to stderr.
    from absl import logging as absl_logging

    absl_logging.set_verbosity(absl_logging.WARNING)
    logging.getLogger().setLevel(logging.WARNING)
    logging.getLogger("morse_jax").setLevel(logging.INFO)
    warnings.filterwarnings("ignore", message=r"os\.fork\(\) was called", category=RuntimeWarning)


def enable_compilation_cache(path: str, *, min_compile_seconds: float = 1.0) -> Path | None:
    """Keep XLA's compiled programs under ``path`` across processes (``config.compilation_cache``).

    Returns the directory, or None when ``path`` is empty (off). Call before the first compile.
    Why a threshold: reading a tiny program back costs about as much as compiling it, and the
    cache would fill with thousands of them; the programs worth keeping are the model's (tens of
    seconds each on 2 CPU cores).
    """
    if not path:
        return None
    import jax

    directory = Path(path).expanduser()
    directory.mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", str(directory))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", float(min_compile_seconds))
    return directory


def clear_run(workdir: Path) -> None:
    """--config.fresh=True: drop a previous run's checkpoints, metrics and report (nothing else)."""
    import shutil

    for name in ("checkpoints", "tb"):
        shutil.rmtree(workdir / name, ignore_errors=True)
    for name in ("metrics.jsonl", "report.md", "report.json", "config.json", "eval.json", "bfcl_answers.jsonl",
                 "bfcl_eval.json"):
        (workdir / name).unlink(missing_ok=True)
    for png in workdir.glob("*.png") if workdir.exists() else ():
        png.unlink()


def prepare_workdir(cfg, workdir: Path) -> None:
    """Create the work directory (cleared first on a fresh training run) and record the config:
    config.json is the training run's; other modes on the same workdir keep it intact."""
    if cfg.fresh and cfg.mode == "train":
        clear_run(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    name = "config.json" if cfg.mode == "train" else f"config_{cfg.mode}.json"
    (workdir / name).write_text(cfg.to_json(indent=2))


def train_and_evaluate(cfg, workdir: Path, *, lead: bool, t_start: float) -> int:
    """Modes train and eval: build the job, train (mode=train) or restore (mode=eval), evaluate,
    and on the lead process write eval.json and report.md."""
    from morse_jax.run.build import Job
    from morse_jax.run.evaluate import evaluate
    from morse_jax.run.metrics_log import MetricsWriter
    from morse_jax.run.report import comparable, sibling_evals, write_report
    from morse_jax.run.train_loop import train

    job = Job(cfg)
    print(f"morse_jax: {cfg.mode} variant={cfg.variant} model={job.backbone.source} "
          f"train_tasks={len(job.train_tasks)} eval_tasks={len(job.eval_tasks)} workdir={workdir}")
    print(job.split_report())
    if lead:
        print(job.memory_report())
    writer = MetricsWriter(workdir, enabled=lead)
    if cfg.mode == "eval":
        print(f"evaluating: {job.restore()}")
    if cfg.mode == "train":
        last = train(job, writer)
        if last:
            print("last train step: " + json.dumps({k: round(v, 4) for k, v in last.items()
                                                     if isinstance(v, float)}))
    metrics = evaluate(job, writer)
    print("eval: " + json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in metrics.items()
                                 if not isinstance(v, (list, dict))}))
    train_recs = writer.read("train")
    if not lead:
        return 0
    (workdir / "eval.json").write_text(json.dumps({"comparable": comparable(cfg), "metrics": metrics}, default=str))
    report = write_report(workdir, family=cfg.data.family, evals=[metrics, *sibling_evals(workdir, cfg)],
                          train=train_recs, step_times=writer.read("step_time"),
                          run_info={"mode": cfg.mode, "variant": cfg.variant, "model": job.backbone.source,
                                    "train steps": len(train_recs), "wall time (s)": round(time.time() - t_start, 1)})
    writer.close()
    print(f"report: {report}")
    return 0
