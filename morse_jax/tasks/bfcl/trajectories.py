"""Plain single-turn function-calling records -> MoRAgent multi-role trajectories (rule-based).

The records are BFCL-style ``{"query", "functions", "calls"}`` (e.g. :mod:`~morse_jax.tasks.bfcl.synthetic`);
the executor turn uses BFCL's call syntax (:func:`~morse_jax.tasks.bfcl.prompting.format_calls`).
"""

from __future__ import annotations

import json
import re
import zlib
from typing import Any, Iterable, Mapping, Sequence

from morse_jax.tasks.bfcl.prompting import format_calls  # the answer syntax BFCL's decoder reads
from morse_jax.tasks.trajectories import DataFormatError, Trajectory, Turn

DEFAULT_SYSTEM = ("You are a function-calling agent made of three roles. The reasoner reads the request and "
                  "what happened so far, thinks, and ends with 'Next: executor.' or 'Next: summarizer.'. The "
                  "executor answers only with function calls in the format [func_name(param=value, ...)]. The "
                  "summarizer gives the user the final answer.")



def _args_text(args: Mapping[str, Any]) -> str:
    return ", ".join(f"{k}={v!r}" for k, v in args.items()) or "no arguments"


THOUGHT_STYLES = ("names", "plan")


def names_head(n_calls: int) -> str:
    """The opening of a "names" thought that decides the number of calls: "Plan: no call." /
    "Plan: call" / "Plan: <n> calls:" (the function names follow the last two)."""
    if n_calls < 0:
        raise ValueError(f"n_calls must be >= 0, got {n_calls}")
    return "Plan: no call." if n_calls == 0 else "Plan: call" if n_calls == 1 else f"Plan: {n_calls} calls:"


def names_thought(names: Sequence[str], offered: Iterable[str]) -> str:
    """The whole "names" thought for calls of ``names`` (in order; empty: no call) among the
    ``offered`` function names, closed with its hand-over ("Next: executor." / "Next: summarizer.")."""
    if not names:
        return (f"{names_head(0)} None of the available functions ({', '.join(sorted(offered)) or 'none'}) "
                "can do what the user asks. Next: summarizer.")
    return f"{names_head(len(names))} {', '.join(names)}, with the arguments the request states. Next: executor."


_NAMES_THOUGHT = re.compile(r"Plan: (?:call|(\d+) calls:) (.+), with the arguments the request states\. Next: executor\.")


def parse_names_thought(text: str, offered: Iterable[str]) -> list[str] | None:
    """The inverse of :func:`names_thought`: the called names (in order; [] for a no-call thought)
    of a thought written in the "names" template with names among ``offered``, or None when
    ``text`` is not such a thought (prose, a count that disagrees with the names, an unknown name)."""
    text = text.strip()
    if text.startswith(names_head(0) + " ") and text.endswith("Next: summarizer."):
        return []
    m = _NAMES_THOUGHT.fullmatch(text)
    if m is None:
        return None
    names, offered = m.group(2).split(", "), set(offered)
    count = int(m.group(1)) if m.group(1) else 1
    if (m.group(1) and count < 2) or len(names) != count or not set(names) <= offered:
        return None
    return names


def _first_thought(calls: list, offered: set, style: str, v: int) -> str:
    """The reasoner's first turn (see :func:`from_function_calling` for the two styles)."""
    if style == "names":
        return names_thought([name for c in calls for name in c], offered)
    if not calls:
        return (f"None of the available functions ({', '.join(sorted(offered)) or 'none'}) can do what the user "
                "asks, so no call should be made. Next: summarizer.")
    plan = "; ".join(f"{name} with {_args_text(args)}" for c in calls for name, args in c.items())
    n = len(calls)
    what = "one call" if n == 1 else f"{n} calls"
    return (f"The request maps to {what}: {plan}. Every required value is stated, so the executor should "
            f"make {'it' if n == 1 else 'them'}. Next: executor." if v == 0 else
            f"I need {what} here: {plan}. The arguments come straight from the request. Next: executor.")


def from_function_calling(record: Mapping[str, Any], *, system: str = DEFAULT_SYSTEM,
                          thought: str = "names") -> Trajectory:
    """A plain single-turn function-calling record ``{"query", "functions", "calls"}`` (calls as
    ``[{name: {param: value}}]``, ``[]`` when no offered function applies) -> a multi-role trajectory.

    The paper completes thoughts and summaries with GPT-4o and grades them with DeepSeek-V3; those
    completions are not available offline, so every role turn here is templated from the reference
    calls: the reasoner's thought decides and hands over, the executor makes exactly the reference
    calls (BFCL's ``[func(param=value)]`` syntax), the observation reports a success per call, the
    reasoner then hands over to the summarizer, which restates what was done. With no call, the
    reasoner says that no offered function applies and goes straight to the summarizer, which
    declines. Template variants are chosen by a hash of the query (deterministic).

    ``thought`` (the reasoner's first turn):

    * ``"names"`` (default): "Plan: call f, with the arguments the request states. Next: executor."
      (or "Plan: 2 calls: f, g, ..." / "Plan: no call. ..."): one fixed opener and the function
      names only. Why: with "plan", a small model after short SFT (SmolLM2-135M, one epoch) still
      opened its thought in prose ("The area of a triangle is ..."; the plan style's own openers
      "The request ..." / "I need ..." start like prose), and its executor, trained to copy the
      arguments out of the thought, then had nothing to copy. A fixed opener is learnt in a few
      steps, and the executor learns to take the arguments from the request itself.
    * ``"plan"``: the thought spells out every call with its arguments, in two phrasings (the
      converter's first design; the README's earlier BFCL rows were trained on it).
    """
    if thought not in THOUGHT_STYLES:
        raise ValueError(f"thought: must be one of {THOUGHT_STYLES}, got {thought!r}")
    for key in ("query", "functions", "calls"):
        if key not in record:
            raise DataFormatError(f"{key}: missing from the function-calling record")
    query, functions, calls = record["query"], list(record["functions"]), list(record["calls"])
    offered = {f["name"] for f in functions}
    for c in calls:
        if len(c) != 1 or next(iter(c)) not in offered:
            raise DataFormatError(f"calls: {c!r} is not one call of an offered function")
    v = zlib.crc32(query.encode()) % 2
    turns = [Turn("user", query)]
    first = _first_thought(calls, offered, thought, v)
    if calls:
        n = len(calls)
        obs = json.dumps([{"function": name, "status": "ok"} for c in calls for name in c])
        done = ", ".join(f"{name} ({_args_text(args)})" for c in calls for name, args in c.items())
        turns += [Turn("reasoner", first), Turn("executor", format_calls(calls)), Turn("observation", obs),
                  Turn("reasoner", "The calls succeeded, so the request is done. Next: summarizer." if n > 1 else
                       "The call succeeded, so the request is done. Next: summarizer."),
                  Turn("summarizer", f"Done. I ran {done}." if v == 0 else f"All set: I called {done}.")]
    else:
        turns += [Turn("reasoner", first),
                  Turn("summarizer", "I can't do that with the functions available here; none of them covers "
                                     "this request.")]
    return Trajectory(turns=tuple(turns), functions=tuple(functions), system=system,
                      id=str(record.get("id", "")))
