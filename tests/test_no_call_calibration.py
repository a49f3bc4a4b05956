"""Offline selection of the "no call" bias (``run.no_call_calibration``): the sweep re-scores an
answers file as the bias would have answered it (reference worked out by hand from BFCL's rules:
no call is right on irrelevance items only; live AST is count-weighted, irrelevance the mean of
the two irrelevance categories, the average the mean of the columns)."""

from __future__ import annotations

import json

import pytest

from morse_jax.run import no_call_calibration as cal


def _rec(id_, category, margin, correct):
    return {"id": id_, "category": category, "text": "[f(x=1)]" if margin > 0 else "", "correct": correct,
            "error": "" if correct else "wrong", "error_type": "", "has_call": margin > 0,
            "head_logprobs": [-1.0, -1.0 + margin, -9.0, -9.0, -9.0]}


RECS = [_rec("a", "irrelevance", 0.5, False),       # called where nothing applies
        _rec("b", "live_simple", 2.0, True),         # a right call, confidently
        _rec("c", "live_irrelevance", -1.0, True),   # no call already
        _rec("d", "live_simple", 0.3, False)]        # a wrong call, narrowly


def test_sweep_rescores_by_the_rules():
    rows = dict(cal.sweep(RECS))
    assert list(rows) == [0.0, 0.3, 0.5, 2.0]
    # 0.3: d turns into no call, still wrong on an AST item; 0.5: a too, now right; 2.0: b too, now wrong
    want = {0.0: (50.0, 50.0), 0.3: (50.0, 50.0), 0.5: (50.0, 100.0), 2.0: (0.0, 100.0)}
    for b, (live_ast, irrel) in want.items():
        assert rows[b]["live_ast"] == pytest.approx(live_ast) and rows[b]["irrelevance"] == pytest.approx(irrel)
        assert rows[b]["average"] == pytest.approx((live_ast + irrel) / 2)
    assert cal.best_bias(cal.sweep(RECS)) == 0.5
    assert RECS[0]["correct"] is False  # inputs untouched


def test_bias_is_applied_as_the_chooser_does():
    """Margin == bias: a tie, which the chooser gives to no call (the first head)."""
    assert [r["has_call"] for r in cal.with_bias(RECS, 0.3)] == [True, True, False, False]  # 0.3 reaches d's margin
    out = cal.with_bias(RECS, 0.5)
    assert [r["has_call"] for r in out] == [False, True, False, False]
    with pytest.raises(ValueError, match="bias must be >= 0"):
        cal.with_bias(RECS, -0.1)


def test_main_prints_the_best(tmp_path, capsys):
    p = tmp_path / "bfcl_answers.jsonl"
    p.write_text("".join(json.dumps(r) + "\n" for r in RECS))
    cal.main([str(p)])
    last = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert last["best_no_call_bias"] == 0.5 and last["summary"]["average"] == 75.0


def test_main_at_a_given_bias(tmp_path, capsys):
    p = tmp_path / "bfcl_answers.jsonl"
    p.write_text("".join(json.dumps(r) + "\n" for r in RECS))
    cal.main([str(p), "--bias", "2.0"])
    out = json.loads(capsys.readouterr().out)
    assert out["summary"]["live_ast"] == 0.0 and out["summary"]["irrelevance"] == 100.0
