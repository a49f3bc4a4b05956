"""BFCL evaluation with our sampler: a fixed item subset, answers, BFCL's verdicts, Table 2.

Two ways of answering an item (``protocol``):

* ``"direct"``: BFCL's prompting-mode prompt (its system prompt with the functions as indent-4
  JSON, then the question), one greedy generation, the text is the answer (how BFCL scores
  an OSS model; the base model's row).
* ``"roles"``: MoRAgent's role loop (:mod:`morse_jax.run.role_loop`): reasoner -> executor -> ...
  -> summarizer, the executor turns' calls are the answer.

Answers are appended to a JSON Lines file as they are scored (one record per item: id, category,
the answer text, the verdict, and the role turns when there are any), so an interrupted
evaluation resumes where it stopped and a finished one is read back instead of re-run. The fixed
item subsets are :mod:`morse_jax.tasks.bfcl.subset`'s.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import time
from pathlib import Path
from typing import Callable, Sequence

from morse_jax.models.chat import encode_chat
from morse_jax.run.closed_thought import choose_first_thoughts
from morse_jax.run.guided_calls import write_calls
from morse_jax.run.role_loop import RoleLoopConfig, ScoreFn, executor_text, run_role_loop
from morse_jax.sampling.requests import Completion, Request
from morse_jax.tasks import bfcl
from morse_jax.tasks.bfcl import BfclItem, ScoreResult
from morse_jax.tasks.bfcl.trajectories import DEFAULT_SYSTEM  # the system text of the training trajectories
from morse_jax.tasks.trajectories import ROLE_NAMES, Trajectory, Turn

GenerateFn = Callable[[Sequence[Request]], Sequence[Completion]]


@dataclasses.dataclass
class Answer:
    """What a protocol produced for one item: ``text`` is what BFCL scores; ``turns`` the role
    turns [(role, text), ...] of the role loop (empty for the direct protocol)."""

    text: str
    turns: list = dataclasses.field(default_factory=list)
    tokens: int = 0  # generated tokens, all turns
    scores: tuple[float, ...] = ()  # the role loop's chosen first turn's scores (first_thought="closed")


def direct_requests(items: Sequence[BfclItem], tokenizer, *, max_new_tokens: int,
                    stop_token_ids: Sequence[int]) -> list[Request]:
    """Greedy requests with BFCL's prompting-mode messages, one per item."""
    return [Request(prompt_ids=encode_chat(tokenizer, bfcl.prompt_messages(it)), max_new_tokens=max_new_tokens,
                    temperature=0.0, stop_token_ids=tuple(stop_token_ids)) for it in items]


def answer_direct(generate: GenerateFn, tokenizer, *, max_new_tokens: int,
                  stop_token_ids: Sequence[int]) -> Callable[[Sequence[BfclItem]], list[Answer]]:
    """The direct protocol as a function items -> answers (one batched generation)."""

    def answer(items: Sequence[BfclItem]) -> list[Answer]:
        comps = generate(direct_requests(items, tokenizer, max_new_tokens=max_new_tokens,
                                         stop_token_ids=stop_token_ids))
        return [Answer(text=c.text, tokens=len(c.token_ids)) for c in comps]

    return answer


def read_answers(path: Path) -> dict[str, dict]:
    """id -> record of an answers file (empty when there is none)."""
    if not path.exists():
        return {}
    out = {}
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.strip():
                rec = json.loads(line)
                out[rec["id"]] = rec
    return out


def result_of(rec: dict) -> ScoreResult:
    return ScoreResult(rec["id"], rec["category"], bool(rec["correct"]), rec.get("error", ""),
                       rec.get("error_type", ""), bool(rec.get("has_call", False)))


