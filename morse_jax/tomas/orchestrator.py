"""ToMAS orchestrator: plan every task, then run all their DAGs in batched waves (DESIGN §2).

The orchestrator decides *what* to run; the injected callables do the work:

* ``generate_fn(requests: list[Request]) -> list[Completion]`` -- called once per wave with every
  ready call (merge and execute, all candidates) of every task in flight, and once per planning
  round with every task's planner prompt.
* ``route_fn(descriptions, *, num_samples, greedy) -> RouteDraw`` -- one call per wave for all
  execute nodes that need a routing decision (variants "mole" and "flat_mole").
* ``encode_fn(messages) -> list[int]`` -- chat template + tokenizer.

A wave collects, for every task, every node whose parents all PASSED and that is not finished: a
join node (>= 2 parents) first gets a merge call, its execute call comes in a later wave; one
parent gives the parent's artifact as context, none gives ''. Every artifact is verified by its
family (concurrently, in a bounded thread pool: verifiers run sandboxed subprocesses; when
``generate_fn`` accepts the keyword ``on_ready`` -- called as ``on_ready(indices, completions)``
for each finished micro-batch from the calling thread, like ``Sampler.generate`` -- those
candidates verify while the rest generate, with the same results as verifying after generation:
``tomas.verification``). The best
gate-passing candidate (highest reward, ties -> first in (route, candidate) order) is what
propagates; when none passes, the call is regenerated in the next wave with the verifier's
diagnostic, at most ``max_attempts`` times per call role (``eval_max_attempts`` in eval mode),
after which the node FAILS and all its descendants are blocked (never run). Merge calls get the diagnostic appended to their last user
message, since ``merge_messages`` has no diagnostic argument.

Plans: a family's ``fixed_plan`` (SciCode: its steps as a chain) is used as is, or, with
``fixed_plan_dependencies="planner"``, its nodes are kept and the planner infers their edges from
the step descriptions (batched with the other planner requests, re-asked on an unusable reply;
the fixed edges after ``max_replans`` rejections, the reason in ``Plan.repairs`` and the log).
Families without a fixed plan get a planner-made DAG (single-node fallback).

Optional family hooks (looked up with ``getattr``): ``planner_hint`` (str or list, passed to the
planner prompt), ``single_agent_plan(task)`` (the one-node plan in single-agent mode; default
``single_node_plan(task.description)``), ``extract_merge_artifact`` / ``verify_merge`` (same
signatures as ``extract_artifact`` / ``verify``, used for merge calls when present).

Layout (one concept per module): this module is the entry point (:class:`Orchestrator`: checks,
``run``, ``plan``); :mod:`~morse_jax.tomas.planning` plans all tasks in batched rounds;
:mod:`~morse_jax.tomas.waves` runs the waves (layout, generation, verification, settling);
:mod:`~morse_jax.tomas.config` is its configuration and :mod:`~morse_jax.tomas.trace` what a run
produces (both re-exported here).
"""

from __future__ import annotations

import contextlib
import inspect
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from morse_jax.mole.experts import ExpertBankSpec
from morse_jax.mole.router import check_top_k
from morse_jax.sampling.sampler import Completion, Request
from morse_jax.tasks.base import Task, TaskFamily
from morse_jax.tasks.plan import Plan
from morse_jax.tomas.config import ADAPTER_MODES, MERGE_MODES, MODES, OrchestratorConfig, SamplingSettings
from morse_jax.tomas.planning import check_plan, plan_tasks
from morse_jax.tomas.trace import (Candidate, NodeTrace, RolloutGroup, RouteDraw, RunCounters, RunResult,
                                   TaskTrace, WaveStats, render_trace)
from morse_jax.tomas.verification import verify_threads
from morse_jax.tomas.waves import (EncodeFn, GenerateFn, RouteFn, TaskState, WaveRunner, build_request,
                                   ready_calls, wave_stats)

__all__ = ["SamplingSettings", "OrchestratorConfig", "Orchestrator", "RouteDraw", "RolloutGroup",
           "Candidate", "NodeTrace", "TaskTrace", "RunResult", "RunCounters", "WaveStats",
           "render_trace", "check_plan", "MODES", "ADAPTER_MODES", "MERGE_MODES"]


_DEFAULT_CONFIG = OrchestratorConfig()  # frozen: one shared default instance


