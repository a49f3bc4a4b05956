"""Execution waves: the ready calls of every task, one batched generation, verification, settling.

A wave collects, for every task, every node whose parents all PASSED and that is not finished
(:func:`ready_calls`): a join node (>= 2 parents) first gets a merge call, its execute call comes
in a later wave. :class:`WaveRunner` lays out each call's grid of candidates (routes from one
``route_fn`` call for the wave, active expert sets), builds the prompts, generates every
candidate of the wave in one ``generate`` call, extracts and verifies the artifacts (in a bounded
thread pool, overlapped with the generation of the wave's later micro-batches:
:mod:`morse_jax.tomas.verification`), and :func:`settle` records each call: the best
gate-passing candidate propagates, or the call is retried with the verifier's diagnostic, or the
node fails and its descendants are blocked.

Split out of :mod:`morse_jax.tomas.orchestrator` (one concept per module), whose docstring
describes the rules; this module holds the machinery.
"""

from __future__ import annotations

import dataclasses
import logging
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Mapping, Sequence

import networkx as nx
import numpy as np

from morse_jax.mole.experts import ExpertBankSpec, execute_set, merge_set, single_set
from morse_jax.sampling.sampler import Completion, Request
from morse_jax.tasks.base import Task, TaskFamily, VerifyResult
from morse_jax.tasks.plan import Plan, PlanNode
from morse_jax.tomas.config import OrchestratorConfig, SamplingSettings
from morse_jax.tomas.trace import (ActiveSet, AttemptRecord, Candidate, NodeTrace, RolloutGroup, RouteDraw,
                                   RunCounters, WaveStats)
from morse_jax.tomas.verification import WaveVerification

logger = logging.getLogger("morse_jax.orchestrator")

GenerateFn = Callable[[list[Request]], list[Completion]]
OnReady = Callable[[list[int], list[Completion]], None]  # (request indices, their completions)
RouteFn = Callable[..., RouteDraw]
EncodeFn = Callable[[list[dict]], list[int]]


@dataclasses.dataclass
class TaskState:
    """One task in flight: its family, plan, per-node traces and pending diagnostics."""

    task: Task
    family: TaskFamily
    plan: Plan
    nodes: dict[str, NodeTrace]
    diagnostics: dict[tuple[str, str], str] = dataclasses.field(default_factory=dict)  # (node, role)


@dataclasses.dataclass(eq=False)
class Call:
    """One ready call of a wave: a grid of rows x cols candidates sharing one prompt."""

    ts: TaskState
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


def with_diagnostic(messages: Sequence[Mapping[str, str]], diagnostic: str) -> list[dict]:
    """Append the verifier's diagnostic to the last user message (merge regeneration)."""
    out = [dict(m) for m in messages]
    for m in reversed(out):
        if m.get("role") == "user":
            m["content"] = (f"{m['content']}\n\nYour previous answer failed verification:\n"
                            f"{diagnostic.strip()}\nFix this.")
            return out
    return out + [{"role": "user", "content": f"Your previous answer failed verification:\n{diagnostic}"}]


def build_request(config: OrchestratorConfig, prompt_ids, active: ActiveSet, s: SamplingSettings,
                  heal: bool = False) -> Request:
    """The sampler request for one candidate: prompt, active experts, decoding settings, stops."""
    return Request(prompt_ids=prompt_ids, expert_ids=tuple(e for e, _ in active),
                   expert_weights=tuple(w for _, w in active), max_new_tokens=s.max_new_tokens,
                   temperature=s.temperature, top_p=s.top_p, top_k=s.top_k,
                   stop_token_ids=config.stop_token_ids, stop_strings=config.stop_strings,
                   heal_tokens=1 if heal and len(prompt_ids) > 1 else 0)


def ready_calls(states: list[TaskState]) -> list[Call]:
    """Every call that can run now, in task then plan order (see the module docstring)."""
    calls = []
    for ts in states:
        for node in ts.plan.nodes:
            nt = ts.nodes[node.id]
            if nt.status != "pending" or any(ts.nodes[p].status != "passed" for p in node.depends_on):
                continue
            if len(node.depends_on) > 1 and nt.merge_artifact is None:
                calls.append(Call(ts, node, "merge", nt.merge_attempts + 1))
            else:
                calls.append(Call(ts, node, "execute", nt.execute_attempts + 1))
    return calls


def wave_stats(states: list[TaskState], counters: RunCounters, calls: int) -> WaveStats:
    """The progress report after a wave of ``calls`` calls."""
    statuses = [n.status for ts in states for n in ts.nodes.values()]
    done = sum(all(n.status != "pending" for n in ts.nodes.values()) for ts in states)
    return WaveStats(counters.waves, counters.requests_per_wave[-1], calls, done, len(states),
                     statuses.count("passed"), statuses.count("failed"), statuses.count("blocked"),
                     len(statuses), counters)


def settle(c: Call, grid: list[list[Candidate]], wave: int, attempts: int, counters: RunCounters) -> None:
    """Record the call's outcome; propagate the best passing candidate or schedule a retry
    (``attempts``: calls allowed per node and role before the node fails)."""
    ts = c.ts
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
    if c.attempt >= attempts:
        nt.status = "failed"
        logger.info("task %s node %s failed after %d %s attempts: %s", ts.task.task_id, c.node.id,
                    c.attempt, c.role, diagnostic)
        for d in nx.descendants(ts.plan.graph(), c.node.id):
            if ts.nodes[d].status == "pending":
                ts.nodes[d].status, ts.nodes[d].blocked_by = "blocked", c.node.id
    else:
        ts.diagnostics[(c.node.id, c.role)] = diagnostic
        counters.regenerations += 1


