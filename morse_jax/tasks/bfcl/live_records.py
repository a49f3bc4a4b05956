"""BFCL's live categories as training records, for evaluating on the non-live ones.

BFCL v4 has two families of single-turn items: the non-live ones (simple_python, multiple, parallel,
parallel_multiple, irrelevance; written by BFCL's authors) and the live ones (live_simple,
live_multiple, live_parallel, live_parallel_multiple, live_irrelevance; queries and functions users
contributed). Training on the live family and scoring on the non-live one is the split issue 19 names
as an option: the live items are real requests against real schemas, much closer to what the
non-live items ask than :mod:`~morse_jax.tasks.bfcl.synthetic`'s templated domains, and none of
them is a scored item.

Leakage guard: an item is left out when any function it offers shares its name with a function of
the non-live categories (18 names in v4, e.g. ``get_current_weather``), so no trained function
name is ever scored, and when its text equals a message of a scored item (one live_irrelevance
query repeats a non-live irrelevance one). Each record's reference calls take the first allowed
value of every argument of BFCL's possible answer (``""`` first = the argument is omitted) and
must pass BFCL's own checker on the item; a few possible answers do not (a required argument
whose only allowed value is ``""``) and those items are left out. live_irrelevance items become
no-call records. Items whose turn holds anything but system and
user messages (a few live_irrelevance items carry assistant turns) are left out; a system
message's text is put before the user's.

Records have :mod:`~morse_jax.tasks.bfcl.synthetic`'s format (``id``, ``scenario``, ``query``,
``functions``, ``calls``) and go through the same converter,
:func:`~morse_jax.tasks.bfcl.trajectories.from_function_calling`.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from morse_jax.tasks.bfcl.data import IRRELEVANCE, LIVE_AST, NON_LIVE_AST, BfclItem, function_names, load
from morse_jax.tasks.bfcl.prompting import format_calls
from morse_jax.tasks.bfcl.scoring import score

LIVE_TRAINING = LIVE_AST + ("live_irrelevance",)
# the categories whose function names a training record may not offer
SCORED = NON_LIVE_AST + ("irrelevance",)


def _first_allowed(allowed: Sequence[Any]) -> tuple[bool, Any]:
    """(present, value): the first allowed value; absent when it is "" (BFCL: may be omitted)."""
    if not allowed or allowed[0] == "":
        return False, None
    return True, _plain(allowed[0])


def _plain(value: Any) -> Any:
    """A possible answer's value with nested dict answers (per key: a list of allowed values,
    BFCL's dict checker) reduced to their first allowed values."""
    if isinstance(value, Mapping):
        out = {}
        for k, allowed in value.items():
            present, v = _first_allowed(allowed) if isinstance(allowed, list) else (True, allowed)
            if present:
                out[k] = v
        return out
    if isinstance(value, list) and value and all(isinstance(e, Mapping) for e in value):
        return [_plain(e) for e in value]
    return value


def reference_calls(ground_truth: Sequence[Mapping[str, Any]]) -> list[dict[str, dict[str, Any]]]:
    """BFCL possible answers ``[{func: {param: [allowed, ...]}}]`` -> calls ``[{func: {param: value}}]``
    with the first allowed value of each parameter (parameters whose first allowed value is "" left
    out)."""
    calls = []
    for call in ground_truth:
        (name, params), = call.items()
        args = {}
        for p, allowed in params.items():
            present, v = _first_allowed(allowed)
            if present:
                args[p] = v
        calls.append({name: args})
    return calls


def _query(item: BfclItem) -> str | None:
    roles = [m["role"] for m in item.question]
    if any(r not in ("system", "user") for r in roles) or "user" not in roles:
        return None
    return "\n\n".join(m["content"] for m in item.question)


def live_records(categories: Sequence[str] = LIVE_TRAINING,
                 exclude_names: frozenset[str] | None = None) -> tuple[list[dict], dict[str, int]]:
    """(records, counts): the live items of ``categories`` as function-calling records, and how many
    were kept and left out and why (``"kept"``, ``"shared_name"``, ``"shared_query"``, ``"turns"``,
    ``"unscorable"``).

    ``exclude_names``: function names a kept record may not offer (default: every function name of
    the scored non-live categories, :data:`SCORED`)."""
    bad = [c for c in categories if c not in LIVE_TRAINING]
    if bad:
        raise ValueError(f"live_records: {bad} are not live training categories ({', '.join(LIVE_TRAINING)})")
    if exclude_names is None:
        exclude_names = function_names(SCORED)
    scored_texts = {m["content"] for c in SCORED for it in load(c) for m in it.question}
    records, counts = [], {"kept": 0, "shared_name": 0, "shared_query": 0, "turns": 0, "unscorable": 0}
    for category in categories:
        for item in load(category):
            if any(f["name"] in exclude_names for f in item.functions):
                counts["shared_name"] += 1
                continue
            query = _query(item)
            if query is None:
                counts["turns"] += 1
                continue
            if any(m["content"] in scored_texts for m in item.question):
                counts["shared_query"] += 1
                continue
            calls = [] if category in IRRELEVANCE else reference_calls(item.ground_truth)
            if calls and not score(item, format_calls(calls)).correct:
                counts["unscorable"] += 1
                continue
            records.append({"id": item.id, "scenario": category, "query": query,
                            "functions": [dict(f) for f in item.functions], "calls": calls})
            counts["kept"] += 1
    return records, counts
