"""What one orchestrator run produces: route draws, rollout groups, per-task traces, counters.

The orchestrator's configuration is :mod:`morse_jax.tomas.config`.

Shapes (B = routes per node, M = candidates per route, k = router top-K, K_s = subtask experts):

* :class:`RouteDraw` is what the injected router returns for N execute nodes of one wave.
* :class:`RolloutGroup` is one credit group for the trainer (``morse_jax.rl.batch``): the
  candidates of one (task, node, attempt, role) with rewards ``float32[B, M]``. Variant C
  ("flat_mole") has ``[B*M, 1]`` (one route per candidate); variant B ("single_lora") and merge
  calls have one route and no router decision (``routes == []``).
* :class:`TaskTrace` records what happened at every node (for metrics, reports and ``solve``).
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

from morse_jax.tasks.base import Task, VerifyResult
from morse_jax.tasks.plan import Plan
from morse_jax.tomas.planner.loop import render_plan

NODE_STATUSES = ("passed", "failed", "blocked")
ROLES = ("execute", "merge")

ActiveSet = tuple[tuple[int, float], ...]  # ((bank expert id, weight), ...); () = no adapter


@dataclasses.dataclass(frozen=True)
class RouteDraw:
    """Router output for N subtask descriptions, S routes each.

    members: int[N, S, k] router expert indices in [0, K_s), distinct within a route.
    set_logp: float[N, S] behaviour log-probability of each drawn (unordered) set.
    probs: float[N, K_s] routing distribution pi(.|s_i) (kept in traces for utilisation analysis).
    """

    members: np.ndarray
    set_logp: np.ndarray
    probs: np.ndarray

    def check(self, n: int, s: int, k: int, num_subtask: int) -> None:
        """Raise ValueError unless the shapes and values match what was asked for."""
        members = np.asarray(self.members)
        set_logp = np.asarray(self.set_logp)
        probs = np.asarray(self.probs)
        if members.shape != (n, s, k):
            raise ValueError(f"route_fn: members has shape {members.shape}, expected {(n, s, k)}")
        if not np.issubdtype(members.dtype, np.integer):
            raise ValueError(f"route_fn: members must be integers, got dtype {members.dtype}")
        if set_logp.shape != (n, s):
            raise ValueError(f"route_fn: set_logp has shape {set_logp.shape}, expected {(n, s)}")
        if probs.shape != (n, num_subtask):
            raise ValueError(f"route_fn: probs has shape {probs.shape}, expected {(n, num_subtask)}")
        if members.size and (members.min() < 0 or members.max() >= num_subtask):
            raise ValueError(f"route_fn: members must lie in [0, {num_subtask}), got "
                             f"[{members.min()}, {members.max()}]")
        if k > 1 and members.size:
            srt = np.sort(members, axis=-1)
            if np.any(srt[..., 1:] == srt[..., :-1]):
                raise ValueError("route_fn: a route repeats an expert (routes are sets without replacement)")
        if not np.all(np.isfinite(set_logp)):
            raise ValueError("route_fn: set_logp has non-finite entries")


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One sampled completion of one call, with its artifact's verification.

    prompt_ids / token_ids / logprobs (float32[len(token_ids)], behaviour log-probs) and the
    active set (expert_ids, expert_weights) are what the LoRA loss re-scores.
    """

    prompt_ids: Sequence[int]
    token_ids: Sequence[int]
    logprobs: np.ndarray
    expert_ids: tuple[int, ...]
    expert_weights: tuple[float, ...]
    text: str
    artifact: str
    result: VerifyResult
    finish_reason: str = ""
    # the sampler's residual stream entering the first adapted layer (Completion.prefix_states),
    # kept for the update in train mode; None otherwise
    prefix_states: np.ndarray | None = dataclasses.field(default=None, repr=False, compare=False)

    @property
    def reward(self) -> float:
        return float(self.result.reward)

    @property
    def gate(self) -> bool:
        return bool(self.result.gate)


