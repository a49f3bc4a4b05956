"""Fixed BFCL item subsets: ``"category:count"`` entries, items evenly spaced in BFCL's order.

A subset sees the whole of each category (not its first block, which BFCL orders by source) and
is the same on every run.
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


def select_items(subset: Sequence[tuple[str, int]]) -> list[BfclItem]:
    """The fixed subset: for each (category, count), ``count`` items evenly spaced in BFCL's order."""
    items = []
    for cat, n in subset:
        every = load(cat)
        items += [every[i] for i in spaced(len(every), n)]
    return items
