"""The executor's calls written under the offered functions' schemas: a grammar-constrained decode.

A small model after short SFT makes the reasoner's decision well enough once it is read as a closed
set (``run.closed_thought``), but its free executor turn loses the call in ways BFCL's checker
rejects outright: positional arguments (``math.factorial(5)``, dropped by BFCL's decoder), a
required parameter left out, a parameter name invented. The function schemas fix that grammar;
the values are the model's to write. The executor's turn is

    [name_1(p=v, ...), name_2(...), ...]

* the calls, their number and order are those the reasoner's "names" thought decided
  (``tasks.bfcl.trajectories.parse_names_thought``); each call's ``name(`` is written for the
  model. An episode whose last reasoner turn is not such a thought gets no guided turn (None:
  the caller generates it freely);
* the model writes the rest greedily (the executor's group; token healing at the boundary, so it
  tokenizes the text as in training), and its text is kept as long as it follows the grammar:
  each parameter name one of the call's schema parameters not yet written, as ``p=`` (after
  ``", "`` when the call has arguments); each value a Python expression, cut at its first ``,``
  or ``)`` outside brackets and string quotes (:func:`leading_value`); ``)`` only once every
  required parameter is written;
* where the model's text leaves the grammar at a parameter name (a positional argument, an
  invented name, closing early) the step is a closed-set choice scored by the model
  (``ScoreFn``): the allowed candidates above, the close scored as the text that follows it in a
  training turn (``")]"`` or ``"), <next name>("``: ``)`` mostly merges with what follows in the
  tokenizer); a single allowed candidate is taken without scoring. Where a value is empty or not
  an expression (greedy decoding would write the same again), the call is closed there, without
  that parameter or any not yet written; then the model writes on from the new text.

So a call never passes a positional argument, repeats a parameter or names one its schema lacks,
and drops a required parameter only where the model could not write its value; where the model's
own text is grammatical it is kept as written.
Candidates are rendered as SFT renders an executor turn (``closed_thought.partial_turn_ids``) and
scored from the first token where they differ. Every round, episodes still writing take part in
one ``score`` call (those at a choice their text left) and one ``generate`` call; a model that
writes grammatical calls finishes in one round.
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
    return value_span(text)[0]


def value_span(text: str) -> tuple[str | None, int]:
    """(:func:`leading_value` of ``text``, the index where its text ends in ``text``)."""
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
        return None, i
    try:
        ast.parse(value, mode="eval")
    except SyntaxError:
        return None, i
    return value, i


@dataclasses.dataclass
class _Writer:
    """One episode's executor turn being written."""

    traj: Trajectory
    calls: list[tuple[str, list[str], set[str]]]  # (name, parameter names in schema order, required ones)
    done: list[str] = dataclasses.field(default_factory=list)  # finished calls' text
    args: list[tuple[str, str]] = dataclasses.field(default_factory=list)  # the current call's (param, value)
    due: str | None = None  # the parameter whose value is to be written next
    must_choose: bool = False  # the model's text left the grammar at this choice: score it
    tokens: int = 0

    @property
    def finished(self) -> bool:
        return len(self.done) == len(self.calls)

    def _call_so_far(self) -> str:
        name = self.calls[len(self.done)][0]
        return name + "(" + ", ".join(f"{p}={v}" for p, v in self.args)

    def text(self) -> str:
        """The turn so far, with a due parameter's ``p=`` (the whole turn once finished)."""
        if self.finished:
            return "[" + ", ".join(self.done) + "]"
        due = "" if self.due is None else (", " if self.args else "") + f"{self.due}="
        return "[" + "".join(c + ", " for c in self.done) + self._call_so_far() + due

    def close_text(self) -> str:
        """What follows a closed call in the turn, up to the next choice: ")]" after the last call,
        "), <next name>(" otherwise (the closing candidate's scored text)."""
        nxt = len(self.done) + 1
        return ")]" if nxt == len(self.calls) else f"), {self.calls[nxt][0]}("

    def candidates(self) -> list[tuple[str, str | None]]:
        """The choices at this point as (text, parameter; CLOSE closes the call)."""
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

    def force(self) -> None:
        """Take every choice that has a single allowed candidate."""
        while not self.finished and self.due is None:
            cands = self.candidates()
            if len(cands) > 1:
                return
            self.choose(cands[0][1])

    def consume(self, text: str) -> None:
        """Keep the grammatical part of the model's continuation ``text`` of :meth:`text` (see the
        module docstring). At a choice the text left with several candidates allowed,
        ``must_choose`` is set."""
        while not self.finished:
            if self.due is not None:  # a value
                value, end = value_span(text)
                if value is None:  # nothing usable: close the call without it
                    self.due = None
                    self.choose(CLOSE)
                    return
                self.args.append((self.due, value))
                self.due, text = None, text[end:]
                continue
            cands = self.candidates()
            match = next(((t, p) for t, p in cands if p is not CLOSE and text.startswith(t)), None)
            if match is not None:
                self.choose(match[1])
                text = text[len(match[0]):]
                continue
            if text.startswith(")") and any(p is CLOSE for _, p in cands):
                self.choose(CLOSE)
                opening = "" if self.finished else f", {self.calls[len(self.done)][0]}("
                if self.finished or not text[1:].startswith(opening):
                    return  # the next call's "name(" is the thought's: write on from there
                text = text[1 + len(opening):]
                continue
            if len(cands) == 1:
                self.choose(cands[0][1])
                return
            self.must_choose = True
            return


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
                max_new_tokens: int = 128) -> list[tuple[str, int] | None]:
    """The executor turn of each episode ``trajs[i]`` (its last turn the reasoner's), written as the
    module docstring says: ``(text, generated tokens)``, or None when its last reasoner turn is not
    a "names" thought that names a call. ``max_new_tokens``: the budget of one continuation."""
    writers: list[_Writer | None] = []
    for t in trajs:
        last = next((x.content for x in reversed(t.turns) if x.role == "reasoner"), "")
        offered = [f["name"] for f in t.functions]
        names = parse_names_thought(last, offered)
        writers.append(_Writer(t, _schema_calls(names, t.functions)) if names else None)
    active = [w for w in writers if w is not None]
    while True:
        for w in active:
            w.force()
        choosing = [(w, w.candidates()) for w in active if w.must_choose and not w.finished]
        if choosing:
            conts = [c for w, cands in choosing
                     for c in candidate_continuations(w.traj, [w.text() + t for t, _ in cands], tokenizer, "executor")]
            flat = np.asarray(score(conts), np.float64)
            lo = 0
            for w, cands in choosing:
                w.choose(cands[int(np.argmax(flat[lo:lo + len(cands)]))][1])
                w.must_choose = False
                w.force()
                lo += len(cands)
        writing = [w for w in active if not w.finished]
        if not writing:
            break
        reqs = []
        for w in writing:
            ids, roles = partial_turn_ids(w.traj, w.text(), tokenizer, "executor")
            reqs.append(Request(prompt_ids=ids, prompt_roles=roles, role=EXECUTOR, max_new_tokens=max_new_tokens,
                                temperature=0.0, heal_tokens=1, stop_token_ids=tuple(stop_token_ids)))
        for w, c in zip(writing, generate(reqs), strict=True):
            w.tokens += len(c.token_ids)
            w.consume(c.text)  # what follows the prompt's text (a healed token's re-written part is not in it)
    return [None if w is None else (w.text(), w.tokens) for w in writers]
