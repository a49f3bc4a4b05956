"""MoRAgent's role loop at inference: reasoner -> executor -> observation -> reasoner ... -> summarizer.

Every unfinished episode takes one role turn per round, all episodes in one batched generation
whatever their roles: each request carries its prompt's per-token role ids and the role of the
turn it generates (``sampling.Request.role`` / ``prompt_roles``), so a role adapter
(``sampling.loop.RoleAdapter``) runs each token under its role's group inside the jitted prefill
and decode steps. The prompt is the episode so far rendered exactly as SFT renders a training
trajectory (``morse_jax.sft.data.render``: role turns are assistant messages carrying their role
ids, system / user / observation tokens carry none), followed by the chat template's
assistant header under the new turn's role (the training rendering gives a role turn's header
its role too).

The course of an episode:

* the first role turn is the reasoner's;
* after a reasoner turn, the next role is its decision between the executor and the summarizer.
  With ``role_choice="likelihood"`` (the default) the decision is read as a closed-set choice:
  the reasoner's thought (its text before any "Next:" it wrote) is closed with each allowed
  decision in the training data's words ("Next: executor." / "Next: summarizer."), the model
  scores both turns (``score``: the log-probability of the tokens where they differ, end-of-turn
  token included, under the reasoner's group) and the likelier one is the turn kept. A free-text
  reasoner that never writes the marker (a small model after short SFT answers in prose) thus
  still makes the decision the paper gives it, with the model's own preference, never a forced
  one. ``role_choice="text"`` parses the generated text instead (:func:`next_role`);
* after an executor turn, ``observe`` (if given) turns its text into an observation turn and the
  reasoner speaks again; without ``observe`` (or with ``stop_after_executor``) the episode ends
  there;
* a summarizer turn ends the episode; so does reaching ``max_turns`` role turns.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Callable, Sequence

import numpy as np

from morse_jax.sampling.requests import Completion, Request
from morse_jax.sft.data import chat_messages, render
from morse_jax.tasks.trajectories import ROLE_NAMES, Trajectory, Turn

_NEXT = re.compile(r"next\s*(?:role)?\s*:\s*(reasoner|executor|summarizer)", re.IGNORECASE)
_MARKER = re.compile(r"next\s*(?:role)?\s*:", re.IGNORECASE)
DECISIONS = ("executor", "summarizer")  # the roles a reasoner can hand over to
FIRST_THOUGHTS = ("generate", "closed")
EXECUTORS = ("generate", "guided")
_CALL = re.compile(r"\[\s*[A-Za-z_][\w.]*\s*\(")


@dataclasses.dataclass(frozen=True)
class RoleLoopConfig:
    """Bounds and decoding of the loop.

    max_turns: role turns per episode (reasoner, executor and summarizer turns all count).
    max_new_tokens: per role name, the new-token budget of its turns.
    stop_after_executor: end an episode after its first executor turn (single-shot tasks such as
      BFCL, scored on the executor's calls with nothing to execute).
    temperature: 0 = greedy.
    role_choice: "likelihood" (the reasoner's decision scored as a closed set, see the module
      docstring; needs a ``score`` function) | "text" (parsed from the generated text, :func:`next_role`).
    first_thought: "generate" (the reasoner writes its first turn; ``role_choice`` reads the
      hand-over) | "closed" (the first reasoner turn, thought and hand-over, is chosen by a
      ``choose_first`` function instead of generated, e.g. ``run.closed_thought``'s closed-set
      reading of the "names" template; later reasoner turns are generated).
    no_call_bias: with first_thought="closed", added to the "no call" choice's log-probability
      (``run.closed_thought``; 0 = the model's own preference).
    executor: "generate" (the executor writes its turn) | "guided" (a ``write_executor`` function
      writes it wherever it can, e.g. ``run.guided_calls``' schema-constrained decode of the calls
      the reasoner's thought named; the other executor turns are generated).
    """

    max_turns: int = 4
    max_new_tokens: tuple[tuple[str, int], ...] = (("reasoner", 96), ("executor", 128), ("summarizer", 64))
    stop_after_executor: bool = True
    temperature: float = 0.0
    role_choice: str = "likelihood"
    first_thought: str = "generate"
    no_call_bias: float = 0.0
    executor: str = "generate"

    def __post_init__(self):
        if self.role_choice not in ("likelihood", "text"):
            raise ValueError(f"role_choice must be 'likelihood' or 'text', got {self.role_choice!r}")
        if self.first_thought not in FIRST_THOUGHTS:
            raise ValueError(f"first_thought must be one of {FIRST_THOUGHTS}, got {self.first_thought!r}")
        if self.executor not in EXECUTORS:
            raise ValueError(f"executor must be one of {EXECUTORS}, got {self.executor!r}")

    def budget(self, role: str) -> int:
        return dict(self.max_new_tokens)[role]


def next_role(reasoner_text: str) -> str:
    """The role a reasoner turn hands over to: the last "Next: <role>" it names (reasoner is read
    as executor: a reasoner never hands over to itself); without one, executor when the text
    contains a call ``[name(``, else summarizer."""
    named = _NEXT.findall(reasoner_text)
    if named:
        role = named[-1].lower()
        return "executor" if role == "reasoner" else role
    return "executor" if _CALL.search(reasoner_text) else "summarizer"


def thought_of(reasoner_text: str) -> str:
    """The reasoner's thought: its text before the last "Next:" marker it wrote (all of it when
    there is none), stripped."""
    marks = list(_MARKER.finditer(reasoner_text))
    return (reasoner_text[:marks[-1].start()] if marks else reasoner_text).strip()


def decision_turn(thought: str, role: str) -> str:
    """A reasoner turn: ``thought`` closed with the decision to hand over to ``role``, in the
    training data's words."""
    return f"{thought} Next: {role}." if thought else f"Next: {role}."


@dataclasses.dataclass(frozen=True)
class Continuation:
    """A sequence to score: ``score`` returns sum over t >= start of log p(ids[t] | ids[:t]), every
    token run under its ``roles`` id (-1: no adapter). 0 < start < len(ids)."""

    ids: tuple[int, ...]
    roles: tuple[int, ...]
    start: int


ScoreFn = Callable[[Sequence[Continuation]], Sequence[float]]


@dataclasses.dataclass(frozen=True)
class ChosenTurn:
    """A reasoner turn chosen rather than generated: the role it hands over to, its text, and the
    scores its choice was made on (kept with the answer, e.g. for calibration on a dev split)."""

    role: str
    text: str
    scores: tuple[float, ...] = ()


# episodes whose first reasoner turn is due -> that turn for each
ChooseFirstFn = Callable[[Sequence[Trajectory]], Sequence[ChosenTurn]]
# episodes whose executor turn is due -> (its text, generated tokens) for each, or None where the
# turn is to be generated
WriteExecutorFn = Callable[[Sequence[Trajectory]], Sequence["tuple[str, int] | None"]]


def decision_continuations(traj: Trajectory, thought: str, tokenizer) -> list[Continuation]:
    """For an episode whose next turn is the reasoner's: one :class:`Continuation` per role of
    DECISIONS, the episode followed by :func:`decision_turn`, through that turn's end-of-turn
    token, scored from the first token where the candidates differ (the shared prefix has the
    same probability under each, so only the decision's tokens are compared)."""
    seqs = []
    for role in DECISIONS:
        r = render(dataclasses.replace(traj, turns=traj.turns + (Turn("reasoner", decision_turn(thought, role)),)),
                   tokenizer)
        end = int(np.flatnonzero(r.loss_mask)[-1]) + 1  # the last turn's end-of-turn token (or its last token)
        seqs.append((r.tokens[:end].tolist(), r.role_ids[:end].tolist()))
    first = next(i for i, (a, b) in enumerate(zip(seqs[0][0], seqs[1][0])) if a != b)
    return [Continuation(tuple(ids), tuple(roles), first) for ids, roles in seqs]


def choose_decisions(trajs: Sequence[Trajectory], texts: Sequence[str], score: ScoreFn,
                     tokenizer) -> list[tuple[str, str]]:
    """(role, the reasoner turn's text closed with that decision) for each episode ``trajs[i]``
    (the reasoner's turn not yet added) whose reasoner wrote ``texts[i]``: the decision of DECISIONS
    whose turn the model finds likelier (ties: the first, executor); one ``score`` call for all."""
    thoughts = [thought_of(t) for t in texts]
    conts = [c for traj, th in zip(trajs, thoughts, strict=True) for c in decision_continuations(traj, th, tokenizer)]
    scores = np.asarray(score(conts), np.float64).reshape(len(trajs), len(DECISIONS)) if conts else np.zeros((0, 2))
    out = []
    for th, s in zip(thoughts, scores):
        role = DECISIONS[int(np.argmax(s))]
        out.append((role, decision_turn(th, role)))
    return out


def turn_prompt(traj: Trajectory, role: str, tokenizer) -> tuple[list[int], list[int]]:
    """(prompt token ids, per-token role ids) for generating ``role``'s next turn of ``traj``.

    The episode so far is rendered as SFT renders it (its role ids); the chat template's
    generation header that follows gets ``role``'s id. Raises ValueError when the template does
    not tokenize the episode as a prefix of the prompt.
    """
    # not models.chat.encode_chat: it continues a final assistant message, and here the last turn
    # (e.g. the reasoner's) is closed and a new assistant turn opens
    text = tokenizer.apply_chat_template(chat_messages(traj), tokenize=False, add_generation_prompt=True)
    ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
    rendered = render(traj, tokenizer)
    n = len(rendered.tokens)
    if ids[:n] != rendered.tokens.tolist():
        raise ValueError("role loop: the chat template's generation prompt does not extend the rendered episode")
    roles = np.concatenate([rendered.role_ids, np.full(len(ids) - n, ROLE_NAMES.index(role), np.int32)])
    return ids, roles.tolist()


@dataclasses.dataclass
class Episode:
    """One episode in progress: the trajectory so far and the role of its next turn (None: done)."""

    traj: Trajectory
    role: str | None = "reasoner"
    role_turns: int = 0
    tokens: int = 0  # generated tokens, all turns
    first_scores: tuple[float, ...] = ()  # the chosen first turn's scores (first_thought="closed")

    def add(self, turn: Turn) -> None:
        self.traj = dataclasses.replace(self.traj, turns=self.traj.turns + (turn,))


def run_role_loop(starts: Sequence[Trajectory], generate: Callable[[Sequence[Request]], Sequence[Completion]],
                  tokenizer, config: RoleLoopConfig, *, stop_token_ids: Sequence[int] = (),
                  observe: Callable[[str], str] | None = None, score: ScoreFn | None = None,
                  choose_first: ChooseFirstFn | None = None,
                  write_executor: WriteExecutorFn | None = None) -> list[Episode]:
    """Run the loop on every start (a trajectory holding the request: system, functions, user
    turn(s)) until each episode ends; returns the finished episodes in order.

    generate: requests -> completions (e.g. ``Sampler.generate`` with the adapter bound); one call
    per round, rows of every role together. observe: executor text -> observation text (None: no
    environment; the episode ends after the executor, as with ``stop_after_executor``). score:
    continuations -> log-probabilities (needed by ``role_choice="likelihood"``; one call per round
    with a reasoner turn, both decisions of every such episode together). choose_first: the
    first reasoner turn of every episode, chosen instead of generated (needed by
    ``first_thought="closed"``; one call for all episodes before the first round). write_executor:
    the executor turns it can write, instead of generating them (needed by ``executor="guided"``;
    one call per round with an executor turn due).
    """
    if config.role_choice == "likelihood" and score is None:
        raise ValueError("run_role_loop: role_choice='likelihood' needs a score function")
    if config.first_thought == "closed" and choose_first is None:
        raise ValueError("run_role_loop: first_thought='closed' needs a choose_first function")
    if config.executor == "guided" and write_executor is None:
        raise ValueError("run_role_loop: executor='guided' needs a write_executor function")
    eps = [Episode(traj=s) for s in starts]
    if config.first_thought == "closed" and eps:
        for e, chosen in zip(eps, choose_first([e.traj for e in eps]), strict=True):
            e.add(Turn("reasoner", chosen.text))  # chosen, not generated: no tokens counted
            e.first_scores = chosen.scores
            e.role_turns = 1
            e.role = None if e.role_turns >= config.max_turns else chosen.role
    while True:
        live = [e for e in eps if e.role is not None]
        if not live:
            return eps
        written = {}  # live index -> (text, tokens) of a written (not generated) executor turn
        if config.executor == "guided":
            idx = [i for i, e in enumerate(live) if e.role == "executor"]
            if idx:
                outs = write_executor([live[i].traj for i in idx])
                written = {i: o for i, o in zip(idx, outs, strict=True) if o is not None}
        reqs = []
        for i, e in enumerate(live):
            if i in written:
                continue
            ids, roles = turn_prompt(e.traj, e.role, tokenizer)
            reqs.append(Request(prompt_ids=ids, prompt_roles=roles, role=ROLE_NAMES.index(e.role),
                                max_new_tokens=config.budget(e.role), temperature=config.temperature,
                                stop_token_ids=tuple(stop_token_ids)))
        comps = iter(generate(reqs) if reqs else ())
        turns = []  # (text, generated tokens) per live episode, in order
        for i in range(len(live)):
            c = None if i in written else next(comps)
            turns.append(written[i] if c is None else (c.text, len(c.token_ids)))
        texts = [t.strip() or "(empty)" for t, _ in turns]  # a role turn is never empty (the format requires content)
        decided = {}
        if config.role_choice == "likelihood":
            idx = [i for i, e in enumerate(live) if e.role == "reasoner"]
            picks = choose_decisions([live[i].traj for i in idx], [texts[i] for i in idx], score, tokenizer)
            decided = dict(zip(idx, picks))
        for i, (e, (_, n_tokens), text) in enumerate(zip(live, turns, texts, strict=True)):
            if i in decided:
                text = decided[i][1]
            e.add(Turn(e.role, text))
            e.tokens += n_tokens
            e.role_turns += 1
            e.role = None if e.role_turns >= config.max_turns else (
                decided[i][0] if i in decided else _after(e.role, text, config, observe, e))


def _after(role: str, text: str, config: RoleLoopConfig, observe, episode: Episode) -> str | None:
    """The role of the next turn after a ``role`` turn with ``text`` (None: the episode ends);
    adds the observation turn after an executor when there is an environment."""
    if role == "reasoner":
        return next_role(text)
    if role == "executor":
        if observe is None or config.stop_after_executor:
            return None
        episode.add(Turn("observation", observe(text)))
        return "reasoner"
    return None  # the summarizer's turn is the last


def executor_text(episode: Episode) -> str:
    """The episode's first executor turn (its calls are the answer of a single-shot task), or ""
    when the reasoner went straight to the summarizer (no call)."""
    return next((t.content for t in episode.traj.turns if t.role == "executor"), "")
