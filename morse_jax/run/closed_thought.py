"""The reasoner's first thought read as a closed-set choice over the "names" template.

A reasoner trained on "names" thoughts (``tasks.bfcl.trajectories.names_thought``: "Plan: call f,
with the arguments the request states. Next: executor.", "Plan: 2 calls: f, g, ..." or "Plan: no
call. None of the available functions (...) ...") says two things in its first turn: how many calls
to make, and of which offered functions. Every other word is fixed by the template. Free generation
lets a small model leave the template ("Plan: call the executor, ...", a name repeated until the
budget runs out), and such a thought then hands over to the summarizer: no call. Here the model
writes the template with its own preferences only: a grammar-constrained greedy decode in which each
free choice is scored as a closed set by the model (``ScoreFn``, the reasoner's group):

1. the head, among ``names_head(k)`` for k = 0 .. ``max_calls`` ("Plan: no call." / "Plan: call" /
   "Plan: k calls:"): the number of calls;
2. for each of the k calls in turn, the function name among the offered ones, each candidate closed
   by the "," that follows every name in the template (so a name is never scored as a prefix of a
   longer one); a single offered function needs no scoring.

The thought is then ``names_thought(chosen names, offered)`` and its hand-over follows from it
(executor when it names a call, summarizer otherwise). Each candidate is the episode rendered as
SFT renders it, with the reasoner turn holding the text so far (``sft.data.render``: same tokens and
role ids as training), cut before that turn's end-of-turn token, and scored from the first token
where the step's candidates differ (the shared prefix has the same probability under each). Ties
go to the first candidate (fewer calls; the offered order).

Cost: one ``score`` call per step for every episode still choosing: 1 + ``max_calls`` rounds at
most, ``max_calls + 1`` continuations per episode in the first and one per offered function in the
others.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

from morse_jax.run.role_loop import ChosenTurn, Continuation, ScoreFn
from morse_jax.sft.data import render
from morse_jax.tasks.bfcl.trajectories import names_head, names_thought
from morse_jax.tasks.trajectories import Trajectory, Turn

MAX_CALLS = 4  # the generator writes 1-3 calls; one more lets a model that generalises say so


def partial_turn_ids(traj: Trajectory, text: str, tokenizer, role: str = "reasoner") -> tuple[list[int], list[int]]:
    """(token ids, role ids) of ``traj`` followed by a ``role`` turn holding ``text``, rendered as
    SFT renders it and cut before that turn's end-of-turn token (the text's last token included)."""
    r = render(dataclasses.replace(traj, turns=traj.turns + (Turn(role, text),)), tokenizer)
    end = int(np.flatnonzero(r.loss_mask)[-1])  # the closing turn's end-of-turn token (render marks it)
    return r.tokens[:end].tolist(), r.role_ids[:end].tolist()


def _common_prefix(seqs: Sequence[Sequence[int]]) -> int:
    n = min(len(s) for s in seqs)
    for i in range(n):
        if any(s[i] != seqs[0][i] for s in seqs[1:]):
            return i
    return n


def candidate_continuations(traj: Trajectory, texts: Sequence[str], tokenizer,
                            role: str = "reasoner") -> list[Continuation]:
    """One continuation per candidate text of a ``role`` turn following ``traj`` (each rendered by
    :func:`partial_turn_ids`), all scored from the first token where they differ. Raises
    ValueError when a candidate's tokens end where the shared prefix does (nothing to compare)."""
    enc = [partial_turn_ids(traj, t, tokenizer, role) for t in texts]
    start = _common_prefix([ids for ids, _ in enc])
    if any(len(ids) <= start for ids, _ in enc):
        raise ValueError(f"closed thought: candidates {list(texts)!r} do not differ after their shared prefix")
    return [Continuation(tuple(ids), tuple(roles), start) for ids, roles in enc]


@dataclasses.dataclass
class _Choice:
    traj: Trajectory
    offered: list[str]
    n_calls: int | None = None
    names: list[str] = dataclasses.field(default_factory=list)
    head_scores: tuple[float, ...] = ()

    def done(self) -> bool:
        return self.n_calls is not None and len(self.names) == self.n_calls

    def candidates(self) -> list[str]:
        """The texts of this step's candidates."""
        if self.n_calls is None:
            return [names_head(k) for k in range(MAX_CALLS + 1)]
        head = names_head(self.n_calls) + " " + "".join(n + ", " for n in self.names)
        return [head + name + "," for name in self.offered]


def choose_first_thoughts(trajs: Sequence[Trajectory], score: ScoreFn, tokenizer, *,
                          no_call_bias: float = 0.0) -> list[ChosenTurn]:
    """The first reasoner turn of each episode ``trajs[i]`` (not yet added): the "names" thought
    chosen step by step as above. ``no_call_bias`` is added to the "no call" head's log-probability
    before the count is chosen (0: the model's own preference; > 0 leans to no call; a calibration
    to select on a dev split). Each turn's ``scores`` are its heads' log-probabilities relative to
    the shared prefix, k = 0 .. MAX_CALLS calls, bias not included (empty when there was no choice)."""
    states = [_Choice(t, [f["name"] for f in t.functions]) for t in trajs]
    for s in states:
        if not s.offered:  # nothing to call: the only thought the template allows
            s.n_calls = 0
    while True:
        todo = [s for s in states if not s.done()]
        if not todo:
            break
        single = [s for s in todo if s.n_calls is not None and len(s.offered) == 1]
        for s in single:  # one offered function: the name is not a choice
            s.names.append(s.offered[0])
        todo = [s for s in todo if not s.done() and s not in single]
        if not todo:
            continue
        cands = [s.candidates() for s in todo]
        conts = [c for s, texts in zip(todo, cands) for c in candidate_continuations(s.traj, texts, tokenizer)]
        flat = np.asarray(score(conts), np.float64)
        lo = 0
        for s, texts in zip(todo, cands):
            step = flat[lo:lo + len(texts)]
            lo += len(texts)
            if s.n_calls is None:
                s.head_scores = tuple(float(v) for v in step)
                s.n_calls = int(np.argmax(step + np.eye(len(step))[0] * no_call_bias))
            else:
                s.names.append(s.offered[int(np.argmax(step))])
    return [ChosenTurn("executor" if s.names else "summarizer", names_thought(s.names, s.offered), s.head_scores)
            for s in states]
