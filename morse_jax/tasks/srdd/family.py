"""SRDD (ChatDev software requirement descriptions): data, codebases, reward, ECI metrics.

A task is one requirement description; the planner decomposes it; each execute node writes
the *whole* multi-file Python codebase so far (ChatDev style: a file name line, then a fenced
block), so the last node's artifact is the finished program. Artifacts travel between nodes as
:func:`serialise_codebase` text and are parsed back with :func:`materialise_codebase`.

Training reward (paper Eq. 11, Appendix I), behind a hard gate::

    gate:   main.py exists, compiles, and `python main.py` with stdin closed does not crash
            within a few seconds (a time-out or an EOFError on input counts as running)
    reward: 0.5*r_exec + 0.5*r_comp + 1.0*(0.7*cons(task, code) + 0.3*cons(subtask, code))

r_exec and r_comp are binary per codebase as in ChatDev's Executability and Completeness
(the paper follows Qian et al.); cons is a lexical bag-of-words cosine here and an embedding
cosine in evaluation (ECI). Given the gate, r_exec is 1 for every rewarded artifact.
Generated code runs only through :mod:`morse_jax.tasks.sandbox.runner`.

This module holds the task family (:class:`SRDDFamily`, its prompts) and re-exports the public
names of the modules it is built from, one concept each (split to keep files under ~500 lines):

* :mod:`~morse_jax.tasks.srdd.data` -- the CSV splits (``load_srdd``, ``SRDDInfo``, ``SPLITS``).
* :mod:`~morse_jax.tasks.srdd.codebase` -- completion <-> ``{path: source}``
  (``materialise_codebase``, ``parse_codebase``, ``serialise_codebase``).
* :mod:`~morse_jax.tasks.srdd.analysis` -- static analysis (``codebase_text``,
  ``lexical_cosine``, ``find_placeholders``, ``completeness``).
* :mod:`~morse_jax.tasks.srdd.scoring` -- smoke run, reward, ECI (``smoke_run``,
  ``score_codebase``, ``srdd_reward``, ``evaluate_codebases``, ``eci_summary``).

Re-exported names are the same objects, but code reads them from the module that defines them:
to monkeypatch one (e.g. ``smoke_run`` for ``srdd_reward``), patch that module. None of these
modules imports torch or the embedder at import time (the lexical reward path stays light).
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

from morse_jax.tasks.base import Message, Task, VerifyResult
from morse_jax.tasks.srdd.analysis import (bag_of_words, codebase_text, completeness, find_placeholders,
                                           lexical_cosine, strip_comments_docstrings)
from morse_jax.tasks.srdd.codebase import materialise_codebase, parse_codebase, serialise_codebase
from morse_jax.tasks.srdd.data import COLUMNS, DATA_DIR_ENV, SPLITS, SRDDInfo, load_srdd, resolve_srdd_path
from morse_jax.tasks.srdd.scoring import (RunOutcome, SRDDRewardConfig, SRDDScores, classify_run, eci_summary,
                                          embedding_consistency, evaluate_codebases, score_codebase,
                                          smoke_run, smoke_run_many, srdd_reward)
from morse_jax.tasks.plan import Plan, PlanNode

__all__ = [  # defined here, then re-exported from the modules this one is built from
    "SYSTEM_PROMPT", "FORMAT_RULES", "SOFTWARE_PROJECT_HINT", "SRDDFamily", "bag_of_words", "codebase_text",
    "completeness", "find_placeholders", "lexical_cosine", "strip_comments_docstrings",
    "materialise_codebase", "parse_codebase", "serialise_codebase", "COLUMNS", "DATA_DIR_ENV", "SPLITS",
    "SRDDInfo", "load_srdd", "resolve_srdd_path", "RunOutcome", "SRDDRewardConfig", "SRDDScores",
    "classify_run", "eci_summary", "embedding_consistency", "evaluate_codebases", "score_codebase",
    "smoke_run", "smoke_run_many", "srdd_reward",
]


# ============================================================================ task family

SYSTEM_PROMPT = (
    "You are a senior Python engineer in a software team. You write complete, working code: "
    "no placeholders, no `pass` stubs, no TODOs, no NotImplementedError."
)

FORMAT_RULES = """Answer with the COMPLETE codebase: every file, each in full (files you did not change too).
Write each file as its file name on its own line followed by a fenced code block, like this:

