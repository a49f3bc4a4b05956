"""BFCL's live categories as training records (tasks.bfcl.live_records): the leakage guard and the
reference calls, checked against BFCL's own data and definitions (possible answers: per parameter a
list of allowed values, "" first = may be omitted; live_irrelevance: no call is right)."""

from __future__ import annotations

import pytest

from morse_jax.tasks import bfcl
from morse_jax.tasks.bfcl.data import function_names
from morse_jax.tasks.bfcl.live_records import LIVE_TRAINING, SCORED, live_records, reference_calls
from morse_jax.tasks.bfcl.trajectories import from_function_calling


@pytest.fixture(scope="module")
def records():
    return live_records()


def test_no_record_offers_a_function_of_a_scored_category(records):
    recs, counts = records
    scored = function_names(SCORED)
    assert recs and counts["kept"] == len(recs)
    assert not {f["name"] for r in recs for f in r["functions"]} & scored
    # the guard is not vacuous: BFCL v4's live items do offer some scored names, and those are left out
    assert counts["shared_name"] > 0
    total = sum(len(bfcl.load(c)) for c in LIVE_TRAINING)
    assert sum(counts.values()) == total


def test_no_query_of_a_scored_item_is_trained_on(records):
    recs, _ = records
    scored = {m["content"] for c in SCORED for it in bfcl.load(c) for m in it.question}
    assert not any(r["query"] in scored for r in recs)


def test_reference_calls_are_scored_correct_by_bfcls_checker(records):
    """Every kept AST record's calls, written in BFCL's answer syntax, pass BFCL's checker on the item."""
    recs, _ = records
    by_id = {it.id: it for c in LIVE_TRAINING for it in bfcl.load(c)}
    ast = [r for r in recs if r["scenario"] != "live_irrelevance"]
    assert len(ast) > 400
    for r in ast[::7]:
        # written independently of format_calls: name(param=repr(value), ...)
        text = "[" + ", ".join(f"{n}({', '.join(f'{k}={v!r}' for k, v in a.items())})"
                               for c in r["calls"] for n, a in c.items()) + "]"
        res = bfcl.score(by_id[r["id"]], text)
        assert res.correct, (r["id"], res.error)


def test_irrelevance_records_make_no_call_and_convert(records):
    recs, _ = records
    irr = [r for r in recs if r["scenario"] == "live_irrelevance"]
    assert irr and all(r["calls"] == [] for r in irr)
    t = from_function_calling(irr[0])
    assert [turn.role for turn in t.turns] == ["user", "reasoner", "summarizer"]
    assert "Plan: no call." in t.turns[1].content


def test_reference_calls_take_the_first_allowed_value_and_omit_optional():
    gt = [{"f": {"a": [3, 4], "b": ["", "x"], "c": [{"k": ["v", "w"], "o": [""]}]}}, {"g": {}}]
    assert reference_calls(gt) == [{"f": {"a": 3, "c": {"k": "v"}}}, {"g": {}}]


def test_mixed_source_holds_both_shuffled_together_with_a_held_out_tail(records):
    """moragent.train_data="synthetic+bfcl_live": every generated record and the capped live sample,
    each converted once, in one seeded order (not source after source), the last heldout_examples held out."""
    from morse_jax.config.defaults import get_config
    from morse_jax.run.agent_training import training_trajectories
    from morse_jax.tasks.bfcl.synthetic import generate

    c = get_config()
    c.system = "moragent"
    m = c.moragent
    m.train_data, m.synthetic_examples, m.live_examples, m.heldout_examples = "synthetic+bfcl_live", 40, 30, 10
    train, held = training_trajectories(c)
    assert (len(train), len(held)) == (60, 10)
    ids = [t.id for t in train + held]
    synthetic = {r["id"] for r in generate(40, seed=c.seed)}
    live_ids = {r["id"] for r in records[0]}
    assert len(set(ids)) == 70 and set(ids) >= synthetic
    assert len(set(ids) - synthetic) == 30 and set(ids) - synthetic <= live_ids
    # shuffled together: the first 40 are not the generated set, and both sources reach the held-out tail
    assert set(ids[:40]) != synthetic
    assert {t.id in synthetic for t in held} == {True, False}
    assert ids == [t.id for tr in training_trajectories(c) for t in tr]  # deterministic
