"""One evaluation of a built job: run the evaluation tasks, score them by their family's
metrics, and add the routing summaries (router probabilities, expert-set counts, utilisation)."""

from __future__ import annotations

import time
from typing import Sequence

import numpy as np

from morse_jax.run.build import Job
from morse_jax.run.metrics_log import MetricsWriter
from morse_jax.tasks.base import Task
from morse_jax.tomas.trace import RunResult


def evaluate(job: Job, writer: MetricsWriter | None = None, *, tasks: Sequence[Task] | None = None) -> dict:
    """Metrics of one evaluation over ``tasks`` (default: the job's evaluation split); the scalar
    ones are written to ``writer`` (kind "eval", step 0). ``job.last_eval_result`` keeps the run."""
    from morse_jax.tasks.registry import family_metrics

    tasks = list(tasks if tasks is not None else job.eval_tasks)
    if not tasks:
        raise ValueError("config.data.eval: no evaluation tasks were loaded")
    t0 = time.time()
    result = job.run_tasks(tasks, "eval", f"eval {job.variant}")
    metrics = family_metrics(job.cfg, job.family, tasks, result)
    metrics.update({"variant": job.variant, "tasks": len(tasks), "eval_s": time.time() - t0,
                    "router_probs": router_probs_records(result),
                    "expert_sets": expert_set_counts(result)})
    if job.spec is not None and job.spec.num_subtask >= job.cfg.mole.top_k:
        from morse_jax.analysis.records import records_from_traces
        from morse_jax.analysis.utilisation import utilisation

        metrics["utilisation"] = utilisation(records_from_traces(result.traces),
                                             num_subtask=job.spec.num_subtask)
    if writer is not None:
        writer.write({k: v for k, v in metrics.items() if not isinstance(v, (dict, list))}, step=0,
                     kind="eval")
    job.last_eval_result = result
    return metrics


def count_nodes(result: RunResult, status: str | None) -> int:
    """Nodes of every trace with ``status`` (None: all nodes)."""
    return sum(1 for tr in result.traces.values() for n in tr.nodes.values() if status is None or n.status == status)


def router_probs_records(result: RunResult) -> list:
    """[{"task", "node", "probs": pi(.|s) rounded to 4 places}] for every routed node."""
    out = []
    for tid, tr in result.traces.items():
        for nid, n in tr.nodes.items():
            if getattr(n, "route_probs", None) is not None:
                out.append({"task": tid, "node": nid, "probs": np.asarray(n.route_probs).round(4).tolist()})
    return out


def expert_set_counts(result: RunResult) -> dict[str, int]:
    """How often each routed subtask-expert set was used at execute calls (paper Table 5 layout)."""
    counts: dict[str, int] = {}
    for tr in result.traces.values():
        for n in tr.nodes.values():
            route = getattr(n, "route", None)
            if route:
                key = "+".join(f"S{int(k)}" for k in sorted(route))
                counts[key] = counts.get(key, 0) + 1
    return counts