class Orchestrator:
    """Runs tasks through plan -> batched waves of merge/execute calls -> verification.

    Args:
      families: family name -> TaskFamily (``task.family`` selects one).
      spec: the expert bank's layout (None allowed only for variant "none").
      generate_fn, route_fn, encode_fn: see the module docstring (route_fn may be None for
        variants without a router).
      config: :class:`OrchestratorConfig`.
      verify_collective: runs a wave's verification thunk and returns its result list; a
        multi-process job passes one that runs it on process 0 only and broadcasts the results
        (``parallel.run_on_coordinator``), so sandboxed code runs once, not once per host.
      profile: a step profile (``run.profile.StepProfile``: ``phase(name)`` contexts) or None;
        planning is timed as its ``plan`` phase.
    """

    def __init__(self, families: Mapping[str, TaskFamily], spec: ExpertBankSpec | None,
                 generate_fn: GenerateFn, route_fn: RouteFn | None, encode_fn: EncodeFn,
                 config: OrchestratorConfig = _DEFAULT_CONFIG,
                 verify_collective: Callable[[Callable[[], list]], list] | None = None, profile=None):
        if not isinstance(config, OrchestratorConfig):
            raise ValueError(f"config must be an OrchestratorConfig, got {type(config).__name__}")
        if not isinstance(families, Mapping) or not families:
            raise ValueError("families must be a non-empty mapping name -> TaskFamily")
        for name, fam in families.items():
            missing = [m for m in ("execute_messages", "merge_messages", "extract_artifact", "verify",
                                   "fixed_plan") if not callable(getattr(fam, m, None))]
            if missing:
                raise ValueError(f"families[{name!r}] lacks TaskFamily method(s) {missing}")
        if not callable(generate_fn) or not callable(encode_fn):
            raise ValueError("generate_fn and encode_fn must be callables")
        v = config.variant
        if v in ("mole", "flat_mole"):
            if spec is None:
                raise ValueError(f"spec: variant {v!r} needs an ExpertBankSpec")
            for role in ("execute", "merge"):
                if role not in spec.role_names:
                    raise ValueError(f"spec.role_names must contain {role!r} for variant {v!r}, got {spec.role_names}")
            check_top_k(config.top_k, spec.num_subtask, "orchestrator.top_k", "spec.num_subtask")
            if route_fn is None or not callable(route_fn):
                raise ValueError(f"route_fn: variant {v!r} needs a router callable")
        elif v == "single_lora":
            if spec is None or spec.num_experts != 1:
                raise ValueError("spec: variant 'single_lora' needs a bank with exactly one expert")
        self.families, self.spec, self.config = dict(families), spec, config
        self.generate_fn, self.route_fn, self.encode_fn = generate_fn, route_fn, encode_fn
        self.verify_collective = verify_collective
        self._reports_ready = _accepts_keyword(generate_fn, "on_ready")
        self.profile = profile
        self._rng = np.random.default_rng(config.seed)

    @property
    def max_active(self) -> int:
        """Expert slots a request can need (the sampler's ``max_active`` must be at least this)."""
        return 0 if self.config.variant == "none" else self.spec.max_active

    # ------------------------------------------------------------------------------ public

    def run(self, tasks: Sequence[Task], plans: Mapping[str, Plan] | None = None,
            progress: Callable[[WaveStats], Any] | None = None) -> RunResult:
        """Plan (unless given) and execute ``tasks`` concurrently; see the module docstring."""
        tasks = list(tasks)
        ids = [t.task_id for t in tasks if isinstance(t, Task)]
        if len(ids) != len(tasks):
            raise ValueError("tasks must all be Task instances")
        dup = sorted({i for i in ids if ids.count(i) > 1})
        if dup:
            raise ValueError(f"tasks: duplicate task_id(s) {dup}")
        for t in tasks:
            if t.family not in self.families:
                raise ValueError(f"task {t.task_id!r}: family {t.family!r} is not registered "
                                 f"(known: {sorted(self.families)})")
        plans = dict(plans or {})
        extra = sorted(set(plans) - set(ids))
        if extra:
            raise ValueError(f"plans: given for unknown task id(s) {extra}")
        counters = RunCounters()
        with contextlib.nullcontext() if self.profile is None else self.profile.phase("plan"):
            resolved = self._plan_all(tasks, plans, counters)
        states = [
            TaskState(t, self.families[t.family], resolved[t.task_id],
                      {n.id: NodeTrace(n.id, n.depends_on) for n in resolved[t.task_id].nodes})
            for t in tasks
        ]
        groups: list[RolloutGroup] = []
        with ThreadPoolExecutor(verify_threads(self.config.verify_workers), thread_name_prefix="verify") as pool:
            waves = WaveRunner(self.config, self.spec, self.route_fn, self.encode_fn,
                               lambda requests, on_ready: self._generate(requests, counters, on_ready), self._rng,
                               self.verify_collective, pool, counters)
            while True:
                calls = ready_calls(states)
                if not calls:
                    break
                waves.run(calls, groups)
                if progress is not None:
                    progress(wave_stats(states, counters, len(calls)))
        for ts in states:
            assert all(n.status in ("passed", "failed", "blocked") for n in ts.nodes.values())
        traces = {ts.task.task_id: TaskTrace(ts.task, ts.plan, ts.nodes) for ts in states}
        return RunResult(traces, groups, counters)

    def plan(self, tasks: Sequence[Task]) -> dict[str, Plan]:
        """Plans only (fixed, single-agent or planner-made, validated and repaired): task_id -> Plan."""
        tasks = list(tasks)
        for t in tasks:
            if t.family not in self.families:
                raise ValueError(f"task {t.task_id!r}: family {t.family!r} is not registered")
        return self._plan_all(tasks, {}, RunCounters())

    # ---------------------------------------------------------------------------- internals

    def _plan_all(self, tasks: list[Task], plans: dict[str, Plan], counters: RunCounters) -> dict[str, Plan]:
        def complete(batch: list[list[dict]]) -> list[str]:
            cfg = self.config
            reqs = [build_request(cfg, self.encode_fn(messages), (), cfg.planner_sampling) for messages in batch]
            return [comp.text for comp in self._generate(reqs, counters)]

        return plan_tasks(tasks, plans, self.families, self.config, complete, counters)

    def _generate(self, requests: list[Request], counters: RunCounters, on_ready=None) -> list[Completion]:
        counters.generate_calls += 1
        counters.requests += len(requests)
        if on_ready is not None and self._reports_ready:
            comps = list(self.generate_fn(requests, on_ready=on_ready))
        else:
            comps = list(self.generate_fn(requests))
        if len(comps) != len(requests):
            raise RuntimeError(f"generate_fn returned {len(comps)} completions for {len(requests)} requests")
        return comps


def _accepts_keyword(fn: Callable, name: str) -> bool:
    """Whether ``fn`` takes the keyword ``name`` (an explicit parameter, not a ``**kwargs``)."""
    try:
        param = inspect.signature(fn).parameters.get(name)
    except (TypeError, ValueError):  # no signature (some builtins): call it the plain way
        return False
    return param is not None and param.kind in (param.POSITIONAL_OR_KEYWORD, param.KEYWORD_ONLY)
