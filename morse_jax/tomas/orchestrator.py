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
family (concurrently, in a thread pool: verifiers run sandboxed subprocesses). The best
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
"""

from __future__ import annotations

import dataclasses
import logging
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Mapping, Sequence

import networkx as nx
import numpy as np

from morse_jax.mole.experts import ExpertBankSpec, execute_set, merge_set, single_set
from morse_jax.sampling.sampler import Completion, Request
from morse_jax.tasks.base import Task, TaskFamily, VerifyResult
from morse_jax.tomas.planner import loop as _planner
from morse_jax.tomas.planner.prompts import PLACEHOLDER_DESCRIPTION, replan_messages
from morse_jax.tasks.plan import Plan, PlanNode
from morse_jax.tomas.planner.fixed import (DEPENDENCIES_PREFIX, dependencies_plan, infer_dependencies_messages,
                                           with_dependencies_of)
from morse_jax.tomas.trace import (MERGE_MODES, MODES, VARIANTS, ActiveSet, AttemptRecord, Candidate,
                                     NodeTrace, OrchestratorConfig, RolloutGroup, RouteDraw, RunCounters,
                                     RunResult, SamplingSettings, TaskTrace, WaveStats, render_trace)

__all__ = ["SamplingSettings", "OrchestratorConfig", "Orchestrator", "RouteDraw", "RolloutGroup",
           "Candidate", "NodeTrace", "TaskTrace", "RunResult", "RunCounters", "WaveStats",
           "render_trace", "MODES", "VARIANTS", "MERGE_MODES"]

logger = logging.getLogger("morse_jax.orchestrator")

GenerateFn = Callable[[list[Request]], list[Completion]]
RouteFn = Callable[..., RouteDraw]
EncodeFn = Callable[[list[dict]], list[int]]


# --------------------------------------------------------------------------------- internals


@dataclasses.dataclass
class _TaskState:
    task: Task
    family: TaskFamily
    plan: Plan
    nodes: dict[str, NodeTrace]
    diagnostics: dict[tuple[str, str], str] = dataclasses.field(default_factory=dict)  # (node, role)


@dataclasses.dataclass(eq=False)
class _Call:
    """One ready call of a wave: a grid of rows x cols candidates sharing one prompt."""

    ts: _TaskState
    node: PlanNode
    role: str
    attempt: int
    prompt_ids: list[int] = dataclasses.field(default_factory=list)
    routes: list[tuple[int, ...]] = dataclasses.field(default_factory=list)  # per row ([] = no router)
    route_logp: list[float] = dataclasses.field(default_factory=list)
    route_probs: np.ndarray | None = None
    active: list[ActiveSet] = dataclasses.field(default_factory=list)  # per row
    cols: int = 1
    context: str = ""
    prefix: str = ""  # the answer's given start (TaskFamily.answer_prefix), part of the prompt
    start: int = 0  # first request index of this call in the wave


def _with_diagnostic(messages: Sequence[Mapping[str, str]], diagnostic: str) -> list[dict]:
    """Append the verifier's diagnostic to the last user message (merge regeneration)."""
    out = [dict(m) for m in messages]
    for m in reversed(out):
        if m.get("role") == "user":
            m["content"] = (f"{m['content']}\n\nYour previous answer failed verification:\n"
                            f"{diagnostic.strip()}\nFix this.")
            return out
    return out + [{"role": "user", "content": f"Your previous answer failed verification:\n{diagnostic}"}]


