"""Modes ``plan`` and ``solve``: one task (free text or a SciCode problem) planned, or run end to end."""

from __future__ import annotations


def solve(cfg, *, plan_only: bool) -> int:
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
