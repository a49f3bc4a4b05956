"""Select ``moragent.no_call_bias`` on a dev split, offline, from one evaluation's answers file.

An evaluation with ``first_thought="closed"`` and bias 0 records each item's head log-probabilities
(``head_logprobs``: k = 0 .. MAX_CALLS calls, ``run.closed_thought``). For a bias b >= 0 the count
changes only where the "no call" head comes within b of the best other head: those items turn into
no call, which BFCL scores as correct on irrelevance items and incorrect elsewhere (a relevance item
needs a call, an AST item its calls); every other item keeps its verdict. So the whole sweep over
b >= 0 follows from the one run, with no model call (a negative bias would need executor answers
the run did not make).

The bias must be chosen on items the report does not score, e.g. BFCL's live categories for the
quickstart's non-live subset::

    python -m morse_jax.run.no_call_calibration runs/dev/mor_closed/bfcl_answers.jsonl

prints the dev summary for every candidate bias and the one with the best average (ties: the
smallest bias). With ``--bias B`` it prints only the summary at B (per category too): what the
chosen bias does on another run's answers, e.g. the scored subset's (exact for B >= 0: the same
items turn into no call as in a run with ``moragent.no_call_bias=B``, the others keep their answers).
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Sequence

import numpy as np

from morse_jax.run.bfcl_eval import read_answers, result_of
from morse_jax.tasks import bfcl
from morse_jax.tasks.bfcl.data import IRRELEVANCE  # where no call is the right answer
from morse_jax.tasks.bfcl.report import COLUMNS, HEADERS

TOL = 1e-6  # margins are float sums of log-probabilities; a bias within TOL of one reaches it


def no_call_margin(rec: dict) -> float:
    """How far the best head with calls is above the "no call" head (> 0: the model calls)."""
    h = rec["head_logprobs"]
    return float(max(h[1:]) - h[0])


def with_bias(recs: Sequence[dict], bias: float) -> list[dict]:
    """The records as a bias ``bias`` >= 0 on the "no call" head would have made them."""
    if bias < 0:
        raise ValueError(f"bias must be >= 0 (a negative bias needs answers the run did not make), got {bias}")
    out = []
    for r in recs:
        if "head_logprobs" in r and len(r["head_logprobs"]) > 1 and 0 < no_call_margin(r) <= bias + TOL:
            r = dict(r, text="", has_call=False, correct=r["category"] in IRRELEVANCE,
                     error="" if r["category"] in IRRELEVANCE else "no call (no_call_bias)",
                     error_type="" if r["category"] in IRRELEVANCE else "no_call_bias")
        out.append(r)
    return out


def candidate_biases(recs: Sequence[dict]) -> list[float]:
    """0 and, for each distinct positive margin, that margin rounded up to 4 decimals (a value one
    can write in a config that turns that item, and any within 1e-4 below it, into no call)."""
    margins = {math.ceil(no_call_margin(r) * 1e4 - TOL) / 1e4 for r in recs if len(r.get("head_logprobs", ())) > 1}
    return [0.0] + sorted(m for m in margins if m > 0)


def sweep(recs: Sequence[dict]) -> list[tuple[float, dict]]:
    """(bias, summary) for every candidate bias, in increasing order."""
    return [(b, bfcl.summarize([result_of(r) for r in with_bias(recs, b)])) for b in candidate_biases(recs)]


def best_bias(rows: Sequence[tuple[float, dict]]) -> float:
    """The bias with the highest average (the first, i.e. smallest, among equals)."""
    avgs = np.array([s["average"] for _, s in rows], np.float64)
    return rows[int(np.argmax(avgs))][0]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("answers", type=Path, help="bfcl_answers.jsonl of a first_thought=closed, bias-0 run (dev items)")
    ap.add_argument("--bias", type=float, default=None, help="print the summary at this bias only (no selection)")
    args = ap.parse_args(argv)
    recs = list(read_answers(args.answers).values())
    if not any("head_logprobs" in r for r in recs):
        raise SystemExit(f"{args.answers}: no head_logprobs (run the evaluation with moragent.first_thought=closed)")
    if args.bias is not None:
        s = bfcl.summarize([result_of(r) for r in with_bias(recs, args.bias)])
        print(json.dumps({"items": len(recs), "no_call_bias": args.bias,
                          "summary": {k: (round(v, 1) if isinstance(v, float) else v) for k, v in s.items()}}))
        return
    rows = sweep(recs)
    cols = [c for c in COLUMNS if rows[0][1].get(c) is not None]
    print("bias    " + "  ".join(f"{HEADERS[c]:>12}" for c in cols))
    for b, s in rows:
        print(f"{b:<7.4f} " + "  ".join(f"{s[c]:>12.1f}" for c in cols))
    b = best_bias(rows)
    print(json.dumps({"items": len(recs), "best_no_call_bias": b,
                      "summary": {c: round(dict(rows)[b][c], 1) for c in cols}}))


if __name__ == "__main__":
    main()
