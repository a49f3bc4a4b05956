"""The executor's calls written under the offered functions' schemas: a grammar-constrained decode.

A small model after short SFT makes the reasoner's decision well enough once it is read as a closed
set (``run.closed_thought``), but its free executor turn loses the call in ways BFCL's checker
rejects outright: positional arguments (``math.factorial(5)``, dropped by BFCL's decoder), a
required parameter left out, a parameter name invented. The function schemas fix all of that
grammar; only the values are the model's to write. Here the executor's turn is

    [name_1(p=v, ...), name_2(...), ...]

written step by step:

* the calls, their number and order are those the reasoner's "names" thought decided
  (``tasks.bfcl.trajectories.parse_names_thought``); an episode whose last reasoner turn is not
  such a thought gets no guided turn (None: the caller generates it freely);
* each parameter name is a closed-set choice scored by the model under the executor's group
  (``ScoreFn``): the candidates are the function's parameters not yet written, in schema order,
  each as ``"p="`` (after ``", "`` when the call has arguments), and the call's close once every
  required parameter is written (scored as the text that follows it in a training turn, ``")]"``
  or ``"), <next name>("``: ``")"`` mostly merges with what follows in the tokenizer). So a call
  never misses a required parameter, never repeats one and never names one its schema lacks, and
  the model decides which optional ones to pass. A single candidate is not scored;
* each value is generated (greedy, the executor's group, token healing over the ``=`` so the
  model tokenizes the boundary as in training) and cut at its first ``,`` or ``)`` outside
  brackets and string quotes (:func:`leading_value`); a value that is empty or does not parse as
  a Python expression ends the call without that parameter.

Candidates are rendered as SFT renders an executor turn (``closed_thought.partial_turn_ids``) and
scored from the first token where they differ. Cost per episode: one ``score`` row per parameter
choice with more than one candidate, one generated value per parameter written; every episode
still writing takes part in each round's one ``score`` call and one ``generate`` call.
"""

from __future__ import annotations

import ast
import dataclasses
from typing import Callable, Sequence

import numpy as np

from morse_jax.run.closed_thought import candidate_continuations, partial_turn_ids
from morse_jax.run.role_loop import ScoreFn
from morse_jax.sampling.requests import Completion, Request
from morse_jax.tasks.bfcl.trajectories import parse_names_thought
from morse_jax.tasks.trajectories import ROLE_NAMES, Trajectory

EXECUTOR = ROLE_NAMES.index("executor")
CLOSE = None  # the candidate that closes the call (its text: :meth:`_Writer.close_text`)


def leading_value(text: str) -> str | None:
    """The Python expression ``text`` starts with: its text up to the first ``,``, ``)`` or ``]``
    outside brackets and string quotes (all of it when there is none), stripped; None when that is
    empty or not a Python expression (e.g. a string the budget cut before its closing quote)."""
    depth, quote, i = 0, "", 0
    while i < len(text):
        ch = text[i]
        if quote:
            if ch == "\\":
                i += 1
            elif ch == quote:
                quote = ""
        elif ch in "'\"":
            quote = ch
        elif ch in "([{":
            depth += 1
        elif ch in ")]}":
            if depth == 0:
                break
            depth -= 1
        elif ch == "," and depth == 0:
            break
        i += 1
    value = text[:i].strip()
    if not value:
        return None
    try:
        ast.parse(value, mode="eval")
    except SyntaxError:
        return None
    return value


