"""CLI entry: ``python -m morse_jax.main --config configs/quickstart.py [--config.field=value ...]``.

Modes (``--config.mode``): train (then eval, checkpoint, report), eval, plan (print the DAG of
``--config.task``), solve (run ``--config.task`` end to end and print the artifacts), diagnose,
describe (what the run would do, without loading weights).
"""

from __future__ import annotations

import json
import logging
import sys
import os
import time
import warnings
from pathlib import Path

from absl import app, flags
from ml_collections import config_flags

from morse_jax.config.validate import ConfigError, validate_config

_CONFIG = config_flags.DEFINE_config_file("config", "configs/quickstart.py", "Path to a config file.",
                                          lock_config=True)


def run(cfg) -> int:
    from morse_jax.run.build import Job
    from morse_jax.run.metrics_log import MetricsWriter
    from morse_jax.run.report import write_report

    from morse_jax.parallel import barrier, is_coordinator

    if cfg.mode == "describe":  # reads no weights and writes nothing
        from morse_jax.run.describe import describe

        print(describe(cfg))
        return 0
    t_start = time.time()
    workdir = Path(cfg.workdir).expanduser()
    lead = is_coordinator()  # process 0 of a multi-process run writes files and prints
    if lead:
        if cfg.fresh and cfg.mode == "train":
            _clear_run(workdir)
        workdir.mkdir(parents=True, exist_ok=True)
        # config.json is the training run's; other modes on the same workdir keep it intact.
        name = "config.json" if cfg.mode == "train" else f"config_{cfg.mode}.json"
        (workdir / name).write_text(cfg.to_json(indent=2))
    barrier("workdir ready")
    if cfg.mode in ("plan", "solve"):
        return _solve(cfg, plan_only=cfg.mode == "plan")
    if cfg.mode == "diagnose":
        from morse_jax.run.diagnose import run_diagnose

        return run_diagnose(cfg)
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
        last = job.train(writer)
        if last:
            print("last train step: " + json.dumps({k: round(v, 4) for k, v in last.items()
                                                     if isinstance(v, float)}))
    metrics = job.evaluate(writer)
    print("eval: " + json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in metrics.items()
                                 if not isinstance(v, (list, dict))}))
    train_recs = writer.read("train")
    if not lead:
        return 0
    (workdir / "eval.json").write_text(json.dumps({"comparable": _comparable(cfg), "metrics": metrics}, default=str))
    report = write_report(workdir, family=cfg.data.family, evals=[metrics, *_sibling_evals(workdir, cfg)],
                          train=train_recs,
                          run_info={"mode": cfg.mode, "variant": cfg.variant, "model": job.backbone.source,
                                    "train steps": len(train_recs), "wall time (s)": round(time.time() - t_start, 1)})
    writer.close()
    print(f"report: {report}")
    return 0


def _comparable(cfg) -> dict:
    """What must match for two runs' evaluations to share one results table."""
    d = cfg.data
    return {"model": cfg.model.path, "family": d.family, "eval": d.eval, "eval_ids": list(d.eval_ids),
            "max_eval_tasks": d.max_eval_tasks, "eval_max_new_tokens": cfg.rollout.eval_max_new_tokens}


def _sibling_evals(workdir: Path, cfg) -> list[dict]:
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
        if rec.get("comparable") == json.loads(json.dumps(_comparable(cfg))) and \
                rec["metrics"].get("variant") != cfg.variant:
            out.append(rec["metrics"])
    return out


def _clear_run(workdir: Path) -> None:
    """--config.fresh=True: drop a previous run's checkpoints, metrics and report (nothing else)."""
    import shutil

    for name in ("checkpoints", "tb"):
        shutil.rmtree(workdir / name, ignore_errors=True)
    for name in ("metrics.jsonl", "report.md", "report.json", "config.json", "eval.json"):
        (workdir / name).unlink(missing_ok=True)
    for png in workdir.glob("*.png") if workdir.exists() else ():
        png.unlink()