@dataclasses.dataclass(frozen=True)
class RolloutGroup:
    """One credit group of the trainer (see the module docstring for its shapes).

    Attributes:
      task_id, node_id, role ("execute" | "merge"), attempt (1-based).
      description: the subtask description s_i (the router's input).
      routes: one tuple of router indices per row of ``rewards``; [] when no router decided.
      route_set_logp_old: float32[len(routes)] behaviour log pi(set | s_i) of each route.
      candidates: [rows][cols] :class:`Candidate`, rows x cols = ``rewards.shape``.
      rewards: float32[rows, cols] verifier rewards u[b, m].
    """

    task_id: str
    node_id: str
    role: str
    attempt: int
    description: str
    routes: list[tuple[int, ...]]
    route_set_logp_old: np.ndarray
    candidates: list[list[Candidate]]
    rewards: np.ndarray

    @staticmethod
    def build(task_id: str, node_id: str, role: str, attempt: int, description: str,
              routes: list[tuple[int, ...]], route_set_logp: Sequence[float],
              candidates: list[list[Candidate]]) -> "RolloutGroup":
        rewards = np.asarray([[c.reward for c in row] for row in candidates], np.float32)
        if rewards.ndim != 2 or rewards.size == 0:
            raise ValueError(f"group {task_id}/{node_id}: candidates must be a non-empty [rows][cols] grid")
        logp = np.asarray(route_set_logp, np.float32).reshape(-1)
        if routes and (len(routes) != rewards.shape[0] or logp.shape[0] != len(routes)):
            raise ValueError(f"group {task_id}/{node_id}: {len(routes)} routes, {logp.shape[0]} log-probs "
                             f"and {rewards.shape[0]} candidate rows must agree")
        if not routes and logp.size:
            raise ValueError(f"group {task_id}/{node_id}: route log-probs given without routes")
        return RolloutGroup(task_id, node_id, role, attempt, description, list(routes), logp,
                            candidates, rewards)


@dataclasses.dataclass(frozen=True)
class AttemptRecord:
    """One call (a merge or an execute attempt) at a node: what ran and how it scored."""

    role: str
    attempt: int
    active_sets: tuple[ActiveSet, ...]  # distinct active sets used by this call's candidates
    num_candidates: int
    num_passed: int
    best_reward: float
    passed: bool
    diagnostic: str  # the diagnostic fed to the next attempt ('' when the call passed)
    wave: int


@dataclasses.dataclass
class NodeTrace:
    """What happened at one node (filled in during the run; read-only afterwards).

    status: "passed", "failed" (attempts exhausted) or "blocked" (an ancestor failed; never run).
    artifact: the propagated artifact (best gate-passing candidate) or None.
    result / text / active_set / route: of the chosen execute candidate (the best passing one; for
      a failed node, the first candidate of the last attempt).
    context: the context C_i given to the execute call (parent artifact, merge artifact or '').
    merge_*: the same for the merge call of a join node (None when there was none).
    route_probs: the router's distribution pi(.|s_i) at the last execute attempt (None without router).
    """

    node_id: str
    parents: tuple[str, ...]
    status: str = "pending"
    execute_attempts: int = 0
    merge_attempts: int = 0
    artifact: str | None = None
    result: VerifyResult | None = None
    text: str | None = None
    active_set: ActiveSet = ()
    route: tuple[int, ...] = ()
    route_probs: np.ndarray | None = None
    context: str | None = None
    merge_artifact: str | None = None
    merge_result: VerifyResult | None = None
    merge_text: str | None = None
    merge_active_set: ActiveSet = ()
    blocked_by: str | None = None
    history: list[AttemptRecord] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class TaskTrace:
    """One task's plan and per-node traces (``nodes`` in the plan's topological order)."""

    task: Task
    plan: Plan
    nodes: dict[str, NodeTrace]

    @property
    def all_passed(self) -> bool:
        return all(n.status == "passed" for n in self.nodes.values())

    @property
    def final_node_id(self) -> str:
        """The last node in topological order (for SRDD its artifact is the finished codebase)."""
        return self.plan.nodes[-1].id

    @property
    def final_artifact(self) -> str | None:
        return self.nodes[self.final_node_id].artifact

    def sink_ids(self) -> list[str]:
        """Nodes no other node depends on, in plan order."""
        used = {p for n in self.plan.nodes for p in n.depends_on}
        return [n.id for n in self.plan.nodes if n.id not in used]

    def status_counts(self) -> dict[str, int]:
        out = dict.fromkeys(NODE_STATUSES, 0)
        for n in self.nodes.values():
            out[n.status] = out.get(n.status, 0) + 1
        return out