def check_plan(plan: Plan, where: str) -> None:
    """Raise ValueError unless ``plan`` is a non-empty DAG with nodes in topological order."""
    if not isinstance(plan, Plan):
        raise ValueError(f"{where}: must be a Plan, got {type(plan).__name__}")
    if not plan.nodes:
        raise ValueError(f"{where}: the plan has no nodes")
    seen: set[str] = set()
    for n in plan.nodes:
        if not isinstance(n, PlanNode) or not n.id or n.id in seen:
            raise ValueError(f"{where}: node {getattr(n, 'id', n)!r} is not a PlanNode with a unique id")
        for p in n.depends_on:
            if p not in seen:
                raise ValueError(f"{where}: node {n.id!r} depends on {p!r}, which is not an earlier node")
        seen.add(n.id)


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
    """

    def __init__(self, families: Mapping[str, TaskFamily], spec: ExpertBankSpec | None,
                 generate_fn: GenerateFn, route_fn: RouteFn | None, encode_fn: EncodeFn,
                 config: OrchestratorConfig = OrchestratorConfig(),
                 verify_collective: Callable[[Callable[[], list]], list] | None = None):
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
            if config.top_k > spec.num_subtask:
                raise ValueError(f"orchestrator.top_k={config.top_k} exceeds spec.num_subtask={spec.num_subtask}")
            if route_fn is None or not callable(route_fn):
                raise ValueError(f"route_fn: variant {v!r} needs a router callable")
        elif v == "single_lora":
            if spec is None or spec.num_experts != 1:
                raise ValueError("spec: variant 'single_lora' needs a bank with exactly one expert")
        self.families, self.spec, self.config = dict(families), spec, config
        self.generate_fn, self.route_fn, self.encode_fn = generate_fn, route_fn, encode_fn
        self.verify_collective = verify_collective
        self._rng = np.random.default_rng(config.seed)

    @property
    def max_active(self) -> int:
        """Expert slots a request can need (the sampler's ``max_active`` must be at least this)."""
        if self.config.variant in ("mole", "flat_mole"):
            return 1 + self.spec.num_subtask  # a union merge can hold every subtask expert
        return 1 if self.config.variant == "single_lora" else 0

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
        resolved = self._plan_all(tasks, plans, counters)
        states = [
            _TaskState(t, self.families[t.family], resolved[t.task_id],
                       {n.id: NodeTrace(n.id, n.depends_on) for n in resolved[t.task_id].nodes})
            for t in tasks
        ]
        groups: list[RolloutGroup] = []
        with ThreadPoolExecutor(max_workers=self.config.verify_workers) as pool:
            while True:
                calls = self._ready_calls(states)
                if not calls:
                    break
                self._wave(calls, counters, groups, pool)
                if progress is not None:
                    progress(self._wave_stats(states, counters, len(calls)))
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

    # ---------------------------------------------------------------------------- planning

    def _plan_all(self, tasks: list[Task], plans: dict[str, Plan], counters: RunCounters) -> dict[str, Plan]:
        cfg, out, todo = self.config, {}, []
        if cfg.single_agent and plans:
            raise ValueError("plans: explicit plans cannot be combined with single_agent mode")
        for t in tasks:
            fam = self.families[t.family]
            if t.task_id in plans:
                check_plan(plans[t.task_id], f"plans[{t.task_id!r}]")
                out[t.task_id] = plans[t.task_id]
            elif cfg.single_agent:
                make = getattr(fam, "single_agent_plan", None)
                out[t.task_id] = make(t) if callable(make) else _planner.single_node_plan(t.description)
                check_plan(out[t.task_id], f"single-agent plan of task {t.task_id!r}")
            else:
                fixed = fam.fixed_plan(t)
                if fixed is not None:
                    check_plan(fixed, f"fixed plan of task {t.task_id!r}")
                    if cfg.fixed_plan_dependencies == "planner" and len(fixed.nodes) > 1:
                        todo.append((t, fixed))  # the planner infers the edges among the fixed steps
                    else:
                        out[t.task_id] = fixed
                else:
                    todo.append((t, None))
        # task_id -> (base messages, current messages, rejection notes, fixed plan or None)
        pending = {}
        for t, fixed in todo:
            if fixed is None:
                base = _planner.planner_messages(t.description, min_nodes=cfg.min_nodes, max_nodes=cfg.max_nodes,
                                                 roles_hint=getattr(self.families[t.family], "planner_hint", None))
            else:
                base = infer_dependencies_messages(t.description, [(n.id, n.description) for n in fixed.nodes])
            pending[t.task_id] = (base, base, [], fixed)
        for rnd in range(1, cfg.max_replans + 2):
            if not pending:
                break
            order = list(pending)
            starts = {tid: self._planner_start(pending[tid][3]) for tid in order}
            reqs = [self._request(self.encode_fn([*pending[i][1], *([{"role": "assistant", "content": starts[i]}]
                                                                   if starts[i] else [])]), (), cfg.planner_sampling)
                    for i in order]
            counters.planner_rounds += 1
            counters.planner_requests.append(len(reqs))
            if rnd > 1:
                counters.replans += len(reqs)
            comps = self._generate(reqs, counters)
            for tid, comp in zip(order, comps):
                base, _, notes, fixed = pending[tid]
                text = starts[tid] + comp.text
                try:
                    plan = self._parse_plan(text) if fixed is None else self._parse_dependencies(text, fixed)
                except ValueError as e:  # PlanParseError / PlanValidationError
                    note = f"planner attempt {rnd} rejected: {e}"
                    logger.warning("task %s: %s", tid, note)
                    pending[tid] = (base, replan_messages(base, text, str(e)), notes + [note], fixed)
                    continue
                for r in plan.repairs:
                    logger.info("task %s: plan repair: %s", tid, r)
                out[tid] = dataclasses.replace(plan, repairs=(*notes, *plan.repairs))
                del pending[tid]
        by_id = {t.task_id: t for t in tasks}
        for tid, (_, _, notes, fixed) in pending.items():
            counters.plan_fallbacks += 1
            if fixed is None:
                note = f"fell back to a single-node plan after {cfg.max_replans + 1} rejected planner attempts"
                out[tid] = _planner.single_node_plan(by_id[tid].description, [*notes, note])
            else:
                note = (f"kept the fixed plan's dependencies after {cfg.max_replans + 1} rejected "
                        "dependency-planner attempts")
                out[tid] = dataclasses.replace(fixed, repairs=(*fixed.repairs, *notes, note))
            logger.warning("task %s: %s", tid, note)
        return {t.task_id: out[t.task_id] for t in tasks}

    def _planner_start(self, fixed: Plan | None) -> str:
        """The planner answer's given start: ``planner_prefix``, or its dependency-list counterpart."""
        if not self.config.planner_prefix:
            return ""
        return self.config.planner_prefix if fixed is None else DEPENDENCIES_PREFIX

    def _parse_dependencies(self, text: str, fixed: Plan) -> Plan:
        inferred = dependencies_plan(text, [(n.id, n.description) for n in fixed.nodes])
        plan = with_dependencies_of(fixed, inferred)
        check_plan(plan, "inferred dependencies")
        return plan

    def _parse_plan(self, text: str) -> Plan:
        obj = _planner.extract_json_object(text, prefer_keys=("nodes", *_planner.NODE_LIST_ALIASES))
        plan = _planner.validate_plan(obj, min_nodes=self.config.min_nodes, max_nodes=self.config.max_nodes)
        if any(n.description == PLACEHOLDER_DESCRIPTION for n in plan.nodes):
            raise _planner.PlanValidationError(
                "the plan copies the placeholder example instead of planning the task")
        return plan

    # ------------------------------------------------------------------------------- waves

    def _ready_calls(self, states: list[_TaskState]) -> list[_Call]:
        calls = []
        for ts in states:
            for node in ts.plan.nodes:
                nt = ts.nodes[node.id]
                if nt.status != "pending" or any(ts.nodes[p].status != "passed" for p in node.depends_on):
                    continue
                if len(node.depends_on) > 1 and nt.merge_artifact is None:
                    calls.append(_Call(ts, node, "merge", nt.merge_attempts + 1))
                else:
                    calls.append(_Call(ts, node, "execute", nt.execute_attempts + 1))
        return calls

    def _sampling(self) -> SamplingSettings:
        return self.config.train_sampling if self.config.mode == "train" else self.config.eval_sampling

    def _request(self, prompt_ids, active: ActiveSet, s: SamplingSettings, heal: bool = False) -> Request:
        return Request(prompt_ids=prompt_ids, expert_ids=tuple(e for e, _ in active),
                       expert_weights=tuple(w for _, w in active), max_new_tokens=s.max_new_tokens,
                       temperature=s.temperature, top_p=s.top_p, top_k=s.top_k,
                       stop_token_ids=self.config.stop_token_ids, stop_strings=self.config.stop_strings,
                       heal_tokens=1 if heal and len(prompt_ids) > 1 else 0)

    def _generate(self, requests: list[Request], counters: RunCounters) -> list[Completion]:
        counters.generate_calls += 1
        counters.requests += len(requests)
        comps = list(self.generate_fn(requests))
        if len(comps) != len(requests):
            raise RuntimeError(f"generate_fn returned {len(comps)} completions for {len(requests)} requests")
        return comps

    def _layout(self, calls: list[_Call], counters: RunCounters) -> None:
        """Fill each call's grid: routes (one route_fn call for the wave) and active sets."""
        cfg, spec, train = self.config, self.spec, self.config.mode == "train"
        B, M = cfg.routes_per_node, cfg.candidates_per_route
        routed = [c for c in calls if c.role == "execute" and cfg.variant in ("mole", "flat_mole")]
        routed_ids = {id(c) for c in routed}
        if routed:
            S = (B if cfg.variant == "mole" else B * M) if train else 1
            draw = self.route_fn([c.node.description for c in routed], num_samples=S, greedy=not train)
            counters.route_calls += 1
            if not isinstance(draw, RouteDraw):
                raise ValueError(f"route_fn must return a RouteDraw, got {type(draw).__name__}")
            draw.check(len(routed), S, cfg.top_k, spec.num_subtask)
            members, logp, probs = np.asarray(draw.members), np.asarray(draw.set_logp), np.asarray(draw.probs)
            for i, c in enumerate(routed):
                c.routes = [tuple(int(k) for k in members[i, s]) for s in range(S)]
                c.route_logp = [float(x) for x in logp[i]]
                c.route_probs = probs[i].copy()
                c.active = [tuple(execute_set(spec, r)) for r in c.routes]
                c.cols = M if (train and cfg.variant == "mole") else 1
        for c in calls:
            if id(c) in routed_ids:
                continue
            if c.role == "merge":
                # Alg. 1: "Merger nodes follow the same loop" -- B rows of M, each row one draw of the
                # inherited set (no router decision: rows carry no route, A_cross drops out)
                rows = B if (train and cfg.merge_candidates == "routes_x_candidates") else 1
                c.active = [self._merge_active(c) for _ in range(rows)]
                c.cols = M if train else 1
            else:
                active = tuple(single_set(spec)) if cfg.variant == "single_lora" else ()
                c.active, c.cols = [active], (B * M if train else 1)

    def _merge_active(self, c: _Call) -> ActiveSet:
        cfg, spec = self.config, self.spec
        if cfg.variant in ("mole", "flat_mole"):
            parents = [c.ts.nodes[p].route for p in c.node.depends_on]
            return tuple(merge_set(spec, parents, mode=cfg.merge_mode, rng=self._rng))
        return tuple(single_set(spec)) if cfg.variant == "single_lora" else ()

    def _messages(self, c: _Call) -> list:
        ts, node = c.ts, c.node
        diag = ts.diagnostics.get((node.id, c.role))
        if c.role == "merge":
            parents = [ts.nodes[p].artifact for p in node.depends_on]
            msgs = ts.family.merge_messages(ts.task, node, parents)
            return _with_diagnostic(msgs, diag) if diag else list(msgs)
        nt = ts.nodes[node.id]
        if len(node.depends_on) > 1:
            c.context = nt.merge_artifact
        elif node.depends_on:
            c.context = ts.nodes[node.depends_on[0]].artifact
        else:
            c.context = ""
        return list(ts.family.execute_messages(ts.task, node, c.context, diag))

    def _answer_prefix(self, c: _Call) -> str:
        if not self.config.answer_prefix:
            return ""
        fn = getattr(c.ts.family, "answer_prefix", None)
        return fn(c.ts.task, c.node, c.role) if callable(fn) else ""

    def _extract(self, c: _Call, text: str) -> tuple[str, VerifyResult | None]:
        fam = c.ts.family
        fn = getattr(fam, "extract_merge_artifact", None) if c.role == "merge" else None
        fn = fn if callable(fn) else fam.extract_artifact
        try:
            return fn(c.ts.task, c.node, c.prefix + text), None
        except Exception as e:  # untrusted text must not crash a long run; counted and logged
            if self.config.raise_verifier_errors:
                raise
            logger.warning("task %s node %s: extract_artifact raised", c.ts.task.task_id, c.node.id, exc_info=True)
            return "", VerifyResult(False, 0.0, f"could not extract an artifact ({type(e).__name__}: {e})")

    def _verify(self, c: _Call, artifact: str) -> tuple[VerifyResult, bool]:
        fam = c.ts.family
        fn = getattr(fam, "verify_merge", None) if c.role == "merge" else None
        fn = fn if callable(fn) else fam.verify
        try:
            res = fn(c.ts.task, c.node, artifact)
            if not isinstance(res, VerifyResult):
                raise TypeError(f"verify returned {type(res).__name__}, not VerifyResult")
            return res, False
        except Exception as e:
            if self.config.raise_verifier_errors:
                raise
            logger.warning("task %s node %s: verifier raised", c.ts.task.task_id, c.node.id, exc_info=True)
            return VerifyResult(False, 0.0, f"verifier error ({type(e).__name__}: {e})"), True

    def _wave(self, calls: list[_Call], counters: RunCounters, groups: list[RolloutGroup],
              pool: ThreadPoolExecutor) -> None:
        cfg, s = self.config, self._sampling()
        wave = counters.waves + 1
        self._layout(calls, counters)
        requests: list[Request] = []
        for c in calls:
            messages = self._messages(c)
            c.prefix = self._answer_prefix(c)
            if c.prefix:  # the model continues it (e.g. a SciCode step's header): a scaffold, not a hint
                messages = [*messages, {"role": "assistant", "content": c.prefix}]
            c.prompt_ids = list(self.encode_fn(messages))
            c.start = len(requests)
            heal = bool(c.prefix) and cfg.heal_answer_prefix  # the prefix's last token is re-written
            for active in c.active:
                requests.extend(self._request(c.prompt_ids, active, s, heal) for _ in range(c.cols))
        counters.waves = wave
        counters.requests_per_wave.append(len(requests))
        comps = self._generate(requests, counters)
        # Extraction runs here in call order (families may keep per-node state); verification in threads.
        jobs = []
        for c in calls:
            for j in range(len(c.active) * c.cols):
                text = comps[c.start + j].text
                artifact, failed = self._extract(c, text)
                jobs.append((c, artifact, failed))

        def verify_wave() -> list[tuple[VerifyResult, bool] | None]:
            futures = [None if failed else pool.submit(self._verify, c, art) for c, art, failed in jobs]
            return [None if fut is None else fut.result() for fut in futures]

        # Multi-controller runs verify on process 0 only and share the results (verify_collective).
        verified = verify_wave() if self.verify_collective is None else self.verify_collective(verify_wave)
        results = []
        for (c, art, failed), v in zip(jobs, verified):
            if v is None:
                results.append(failed)
                continue
            res, err = v
            counters.verifier_calls += 1
            counters.verifier_errors += int(err)
            results.append(res)
        for c in calls:
            grid = []
            for r, active in enumerate(c.active):
                row = []
                for m in range(c.cols):
                    j = c.start + r * c.cols + m
                    comp, (_, art, _) = comps[j], jobs[j]
                    # a healed completion continues a shorter prompt (Completion.prompt_len)
                    prompt = c.prompt_ids[:comp.prompt_len] if getattr(comp, "healed_text", "") else c.prompt_ids
                    row.append(Candidate(prompt, list(comp.token_ids), np.asarray(comp.logprobs, np.float32),
                                         tuple(e for e, _ in active), tuple(w for _, w in active), comp.text, art,
                                         results[j], comp.finish_reason,
                                         getattr(comp, "prefix_states", None) if cfg.mode == "train" else None))
                grid.append(row)
            if cfg.mode == "train":
                groups.append(RolloutGroup.build(c.ts.task.task_id, c.node.id, c.role, c.attempt,
                                                 c.node.description, c.routes, c.route_logp, grid))
            self._settle(c, grid, wave, counters)

    def _settle(self, c: _Call, grid: list[list[Candidate]], wave: int, counters: RunCounters) -> None:
        """Record the call's outcome; propagate the best passing candidate or schedule a retry."""
        cfg, ts = self.config, c.ts
        nt = ts.nodes[c.node.id]
        flat = [(r, cand) for r, row in enumerate(grid) for cand in row]
        passing = [(r, cand) for r, cand in flat if cand.gate]
        best = max(passing, key=lambda rc: rc[1].reward) if passing else None  # max keeps the first tie
        chosen_r, chosen = best if best is not None else flat[0]
        diagnostic = ""
        if best is None:
            diagnostic = next((cand.result.diagnostic for _, cand in flat if cand.result.diagnostic.strip()),
                              "the answer failed verification")
        nt.history.append(AttemptRecord(
            c.role, c.attempt, tuple(dict.fromkeys(c.active)), len(flat), len(passing),
            max(cand.reward for _, cand in flat), best is not None, diagnostic, wave))
        active = c.active[chosen_r]
        if c.role == "merge":
            nt.merge_attempts = c.attempt
            nt.merge_result, nt.merge_text, nt.merge_active_set = chosen.result, chosen.text, active
            if best is not None:
                nt.merge_artifact = chosen.artifact
        else:
            nt.execute_attempts = c.attempt
            nt.result, nt.text, nt.active_set, nt.context = chosen.result, chosen.text, active, c.context
            nt.route = c.routes[chosen_r] if c.routes else ()
            nt.route_probs = c.route_probs
            if best is not None:
                nt.artifact, nt.status = chosen.artifact, "passed"
        if best is not None:
            ts.diagnostics.pop((c.node.id, c.role), None)
            return
        if c.attempt >= cfg.attempts:
            nt.status = "failed"
            logger.info("task %s node %s failed after %d %s attempts: %s", ts.task.task_id, c.node.id,
                        c.attempt, c.role, diagnostic)
            for d in nx.descendants(ts.plan.graph(), c.node.id):
                if ts.nodes[d].status == "pending":
                    ts.nodes[d].status, ts.nodes[d].blocked_by = "blocked", c.node.id
        else:
            ts.diagnostics[(c.node.id, c.role)] = diagnostic
            counters.regenerations += 1

    def _wave_stats(self, states: list[_TaskState], counters: RunCounters, calls: int) -> WaveStats:
        statuses = [n.status for ts in states for n in ts.nodes.values()]
        done = sum(all(n.status != "pending" for n in ts.nodes.values()) for ts in states)
        return WaveStats(counters.waves, counters.requests_per_wave[-1], calls, done, len(states),
                         statuses.count("passed"), statuses.count("failed"), statuses.count("blocked"),
                         len(statuses), counters)