@dataclasses.dataclass
class _Writer:
    """One episode's executor turn being written."""

    traj: Trajectory
    calls: list[tuple[str, list[str], set[str]]]  # (name, parameter names in schema order, required ones)
    done: list[str] = dataclasses.field(default_factory=list)  # finished calls' text
    args: list[tuple[str, str]] = dataclasses.field(default_factory=list)  # the current call's (param, value)
    due: str | None = None  # the parameter whose value is to be generated
    tokens: int = 0

    @property
    def finished(self) -> bool:
        return len(self.done) == len(self.calls)

    def _call_so_far(self) -> str:
        name = self.calls[len(self.done)][0]
        return name + "(" + ", ".join(f"{p}={v}" for p, v in self.args)

    def text(self) -> str:
        """The turn so far (the whole turn once finished)."""
        if self.finished:
            return "[" + ", ".join(self.done) + "]"
        return "[" + "".join(c + ", " for c in self.done) + self._call_so_far()

    def close_text(self) -> str:
        """What follows a closed call in the turn, up to the next choice: ")]" after the last call,
        "), <next name>(" otherwise. Scored as the closing candidate's text, so that it is
        tokenized as in a training turn (where ")" mostly merges with what follows)."""
        nxt = len(self.done) + 1
        return ")]" if nxt == len(self.calls) else f"), {self.calls[nxt][0]}("

    def candidates(self) -> list[tuple[str, str | None]]:
        """This step's choices as (text, parameter; CLOSE to close the call)."""
        _, params, required = self.calls[len(self.done)]
        used = {p for p, _ in self.args}
        sep = ", " if self.args else ""
        out = [(f"{sep}{p}=", p) for p in params if p not in used]
        return out + [(self.close_text(), CLOSE)] if required <= used else out

    def choose(self, param: str | None) -> None:
        if param is CLOSE:
            self.done.append(self._call_so_far() + ")")
            self.args = []
        else:
            self.due = param

    def pending(self) -> str:
        """The turn so far with the due parameter's ``p=`` written."""
        return self.text() + (", " if self.args else "") + f"{self.due}="

    def put(self, value: str | None) -> None:
        if value is None:  # nothing usable: end the call without it
            self.due = None
            self.choose(CLOSE)
            return
        self.args.append((self.due, value))
        self.due = None


def _schema_calls(names: Sequence[str], functions: Sequence[dict]) -> list[tuple[str, list[str], set[str]]]:
    by_name = {f["name"]: f for f in functions}
    out = []
    for n in names:
        spec = by_name[n].get("parameters") or {}
        params = list((spec.get("properties") or {}).keys())
        out.append((n, params, set(spec.get("required") or ()) & set(params)))
    return out


def write_calls(trajs: Sequence[Trajectory], *, generate: Callable[[Sequence[Request]], Sequence[Completion]],
                score: ScoreFn, tokenizer, stop_token_ids: Sequence[int] = (),
                value_tokens: int = 32) -> list[tuple[str, int] | None]:
    """The executor turn of each episode ``trajs[i]`` (its last turn the reasoner's), written as the
    module docstring says: ``(text, generated tokens)``, or None when its last reasoner turn is not
    a "names" thought that names a call. ``value_tokens``: the budget of one generated value."""
    writers: list[_Writer | None] = []
    for t in trajs:
        last = next((x.content for x in reversed(t.turns) if x.role == "reasoner"), "")
        offered = [f["name"] for f in t.functions]
        names = parse_names_thought(last, offered)
        writers.append(_Writer(t, _schema_calls(names, t.functions)) if names else None)
    active = [w for w in writers if w is not None]
    while True:
        choosing = []
        for w in active:
            while not w.finished and w.due is None:  # forced steps need no model
                cands = w.candidates()
                if len(cands) > 1:
                    choosing.append((w, cands))
                    break
                w.choose(cands[0][1])
        if choosing:
            conts = [c for w, cands in choosing
                     for c in candidate_continuations(w.traj, [w.text() + t for t, _ in cands], tokenizer, "executor")]
            flat = np.asarray(score(conts), np.float64)
            lo = 0
            for w, cands in choosing:
                w.choose(cands[int(np.argmax(flat[lo:lo + len(cands)]))][1])
                lo += len(cands)
        valuing = [w for w in active if w.due is not None]
        if valuing:
            reqs = []
            for w in valuing:
                ids, roles = partial_turn_ids(w.traj, w.pending(), tokenizer, "executor")
                reqs.append(Request(prompt_ids=ids, prompt_roles=roles, role=EXECUTOR, max_new_tokens=value_tokens,
                                    temperature=0.0, heal_tokens=1, stop_token_ids=tuple(stop_token_ids)))
            for w, c in zip(valuing, generate(reqs), strict=True):
                w.tokens += len(c.token_ids)
                w.put(leading_value(c.text))  # what follows "p=" (a healed token's re-written "=" is not in it)
        if not choosing and not valuing:
            break
    return [None if w is None else (w.text(), w.tokens) for w in writers]