@dataclasses.dataclass
class RunCounters:
    """Work done by one ``Orchestrator.run``.

    waves / requests_per_wave: execution waves (one generate_fn call each).
    generate_calls: all generate_fn calls (planning rounds + waves).
    planner_requests: planner requests per planning round.
    """

    waves: int = 0
    generate_calls: int = 0
    requests: int = 0
    requests_per_wave: list[int] = dataclasses.field(default_factory=list)
    planner_rounds: int = 0
    planner_requests: list[int] = dataclasses.field(default_factory=list)
    replans: int = 0
    plan_fallbacks: int = 0
    route_calls: int = 0
    verifier_calls: int = 0
    verifier_errors: int = 0
    regenerations: int = 0


@dataclasses.dataclass(frozen=True)
class WaveStats:
    """Passed to the progress callback after every wave."""

    wave: int
    requests: int
    calls: int
    tasks_done: int
    tasks_total: int
    nodes_passed: int
    nodes_failed: int
    nodes_blocked: int
    nodes_total: int
    counters: RunCounters


@dataclasses.dataclass
class RunResult:
    """traces: task_id -> TaskTrace in input order; groups: RolloutGroups (train mode only)."""

    traces: dict[str, TaskTrace]
    groups: list[RolloutGroup]
    counters: RunCounters


def _fmt_set(active: ActiveSet) -> str:
    return "{" + ", ".join(f"{e}:{w:.2f}" for e, w in active) + "}" if active else "{} (no adapter)"


def render_trace(trace: TaskTrace, *, max_artifact_chars: int | None = None) -> str:
    """Readable text: the DAG, then each node's status, attempts, experts, reward and artifact."""
    counts = trace.status_counts()
    lines = [f"Task {trace.task.task_id} ({trace.task.family}): "
             + ", ".join(f"{v} {k}" for k, v in counts.items() if v), render_plan(trace.plan), ""]
    for node in trace.plan.nodes:
        nt = trace.nodes[node.id]
        head = f"== {node.id}: {node.title} [{nt.status}]"
        if nt.status == "blocked":
            lines.append(f"{head} blocked by failed node {nt.blocked_by}")
            continue
        lines.append(f"{head} execute attempts {nt.execute_attempts}"
                     + (f", merge attempts {nt.merge_attempts}" if nt.merge_attempts else ""))
        if nt.merge_attempts:
            lines.append(f"   merge experts {_fmt_set(nt.merge_active_set)}")
        lines.append(f"   execute experts {_fmt_set(nt.active_set)}"
                     + (f" (router picks {list(nt.route)})" if nt.route else ""))
        if nt.result is not None:
            comps = ", ".join(f"{k}={v:.3g}" for k, v in nt.result.components.items())
            lines.append(f"   gate {'pass' if nt.result.gate else 'FAIL'}, reward {nt.result.reward:.3f}"
                         + (f" ({comps})" if comps else ""))
            if not nt.result.gate and nt.result.diagnostic:
                lines.append(f"   diagnostic: {nt.result.diagnostic.strip()}")
        # A failed node propagates nothing; its last output is still what the user wants to see.
        art, label = (nt.artifact, "artifact") if nt.artifact is not None else (nt.text, "rejected output")
        if art is not None:
            full = len(art)
            if max_artifact_chars is not None and full > max_artifact_chars:
                art = art[:max_artifact_chars] + f"\n[... {full - max_artifact_chars} more chars]"
            lines.append(f"   {label}:")
            lines.extend("   | " + ln for ln in art.splitlines() or [""])
    return "\n".join(lines)