class WaveRunner:
    """Runs the waves of one ``Orchestrator.run`` (see the module docstring).

    Args:
      config, spec, route_fn, encode_fn, verify_collective: the orchestrator's.
      generate: ``generate_fn`` counted in ``counters`` (one call per wave), with an ``OnReady``
        hook or None (``morse_jax.tomas.verification`` says what it is for).
      rng: the orchestrator's generator for ``random_subset`` merge draws (it lives across runs).
      pool: the bounded thread pool verifying a wave's artifacts.
      counters: this run's :class:`RunCounters`.
    """

    def __init__(self, config: OrchestratorConfig, spec: ExpertBankSpec | None, route_fn: RouteFn | None,
                 encode_fn: EncodeFn, generate: Callable[[list[Request], OnReady | None], list[Completion]],
                 rng: np.random.Generator,
                 verify_collective: Callable[[Callable[[], list]], list] | None,
                 pool: ThreadPoolExecutor, counters: RunCounters):
        self.config, self.spec, self.route_fn, self.encode_fn = config, spec, route_fn, encode_fn
        self.generate, self.rng, self.verify_collective = generate, rng, verify_collective
        self.pool, self.counters = pool, counters

    def _sampling(self) -> SamplingSettings:
        return self.config.train_sampling if self.config.mode == "train" else self.config.eval_sampling

    def _layout(self, calls: list[Call]) -> None:
        """Fill each call's grid: routes (one route_fn call for the wave) and active sets."""
        cfg, spec, train = self.config, self.spec, self.config.mode == "train"
        B, M = cfg.routes_per_node, cfg.candidates_per_route
        routed = [c for c in calls if c.role == "execute" and cfg.variant in ("mole", "flat_mole")]
        routed_ids = {id(c) for c in routed}
        if routed:
            S = (B if cfg.variant == "mole" else B * M) if train else 1
            draw = self.route_fn([c.node.description for c in routed], num_samples=S, greedy=not train)
            self.counters.route_calls += 1
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

    def _merge_active(self, c: Call) -> ActiveSet:
        cfg, spec = self.config, self.spec
        if cfg.variant in ("mole", "flat_mole"):
            parents = [c.ts.nodes[p].route for p in c.node.depends_on]
            return tuple(merge_set(spec, parents, mode=cfg.merge_mode, rng=self.rng))
        return tuple(single_set(spec)) if cfg.variant == "single_lora" else ()

    @staticmethod
    def _messages(c: Call) -> list:
        ts, node = c.ts, c.node
        diag = ts.diagnostics.get((node.id, c.role))
        if c.role == "merge":
            parents = [ts.nodes[p].artifact for p in node.depends_on]
            msgs = ts.family.merge_messages(ts.task, node, parents)
            return with_diagnostic(msgs, diag) if diag else list(msgs)
        nt = ts.nodes[node.id]
        if len(node.depends_on) > 1:
            c.context = nt.merge_artifact
        elif node.depends_on:
            c.context = ts.nodes[node.depends_on[0]].artifact
        else:
            c.context = ""
        return list(ts.family.execute_messages(ts.task, node, c.context, diag))

    def _answer_prefix(self, c: Call) -> str:
        if not self.config.answer_prefix:
            return ""
        fn = getattr(c.ts.family, "answer_prefix", None)
        return fn(c.ts.task, c.node, c.role) if callable(fn) else ""

    def _extract(self, c: Call, text: str) -> tuple[str, VerifyResult | None]:
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

    def _verify(self, c: Call, artifact: str) -> tuple[VerifyResult, bool]:
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

    def run(self, calls: list[Call], groups: list[RolloutGroup]) -> None:
        """One wave over ``calls``; appends its rollout groups (train mode) to ``groups``."""
        cfg, s, counters = self.config, self._sampling(), self.counters
        wave = counters.waves + 1
        self._layout(calls)
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
                requests.extend(build_request(cfg, c.prompt_ids, active, s, heal) for _ in range(c.cols))
        counters.waves = wave
        counters.requests_per_wave.append(len(requests))
        owner = [c for c in calls for _ in range(len(c.active) * c.cols)]  # request index -> its call
        # Overlapped: each micro-batch the sampler finishes is verified while it generates the next;
        # not when one process verifies for all (verify_collective). Results in request order either way.
        overlap = cfg.verify_overlap and self.verify_collective is None
        wv = WaveVerification(len(requests), lambda j, text: self._extract(owner[j], text),
                              lambda j, artifact: self._verify(owner[j], artifact), self.pool if overlap else None)
        comps = self.generate(requests, wv.arrive if overlap else None)
        wv.complete(comps)
        # Multi-controller runs verify on process 0 only and share the results (verify_collective).
        verified = (wv.gather(self.pool) if self.verify_collective is None
                    else self.verify_collective(lambda: wv.gather(self.pool)))
        results = []
        for j, v in enumerate(verified):
            if v is None:
                results.append(wv.failed[j])
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
                    comp, art = comps[j], wv.artifacts[j]
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
            settle(c, grid, wave, cfg.attempts, counters)
