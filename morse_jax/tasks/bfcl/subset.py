"""Fixed BFCL item subsets: ``"category:count"`` entries, items evenly spaced in BFCL's order.

A subset sees the whole of each category (not its first block, which BFCL orders by source) and
is the same on every run.

Two splits of a category's items: ``"test"`` (the evenly spaced items above, what a report
scores) and ``"dev"`` (evenly spaced among the items that issue 19's full subset, DEFAULT_SUBSET,
never selects, so that nothing chosen on dev items, e.g. a decoding setting, is chosen on any item
of the 250-item subset or of its halves, which are subsets of it).
"""

from __future__ import annotations

from typing import Sequence

from morse_jax.tasks.bfcl.data import CATEGORIES, BfclItem, load

# The subset issue 19 names.
DEFAULT_SUBSET = (("simple_python", 100), ("multiple", 50), ("parallel", 50), ("irrelevance", 50))


def parse_subset(spec: Sequence[str] | str) -> tuple[tuple[str, int], ...]:
    """``("simple_python:100", "multiple:50")`` or ``"simple_python:100,multiple:50"`` ->
    ((category, count), ...); count 0 (or none given) = every item. Raises ValueError naming the
    bad entry."""
    parts = [p.strip() for p in (spec.split(",") if isinstance(spec, str) else spec) if p.strip()]
    out = []
    for p in parts:
        cat, _, n = p.partition(":")
        if cat not in CATEGORIES:
            raise ValueError(f"entry {p!r}: unknown category {cat!r} (covered: {', '.join(CATEGORIES)})")
        if n and not n.isdigit():
            raise ValueError(f"entry {p!r}: the count after ':' must be a non-negative integer")
        if any(cat == c for c, _ in out):
            raise ValueError(f"entry {p!r}: category {cat!r} given twice")
        out.append((cat, int(n or 0)))
    if not out:
        raise ValueError("empty (give category:count entries)")
    return tuple(out)


def spaced(n_total: int, n: int) -> list[int]:
    """``n`` indices evenly spaced over ``range(n_total)`` (all of them when n is 0 or >= n_total)."""
    if n <= 0 or n >= n_total:
        return list(range(n_total))
    return [i * n_total // n for i in range(n)]


SPLITS = ("test", "dev")


def dev_indices(category: str, n_total: int) -> list[int]:
    """The indices a dev split draws from: those DEFAULT_SUBSET does not select in ``category``
    (every index for a category it does not name)."""
    taken = set(spaced(n_total, dict(DEFAULT_SUBSET)[category])) if category in dict(DEFAULT_SUBSET) else set()
    return [i for i in range(n_total) if i not in taken]


def select_items(subset: Sequence[tuple[str, int]], split: str = "test") -> list[BfclItem]:
    """The fixed subset: for each (category, count), ``count`` items evenly spaced in BFCL's order
    (split "test"), or evenly spaced among the category's :func:`dev_indices` (split "dev")."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    items = []
    for cat, n in subset:
        every = load(cat)
        pool = list(range(len(every))) if split == "test" else dev_indices(cat, len(every))
        items += [every[pool[i]] for i in spaced(len(pool), n)]
    return items