main.py
```python
...
```

Rules:
- main.py is the entry point; the program starts with `python main.py`.
- Use only the Python standard library. The program runs in a terminal with no display and no
  network, so build a text (console) interface even if the task mentions a graphical one.
- Read user input with input(); the program must not crash when input ends (EOF)."""

# Domain guidance for the planner (``SRDDFamily.planner_hint``, config.srdd.planner_hint),
# adapted from the rules of the authors' planner prompt. It lives with the family, not in the
# generic planner, which only passes a family's hint on as extra rules.
SOFTWARE_PROJECT_HINT = (
    "Subtasks are developer work items (requirements analysis, architecture, implementation of "
    "modules, integration, testing). The program must use the Python standard library only; "
    "if the task implies graphics or a GUI, plan a terminal/ASCII interface instead."
)


def _check_task(task: Task, node: PlanNode) -> None:
    if not isinstance(task.description, str) or not task.description.strip():
        raise ValueError(f"task.description is empty (task {task.task_id!r})")
    if not isinstance(node, PlanNode):
        raise TypeError(f"node must be a PlanNode, got {type(node).__name__}")


def _subtask_text(node: PlanNode) -> str:
    return f"{node.title}. {node.description}" if node.title else node.description


@dataclasses.dataclass(frozen=True)
class SRDDFamily:
    """:class:`morse_jax.tasks.base.TaskFamily` for SRDD: planner-made DAGs, multi-file codebases."""

    reward: SRDDRewardConfig = SRDDRewardConfig()
    system_prompt: str = SYSTEM_PROMPT
    format_rules: str = FORMAT_RULES
    name: str = "srdd"
    # extra planner rules (the orchestrator's ``planner_hint`` hook), e.g. the authors' software-
    # project rules :data:`SOFTWARE_PROJECT_HINT` (config.srdd.planner_hint)
    planner_hint: str | None = None

    def fixed_plan(self, task: Task) -> Plan | None:
        return None  # SRDD tasks are decomposed by the planner

    def execute_messages(self, task: Task, node: PlanNode, context: str,
                         diagnostic: str | None) -> list[Message]:
        _check_task(task, node)
        parts = [f"Software requirement:\n{task.description.strip()}",
                 f"Your subtask: {_subtask_text(node).strip()}"]
        if context and context.strip():
            parts.append("Current codebase (from the subtasks done so far):\n\n" + context.strip())
        else:
            parts.append("There is no code yet; start the codebase.")
        if diagnostic:
            parts.append(f"Your previous answer failed verification:\n{diagnostic.strip()}\nFix this.")
        parts.append(self.format_rules)
        return [{"role": "system", "content": self.system_prompt},
                {"role": "user", "content": "\n\n".join(parts)}]

    def merge_messages(self, task: Task, node: PlanNode, parent_artifacts: Sequence[str]) -> list[Message]:
        _check_task(task, node)
        if len(parent_artifacts) < 2:
            raise ValueError(f"parent_artifacts: a merge needs at least 2, got {len(parent_artifacts)}")
        blocks = [f"### Codebase {i + 1}\n\n{a.strip() or '(empty)'}" for i, a in enumerate(parent_artifacts)]
        user = "\n\n".join([
            f"Software requirement:\n{task.description.strip()}",
            f"Teammates wrote the codebases below for different earlier subtasks. Merge them into ONE "
            f"consistent codebase that keeps all their functionality, ready for the next subtask: "
            f"{_subtask_text(node).strip()}",
            *blocks,
            self.format_rules,
        ])
        return [{"role": "system", "content": self.system_prompt}, {"role": "user", "content": user}]

    def extract_artifact(self, task: Task, node: PlanNode, completion: str) -> str:
        """The codebase in canonical text form ('' when the completion holds no code)."""
        files = materialise_codebase(completion)
        return serialise_codebase(files) if files else ""

    def verify(self, task: Task, node: PlanNode, artifact: str) -> VerifyResult:
        _check_task(task, node)
        return srdd_reward(task.description, _subtask_text(node), materialise_codebase(artifact), self.reward)
