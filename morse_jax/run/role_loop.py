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
* after a reasoner turn, the next role is the one it names ("Next: executor." / "Next:
  summarizer.", the training data's convention, :func:`next_role`);
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
_CALL = re.compile(r"\[\s*[A-Za-z_][\w.]*\s*\(")


@dataclasses.dataclass(frozen=True)
class RoleLoopConfig:
    """Bounds and decoding of the loop.

    max_turns: role turns per episode (reasoner, executor and summarizer turns all count).
    max_new_tokens: per role name, the new-token budget of its turns.
    stop_after_executor: end an episode after its first executor turn (single-shot tasks such as
      BFCL, scored on the executor's calls with nothing to execute).
    temperature: 0 = greedy.
    """

    max_turns: int = 4
    max_new_tokens: tuple[tuple[str, int], ...] = (("reasoner", 96), ("executor", 128), ("summarizer", 64))
    stop_after_executor: bool = True
    temperature: float = 0.0

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

    def add(self, turn: Turn) -> None:
        self.traj = dataclasses.replace(self.traj, turns=self.traj.turns + (turn,))


def run_role_loop(starts: Sequence[Trajectory], generate: Callable[[Sequence[Request]], Sequence[Completion]],
                  tokenizer, config: RoleLoopConfig, *, stop_token_ids: Sequence[int] = (),
                  observe: Callable[[str], str] | None = None) -> list[Episode]:
    """Run the loop on every start (a trajectory holding the request: system, functions, user
    turn(s)) until each episode ends; returns the finished episodes in order.

    generate: requests -> completions (e.g. ``Sampler.generate`` with the adapter bound); one call
    per round, rows of every role together. observe: executor text -> observation text (None: no
    environment; the episode ends after the executor, as with ``stop_after_executor``).
    """
    eps = [Episode(traj=s) for s in starts]
    while True:
        live = [e for e in eps if e.role is not None]
        if not live:
            return eps
        reqs = []
        for e in live:
            ids, roles = turn_prompt(e.traj, e.role, tokenizer)
            reqs.append(Request(prompt_ids=ids, prompt_roles=roles, role=ROLE_NAMES.index(e.role),
                                max_new_tokens=config.budget(e.role), temperature=config.temperature,
                                stop_token_ids=tuple(stop_token_ids)))
        for e, c in zip(live, generate(reqs), strict=True):
            text = c.text.strip() or "(empty)"  # a role turn is never empty (the format requires content)
            e.add(Turn(e.role, text))
            e.tokens += len(c.token_ids)
            e.role_turns += 1
            e.role = None if e.role_turns >= config.max_turns else _after(e.role, text, config, observe, e)


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