def evaluate_items(items: Sequence[BfclItem], answer: Callable[[Sequence[BfclItem]], list[Answer]], *,
                   answers_path: Path | None = None, batch: int = 16, progress=None) -> list[ScoreResult]:
    """Answer and score ``items`` in batches of ``batch``; with ``answers_path``, items already
    answered there are read back, and each new batch is appended as soon as it is scored.
    Returns the verdicts in item order. ``progress(n)`` is called after each batch."""
    done = read_answers(answers_path) if answers_path is not None else {}
    todo = [it for it in items if it.id not in done]
    if answers_path is not None:
        answers_path.parent.mkdir(parents=True, exist_ok=True)
    for start in range(0, len(todo), batch):
        chunk = todo[start:start + batch]
        t0 = time.time()
        answers = answer(chunk)
        per_item = (time.time() - t0) / len(chunk)
        recs = []
        for it, a in zip(chunk, answers, strict=True):
            r = bfcl.score(it, a.text)
            rec = {"id": it.id, "category": it.category, "text": a.text, "correct": r.correct, "error": r.error,
                   "error_type": r.error_type, "has_call": r.has_call, "tokens": a.tokens, "seconds": round(per_item, 2)}
            if a.turns:
                rec["turns"] = [list(t) for t in a.turns]
            if a.scores:
                rec["head_logprobs"] = [round(v, 4) for v in a.scores]
            recs.append(rec)
            done[it.id] = rec
        if answers_path is not None:
            with open(answers_path, "a", encoding="utf-8") as f:
                f.writelines(json.dumps(rec) + "\n" for rec in recs)
        if progress is not None:
            progress(len(chunk))
    return [result_of(done[it.id]) for it in items]


def item_trajectory(item: BfclItem, system: str) -> Trajectory:
    """The start of a role-loop episode for ``item``: the multi-role system text (``system``, the
    one the training trajectories carry) followed by the item's own system message if it has one,
    its functions (shown as in training: indent-4 JSON), and its messages as turns (user ->
    user; an earlier assistant answer, found in some live_irrelevance items -> summarizer, the role
    that answers the user)."""
    sys_parts, turns = [system] if system else [], []
    for m in item.question:
        if m["role"] == "system":
            sys_parts.append(m["content"])
        elif m["role"] == "assistant":
            turns.append(Turn("summarizer", m["content"] or "(empty)"))
        else:
            turns.append(Turn("user", m["content"]))
    return Trajectory(turns=tuple(turns), functions=tuple(item.functions), system="\n\n".join(sys_parts), id=item.id)


def answer_roles(generate: GenerateFn, tokenizer, config: RoleLoopConfig, *, stop_token_ids: Sequence[int],
                 system: str = DEFAULT_SYSTEM,
                 score: ScoreFn | None = None) -> Callable[[Sequence[BfclItem]], list[Answer]]:
    """The role-loop protocol as a function items -> answers: the answer is the first executor
    turn's text (BFCL scores its calls; no executor turn = no call). BFCL v4 ships no executable
    functions, so nothing is executed: the episode ends after the executor's turn (there is no
    observation to feed back). score: the role loop's decision scoring (``RoleLoopConfig.role_choice``;
    with ``first_thought="closed"`` also the choice of the first thought, ``run.closed_thought``;
    with ``executor="guided"`` also the executor's parameter choices, ``run.guided_calls``)."""
    config = dataclasses.replace(config, stop_after_executor=True)
    choose_first = None
    if config.first_thought == "closed":
        if score is None:
            raise ValueError("answer_roles: first_thought='closed' needs a score function")
        choose_first = functools.partial(choose_first_thoughts, score=score, tokenizer=tokenizer,
                                         no_call_bias=config.no_call_bias)
    write_executor = None
    if config.executor == "guided":
        if score is None:
            raise ValueError("answer_roles: executor='guided' needs a score function")
        write_executor = functools.partial(write_calls, generate=generate, score=score, tokenizer=tokenizer,
                                           stop_token_ids=stop_token_ids, max_new_tokens=config.budget("executor"))

    def answer(items: Sequence[BfclItem]) -> list[Answer]:
        eps = run_role_loop([item_trajectory(it, system) for it in items], generate, tokenizer, config,
                            stop_token_ids=stop_token_ids, score=score, choose_first=choose_first,
                            write_executor=write_executor)
        return [Answer(text=executor_text(e), turns=[(t.role, t.content) for t in e.traj.turns if t.role in ROLE_NAMES],
                       tokens=e.tokens, scores=e.first_scores) for e in eps]

    return answer
