"""BFCL results in the MoRAgent paper's Table 2 layout, a row per variant run.

Columns, from per-item verdicts (percent; a column with no evaluated item is left blank):

* Non-live AST: unweighted mean of the non-live categories' accuracies (BFCL's aggregation; its
  "simple" is the mean of Python/Java/JavaScript, of which only Python is covered here, so simple =
  simple_python).
* Live AST: count-weighted accuracy over the live AST categories (BFCL's aggregation).
* Relevance: live_relevance accuracy.
* Irrelevance: unweighted mean of irrelevance and live_irrelevance (BFCL's summary).
* Average: unweighted mean of the columns above that have items. The paper's AVG also averages a
  Non-live Exec column; BFCL v4 ships no executable functions, so that column does not exist here,
  and the paper's BFCL version had 18 live_relevance items (v4 has 16): compare with care.

Subsets (e.g. the first 100 simple_python items) are aggregated the same way over what was run.
"""

from __future__ import annotations

from typing import Mapping, Sequence

from morse_jax.tasks.bfcl.data import CATEGORIES, IRRELEVANCE, LIVE_AST, NON_LIVE_AST, RELEVANCE
from morse_jax.tasks.bfcl.scoring import ScoreResult

COLUMNS = ("non_live_ast", "live_ast", "relevance", "irrelevance", "average")
HEADERS = {"non_live_ast": "Non-live AST", "live_ast": "Live AST", "relevance": "Relevance",
           "irrelevance": "Irrelevance", "average": "AVG"}


def category_counts(results: Sequence[ScoreResult]) -> dict[str, tuple[int, int]]:
    """category -> (correct, total) over ``results``, in CATEGORIES order."""
    counts: dict[str, list[int]] = {}
    for r in results:
        if r.category not in CATEGORIES:
            raise ValueError(f"bfcl report: unknown category {r.category!r} (item {r.id})")
        c = counts.setdefault(r.category, [0, 0])
        c[0] += bool(r.correct)
        c[1] += 1
    return {k: tuple(counts[k]) for k in CATEGORIES if k in counts}


def _mean(xs: list[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


def summarize(results: Sequence[ScoreResult]) -> dict:
    """Table 2 columns (percent, None where nothing was run) plus ``categories``
    {category: percent} and ``counts`` {category: [correct, total]}."""
    counts = category_counts(results)
    acc = {k: 100.0 * c / n for k, (c, n) in counts.items()}
    live = [counts[k] for k in LIVE_AST if k in counts]
    out = {
        "non_live_ast": _mean([acc[k] for k in NON_LIVE_AST if k in acc]),
        "live_ast": 100.0 * sum(c for c, _ in live) / sum(n for _, n in live) if live else None,
        "relevance": _mean([acc[k] for k in RELEVANCE if k in acc]),
        "irrelevance": _mean([acc[k] for k in IRRELEVANCE if k in acc]),
    }
    out["average"] = _mean([v for v in out.values() if v is not None])
    out["categories"] = acc
    out["counts"] = {k: list(v) for k, v in counts.items()}
    return out


def _cell(v: float | None) -> str:
    return "" if v is None else f"{v:.1f}"


def table2_markdown(rows: Mapping[str, Sequence[ScoreResult]]) -> str:
    """Two markdown tables: the Table 2 columns and the per-category accuracies (with item counts
    in the header), one row per variant (``rows``: variant name -> its per-item results)."""
    summaries = {name: summarize(res) for name, res in rows.items()}
    cats = [k for k in CATEGORIES if any(k in s["counts"] for s in summaries.values())]
    lines = ["| variant | " + " | ".join(HEADERS[c] for c in COLUMNS) + " |",
             "|---|" + "---:|" * len(COLUMNS)]
    for name, s in summaries.items():
        lines.append(f"| {name} | " + " | ".join(_cell(s[c]) for c in COLUMNS) + " |")
    lines += ["", "| variant | " + " | ".join(cats) + " |", "|---|" + "---:|" * len(cats)]
    for name, s in summaries.items():
        cells = [_cell(s["categories"].get(k)) + (f" ({s['counts'][k][1]})" if k in s["counts"] else "")
                 for k in cats]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"
