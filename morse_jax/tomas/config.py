"""Orchestrator configuration: what it runs (:class:`OrchestratorConfig`) and how each kind of call
decodes (:class:`SamplingSettings`), with the allowed values of its string fields.

``ADAPTER_MODES`` are the orchestrator's adapter layouts (``OrchestratorConfig.variant``): "mole"
(routed mixture; paper variants A and D), "flat_mole" (C), "single_lora" (B), "none" (no adapters).
The paper's variants A..D themselves are ``morse_jax.config.defaults.VARIANTS``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import numpy as np

MODES = ("train", "eval")
ADAPTER_MODES = ("mole", "flat_mole", "single_lora", "none")
MERGE_MODES = ("union", "random_subset")
MERGE_CANDIDATES = ("routes_x_candidates", "candidates")
FIXED_PLAN_DEPENDENCIES = ("keep", "planner")


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
    verify_workers: verifications (each one sandboxed run) in flight at once; 0 = one per CPU
      (``os.cpu_count()``: sandbox timeouts are wall-clock), 1 = one at a time.
    verify_overlap: verify each micro-batch the sampler finishes while it generates the next
      (when ``generate_fn`` reports them; ``tomas.verification``); False: after the wave's whole
      generation, as before. Rewards and traces are the same either way (for verifiers whose
      result does not depend on the machine's load: a wall-clock timeout can).
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
    verify_workers: int = 0
    verify_overlap: bool = True
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
        if self.variant not in ADAPTER_MODES:
            raise ValueError(f"{p}.variant must be one of {ADAPTER_MODES}, got {self.variant!r}")
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
                     "min_nodes"):
            _check_int(f"{p}.{name}", getattr(self, name), 1)
        _check_int(f"{p}.max_replans", self.max_replans, 0)
        _check_int(f"{p}.verify_workers", self.verify_workers, 0)
        _check_int(f"{p}.seed", self.seed, 0)
        if isinstance(self.max_nodes, bool) or not isinstance(self.max_nodes, int) or self.max_nodes < self.min_nodes:
            raise ValueError(f"{p}.max_nodes must be an int >= min_nodes ({self.min_nodes}), got {self.max_nodes!r}")
        for name in ("single_agent", "raise_verifier_errors", "answer_prefix", "heal_answer_prefix",
                     "verify_overlap"):
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