def _solve(cfg, *, plan_only: bool) -> int:
    """``plan``: print the validated DAG of ``config.task``; ``solve``: run it and print every artifact.

    ``config.task`` is free text (an SRDD-style software task) or ``scicode:<problem id>`` for a
    problem of ``config.data.eval`` (its steps are the nodes, scored by the problem's tests).
    """
    from morse_jax.run.build import Job
    from morse_jax.tasks.base import Task
    from morse_jax.tomas.planner.loop import render_plan
    from morse_jax.tomas.trace import render_trace

    job = Job(cfg, load_tasks=False)
    text = cfg.task.strip()
    if text.startswith("scicode:"):
        from morse_jax.tasks.registry import build_family, load_task_splits

        cfg = cfg.copy_and_resolve_references()
        with cfg.unlocked():
            cfg.data.family, cfg.data.train, cfg.data.train_ids = "scicode", "", ()
            cfg.data.eval_ids = (text.split(":", 1)[1].strip(),)
        job.family = build_family(cfg, job.workdir)
        try:
            task = load_task_splits(cfg, job.family)[1][0]
        except ValueError as e:
            raise SystemExit(f"config error: config.task: {text!r} is not a scorable problem of "
                             f"config.data.eval={cfg.data.eval!r} ({e})") from e
    else:
        from morse_jax.tasks.registry import srdd_family

        job.family = srdd_family(cfg)  # a free-text task is a software task: SRDD prompts and gated reward
        task = Task(task_id="task", description=text, family=job.family.name)
    orch = job.orchestrator("eval")
    if plan_only:
        print(render_plan(orch.plan([task])[task.task_id]))
        return 0
    result = orch.run([task])
    print(render_trace(result.traces[task.task_id]))
    return 0


def _quiet_logs() -> None:
    # absl routes every library's INFO records (orbax prints whole option dumps) to stderr;
    # progress bars and our own summary lines are the user-facing output.
    from absl import logging as absl_logging

    absl_logging.set_verbosity(absl_logging.WARNING)
    logging.getLogger().setLevel(logging.WARNING)
    logging.getLogger("morse_jax").setLevel(logging.INFO)
    warnings.filterwarnings("ignore", message=r"os\.fork\(\) was called", category=RuntimeWarning)


def main(argv):
    del argv
    cfg = _CONFIG.value
    try:
        validate_config(cfg, check_paths=cfg.mode != "describe")  # describe says what is missing
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    _quiet_logs()
    from morse_jax.parallel import initialize

    # Before any other JAX use: joins a multi-process run (explicit settings or SLURM); no-op alone.
    initialize(cfg.parallel.coordinator, cfg.parallel.num_processes, cfg.parallel.process_id)
    import jax

    if jax.process_index() != 0:  # one set of progress bars and prints per run
        os.environ["TQDM_DISABLE"] = "1"
        sys.stdout = open(os.devnull, "w")
    return run(cfg)


def _unknown_override(argv) -> str | None:
    """The first ``--config.a.b=`` override naming a field the config schema doesn't have."""
    from morse_jax.config.defaults import get_config as defaults

    schema = defaults()
    for arg in argv[1:]:
        if not arg.startswith("--config."):
            continue
        node, path = schema, arg[2:].split("=", 1)[0].split(".")[1:]
        for i, part in enumerate(path):
            if not hasattr(node, "keys") or part not in node:
                return "config." + ".".join(path[:i + 1])
            node = node[part]
    return None


def parse_flags(argv):
    """absl flag parsing, but a bad override is one line naming the field, not a traceback."""
    for i, arg in enumerate(argv[1:], 1):
        path = arg[len("--config="):] if arg.startswith("--config=") else None
        if arg == "--config" and i + 1 < len(argv):
            path = argv[i + 1]
        if path is not None and not Path(path.split(":", 1)[0]).is_file():
            print(f"config error: --config: no such config file {path.split(':', 1)[0]!r}", file=sys.stderr)
            sys.exit(2)
    try:
        return flags.FLAGS(argv)
    except flags.Error as e:
        lines = [line.strip() for line in str(e).splitlines() if line.strip()]
        # An exception inside a config file's get_config() arrives as a whole traceback.
        msg = f"{lines[0]} {lines[-1]}" if any(ln.startswith("Traceback") for ln in lines) else " ".join(lines)
    except (AttributeError, KeyError, TypeError, ValueError) as e:
        field = _unknown_override(argv)
        msg = f"{field}: unknown field" if field else f"{type(e).__name__}: {e}"
    print(f"config error: {msg}", file=sys.stderr)
    sys.exit(2)


if __name__ == "__main__":
    app.run(main, flags_parser=parse_flags)
