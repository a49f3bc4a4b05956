"""What every task family provides to the orchestrator: prompts, artifact extraction, verification.

The orchestrator (``morse_jax.tomas.orchestrator``) is task-agnostic; a task family
(SciCode, SRDD, a user's own) plugs in by implementing :class:`TaskFamily`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Protocol, Sequence

from morse_jax.tasks.plan import Plan, PlanNode

Message = Mapping[str, str]  # {"role": "system" | "user" | "assistant", "content": str}


@dataclasses.dataclass(frozen=True)
class Task:
    """One task instance T.

    Attributes:
      task_id: stable identifier (problem id, SRDD name).
      description: the task text given to the planner and to every agent call.
      family: name of the task family that verifies it ("scicode", "srdd", ...).
      payload: family-specific data (SciCode steps and tests, SRDD category, ...).
    """

    task_id: str
    description: str
    family: str
    payload: Any = None


@dataclasses.dataclass(frozen=True)
class VerifyResult:
    """Verifier output for one artifact.

    Attributes:
      gate: g_i, the hard gate (parses / defines the function / runs). ``reward`` is 0 when False.
      reward: u_i >= 0. SciCode: fraction of unit tests passed in [0, 1]; SRDD: up to 2.0.
      diagnostic: short human-readable reason, fed back to the model on regeneration.
      components: named reward components (e.g. {"exec": 1.0, "comp": 0.5, "cons": 0.3}).
    """

    gate: bool
    reward: float
    diagnostic: str = ""
    components: Mapping[str, float] = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        if not self.gate and self.reward != 0.0:
            raise ValueError(f"VerifyResult.reward must be 0 when the gate fails, got {self.reward}")
        if self.reward < 0.0 or self.reward != self.reward:
            raise ValueError(f"VerifyResult.reward must be a finite non-negative number, got {self.reward}")


class TaskFamily(Protocol):
    """The interface a task family implements (SciCode, SRDD, or your own)."""

    name: str

    def fixed_plan(self, task: Task) -> Plan | None:
        """A plan dictated by the task (e.g. SciCode sub-steps), or None to ask the planner."""

    def execute_messages(
        self, task: Task, node: PlanNode, context: str, diagnostic: str | None
    ) -> list[Message]:
        """Chat messages for the execute-role call at ``node`` given upstream context C_i."""

    def merge_messages(self, task: Task, node: PlanNode, parent_artifacts: Sequence[str]) -> list[Message]:
        """Chat messages for the merge-role call aggregating several parents' artifacts."""

    def extract_artifact(self, task: Task, node: PlanNode, completion: str) -> str:
        """The artifact y_i from the raw model completion (e.g. the code in fenced blocks)."""

    def verify(self, task: Task, node: PlanNode, artifact: str) -> VerifyResult:
        """Rule-based verifier for one artifact (runs untrusted code only in the sandbox)."""
