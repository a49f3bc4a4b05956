"""Orchestrator data types: its config, route draws, rollout groups, per-task traces, counters.

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
from typing import Any, Mapping, Sequence

import numpy as np

from morse_jax.tasks.base import Task, VerifyResult
from morse_jax.tasks.plan import Plan
from morse_jax.tomas.planner.loop import render_plan

NODE_STATUSES = ("passed", "failed", "blocked")
ROLES = ("execute", "merge")
MODES = ("train", "eval")
VARIANTS = ("mole", "flat_mole", "single_lora", "none")
MERGE_MODES = ("union", "random_subset")
MERGE_CANDIDATES = ("routes_x_candidates", "candidates")
FIXED_PLAN_DEPENDENCIES = ("keep", "planner")

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


def _check_int(name: str, value: Any, lo: int) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < lo:
        raise ValueError(f"{name} must be an int >= {lo}, got {value!r}")


@dataclasses.dataclass(frozen=True)
class SamplingSettings:
    """Decoding settings of one kind of call. temperature 0 = greedy; top_k 0 = no limit."""

    temperature: float = 1.0
    top_p: float = 0.95
    max_new_tokens: int = 1024
    top_k: int = 0

    def check(self, name: str) -> None:
        if not isinstance(self.temperature, (int, float)) or not self.temperature >= 0:
            raise ValueError(f"{name}.temperature must be a number >= 0, got {self.temperature!r}")
        if not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            raise ValueError(f"{name}.top_p must be in (0, 1], got {self.top_p!r}")
        _check_int(f"{name}.max_new_tokens", self.max_new_tokens, 1)
        _check_int(f"{name}.top_k", self.top_k, 0)


@dataclasses.dataclass(frozen=True)
class OrchestratorConfig:
    """What the orchestrator runs (validated on construction; errors name the field).

    mode: "train" (B routes x M candidates per execute node, rollout groups) or "eval" (greedy
      route, one candidate).
    variant: "mole" (D; A when the bank is untrained), "flat_mole" (C: every candidate draws its
      own route, one flat credit group), "single_lora" (B / B++: one always-active expert, no
      router), "none" (no adapters; eval only).
    routes_per_node (B), candidates_per_route (M), top_k (router K).
    max_attempts: calls per node and role (1 + regenerations) before the node fails, in train mode.
    eval_max_attempts: the same in eval mode (1 = no revision at evaluation, App. I on SciCode).
    merge_mode: merge experts = "union" of the parents' routed experts, or "random_subset".
    merge_candidates: merge calls in train mode: "routes_x_candidates" (Alg. 1: B rows x M
      candidates, like an execute call; a merge node has no router decision, so a "route" is one
      draw of the inherited merge set -- the same union B times, or B independent random subsets
      with merge_mode "random_subset" -- and each row is one A_within group, no A_cross) or
      "candidates" (one row of M; cheaper).
    fixed_plan_dependencies: for a family whose ``fixed_plan`` lists the task's steps (SciCode):
      "keep" its dependencies (SciCode: the chain of steps) or let the "planner" infer them from
      the step descriptions (the steps stay the nodes; validated; the fixed plan's dependencies
      are the fallback after ``max_replans`` rejected answers).
    single_agent: no DAG: one node holding the whole task, same verify-and-regenerate budget.
    train_sampling / eval_sampling / planner_sampling: decoding settings per kind of call.
    min_nodes / max_nodes / max_replans: planner bounds and re-plan budget.
    planner_prefix: text the planner's answer is made to start with (an assistant-turn prefix,
      e.g. '{"nodes": ['): small models then write the JSON instead of code. "" = none.
    answer_prefix: let families start their answers (``TaskFamily.answer_prefix(task, node, role)``,
      optional; SciCode: the step's function header in a python fence).
    heal_answer_prefix: token healing of the answer prefix (``Request.heal_tokens``): the
      prompt's last token is dropped and the first generated token must re-produce its text, so
      the model is never forced to continue at a token boundary it would not produce (a bare
      newline where it would write newline + indentation as one token).
    verify_workers: threads verifying a wave's artifacts concurrently.
    raise_verifier_errors: re-raise an exception from extract/verify instead of scoring the
      candidate as a gate failure (the default logs it and counts it in ``verifier_errors``).
    seed: seeds the ``random_subset`` merge draws.
    """

    mode: str = "train"
    variant: str = "mole"
    routes_per_node: int = 4
    candidates_per_route: int = 4
    top_k: int = 2
    max_attempts: int = 3
    eval_max_attempts: int = 3
    merge_mode: str = "union"
    merge_candidates: str = "candidates"
    fixed_plan_dependencies: str = "keep"
    single_agent: bool = False
    train_sampling: SamplingSettings = SamplingSettings(1.0, 0.95, 1024)
    eval_sampling: SamplingSettings = SamplingSettings(0.0, 1.0, 1024)
    planner_sampling: SamplingSettings = SamplingSettings(0.0, 1.0, 1024)
    stop_token_ids: tuple[int, ...] = ()
    stop_strings: tuple[str, ...] = ()
    min_nodes: int = 2
    max_nodes: int = 8
    max_replans: int = 2
    planner_prefix: str = ""
    answer_prefix: bool = True
    heal_answer_prefix: bool = False
    verify_workers: int = 4
    raise_verifier_errors: bool = False
    seed: int = 0

    @property
    def attempts(self) -> int:
        """Calls per node and role in this mode (``max_attempts`` or ``eval_max_attempts``)."""
        return self.max_attempts if self.mode == "train" else self.eval_max_attempts

    def __post_init__(self):
        p = "orchestrator"
        if self.mode not in MODES:
            raise ValueError(f"{p}.mode must be one of {MODES}, got {self.mode!r}")
        if self.variant not in VARIANTS:
            raise ValueError(f"{p}.variant must be one of {VARIANTS}, got {self.variant!r}")
        if self.mode == "train" and self.variant == "none":
            raise ValueError(f"{p}.variant 'none' has no adapters to train; use mode='eval'")
        if self.merge_mode not in MERGE_MODES:
            raise ValueError(f"{p}.merge_mode must be one of {MERGE_MODES}, got {self.merge_mode!r}")
        if self.merge_candidates not in MERGE_CANDIDATES:
            raise ValueError(f"{p}.merge_candidates must be one of {MERGE_CANDIDATES}, got {self.merge_candidates!r}")
        if self.fixed_plan_dependencies not in FIXED_PLAN_DEPENDENCIES:
            raise ValueError(f"{p}.fixed_plan_dependencies must be one of {FIXED_PLAN_DEPENDENCIES}, "
                             f"got {self.fixed_plan_dependencies!r}")
        for name in ("routes_per_node", "candidates_per_route", "top_k", "max_attempts", "eval_max_attempts",
                     "min_nodes", "verify_workers"):
            _check_int(f"{p}.{name}", getattr(self, name), 1)
        _check_int(f"{p}.max_replans", self.max_replans, 0)
        _check_int(f"{p}.seed", self.seed, 0)
        if isinstance(self.max_nodes, bool) or not isinstance(self.max_nodes, int) or self.max_nodes < self.min_nodes:
            raise ValueError(f"{p}.max_nodes must be an int >= min_nodes ({self.min_nodes}), got {self.max_nodes!r}")
        for name in ("single_agent", "raise_verifier_errors", "answer_prefix", "heal_answer_prefix"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{p}.{name} must be a bool, got {getattr(self, name)!r}")
        for name in ("train_sampling", "eval_sampling", "planner_sampling"):
            s = getattr(self, name)
            if not isinstance(s, SamplingSettings):
                raise ValueError(f"{p}.{name} must be a SamplingSettings, got {type(s).__name__}")
            s.check(f"{p}.{name}")
        if isinstance(self.stop_token_ids, (str, bytes)) or not all(
                isinstance(t, (int, np.integer)) and not isinstance(t, bool) and t >= 0 for t in self.stop_token_ids):
            raise ValueError(f"{p}.stop_token_ids must be a sequence of non-negative ints, got {self.stop_token_ids!r}")
        if isinstance(self.stop_strings, str) or not all(isinstance(s, str) and s for s in self.stop_strings):
            raise ValueError(f"{p}.stop_strings must be a sequence of non-empty strings, got {self.stop_strings!r}")
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        object.__setattr__(self, "stop_strings", tuple(self.stop_strings))

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any]) -> "OrchestratorConfig":
        """Build from a (nested) mapping, e.g. an ml_collections ConfigDict; unknown keys are errors."""
        values = dict(values)
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - fields)
        if unknown:
            raise ValueError(f"orchestrator: unknown field(s) {unknown}; known: {sorted(fields)}")
        for name in ("train_sampling", "eval_sampling", "planner_sampling"):
            v = values.get(name)
            if v is not None and not isinstance(v, SamplingSettings):
                v = dict(v)
                bad = sorted(set(v) - {f.name for f in dataclasses.fields(SamplingSettings)})
                if bad:
                    raise ValueError(f"orchestrator.{name}: unknown field(s) {bad}")
                values[name] = SamplingSettings(**v)
        for name in ("stop_token_ids", "stop_strings"):
            if name in values and values[name] is not None and not isinstance(values[name], (str, bytes)):
                values[name] = tuple(values[name])
        return cls(**values)


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
