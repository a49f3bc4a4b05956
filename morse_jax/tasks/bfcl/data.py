"""BFCL v4 items of the single-turn categories, read from the data bfcl-eval ships.

Each item carries what a model sees (its chat messages, the function docs with BFCL's
"Python 3 syntax" hint appended to each description, exactly as BFCL's generation step builds them)
and what the checker needs (the un-hinted docs BFCL scores against, the possible answers).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
from typing import Any, Mapping, Sequence

from morse_jax.tasks.bfcl.bfcl_import import bfcl

NON_LIVE_AST = ("simple_python", "multiple", "parallel", "parallel_multiple")
LIVE_AST = ("live_simple", "live_multiple", "live_parallel", "live_parallel_multiple")
AST_CATEGORIES = NON_LIVE_AST + LIVE_AST
IRRELEVANCE = ("irrelevance", "live_irrelevance")  # correct iff the answer contains no call
RELEVANCE = ("live_relevance",)  # correct iff the answer contains a call (any call)
CATEGORIES = AST_CATEGORIES + IRRELEVANCE + RELEVANCE


@dataclasses.dataclass(frozen=True)
class BfclItem:
    """One BFCL question.

    Attributes:
      id: BFCL's id, e.g. "simple_python_0", "live_multiple_3-1-0".
      category: one of CATEGORIES.
      question: the chat messages of the (single) turn, ``[{"role", "content"}, ...]``; live
        items may start with a system message and live_irrelevance may contain assistant turns.
      functions: the function docs shown to the model (BFCL schema dialect, language hint added).
      checker_functions: the docs BFCL's checker scores against (no hint).
      ground_truth: possible answers ``[{func: {param: [allowed values]}}]``; None for
        relevance / irrelevance items. ``""`` among allowed values = the parameter may be omitted.
    """

    id: str
    category: str
    question: tuple[Mapping[str, str], ...]
    functions: tuple[Mapping[str, Any], ...]
    checker_functions: tuple[Mapping[str, Any], ...]
    ground_truth: tuple[Mapping[str, Any], ...] | None


def _check_category(category: str) -> None:
    if category not in CATEGORIES:
        raise ValueError(f"bfcl: unknown category {category!r}; covered: {', '.join(CATEGORIES)}")


@functools.lru_cache(maxsize=None)
def _load(category: str) -> tuple[BfclItem, ...]:
    utils = bfcl().utils
    shown = utils.load_dataset_entry(category, include_language_specific_hint=True)
    raw = utils.load_dataset_entry(category, include_language_specific_hint=False)
    answers = utils.load_ground_truth_entry(category) if category in AST_CATEGORIES else None
    items = []
    for i, (s, r) in enumerate(zip(shown, raw, strict=True)):
        if len(s["question"]) != 1:
            raise ValueError(f"bfcl: {s['id']} has {len(s['question'])} turns; only single-turn items are covered")
        gt = None
        if answers is not None:
            if answers[i]["id"] != s["id"]:
                raise ValueError(f"bfcl: possible answer {answers[i]['id']} does not match question {s['id']}")
            gt = tuple(answers[i]["ground_truth"])
        items.append(BfclItem(id=s["id"], category=category, question=tuple(s["question"][0]),
                              functions=tuple(s["function"]), checker_functions=tuple(r["function"]),
                              ground_truth=gt))
    return tuple(items)


def load(category: str, limit: int = 0) -> list[BfclItem]:
    """The items of one category in BFCL's order (the first ``limit`` when > 0).

    Items are deep copies: callers may mutate their dicts freely.
    """
    _check_category(category)
    items = _load(category)
    return copy.deepcopy(list(items[:limit] if limit else items))


def function_names(categories: Sequence[str] = CATEGORIES) -> frozenset[str]:
    """Every function name offered in the given categories (for leakage checks)."""
    names = set()
    for c in categories:
        _check_category(c)
        names.update(f["name"] for item in _load(c) for f in item.functions)
    return frozenset(names)
