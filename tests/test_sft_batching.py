"""SFT batching: length buckets, padding, deterministic per-epoch order, counted drops."""

from __future__ import annotations

import numpy as np

from morse_jax.mor.batch import NO_ROLE
from morse_jax.sft.batching import BucketedData, bucket_length
from morse_jax.sft.data import Rendered
from sft_common import toy_examples

BUCKETS = (24, 32, 48)


def _long(n):
    return Rendered(np.arange(n, dtype=np.int32) % 7, np.zeros(n, np.int32), np.ones(n, bool))


def test_bucket_length_is_the_smallest_that_holds():
    assert [bucket_length(n, BUCKETS) for n in (1, 24, 25, 32, 33, 48, 49)] == [24, 24, 32, 32, 48, 48, None]


def test_every_kept_example_once_per_epoch_padded_to_its_bucket():
    ex = toy_examples(23, seed=0)
    data = BucketedData(ex, BUCKETS)
    assert data.dropped == 0 and data.kept == tuple(range(23))
    micro, accum = 2, 2
    for epoch in range(2):
        seen = []
        plan = data.epoch_plan(micro * accum, seed=5, epoch=epoch)
        assert len(plan) == data.steps_per_epoch(micro * accum)
        for step in plan:
            b = data.batch(step, micro, accum)
            assert b.tokens.shape == (accum, micro, step.length)
            flat = {k: np.asarray(getattr(b, k)).reshape(micro * accum, -1)
                    for k in ("tokens", "role_ids", "loss_mask", "valid", "positions", "segment_ids")}
            for r in range(micro * accum):
                if r >= len(step.rows):  # padding row: nothing valid, no target, no role
                    assert not flat["valid"][r].any() and not flat["loss_mask"][r].any()
                    assert (flat["role_ids"][r] == NO_ROLE).all()
                    continue
                e = ex[step.rows[r]]
                n = len(e.tokens)
                assert step.length == min(x for x in BUCKETS if x >= n)  # the smallest bucket that holds it
                assert (flat["tokens"][r, :n] == e.tokens).all() and (flat["role_ids"][r, :n] == e.role_ids).all()
                assert (flat["loss_mask"][r, :n] == e.loss_mask).all() and not flat["loss_mask"][r, n:].any()
                assert flat["valid"][r, :n].all() and not flat["valid"][r, n:].any()
                assert (flat["role_ids"][r, n:] == NO_ROLE).all()
                assert (flat["positions"][r] == np.arange(step.length)).all() and not flat["segment_ids"][r].any()
            seen += step.rows
        assert sorted(seen) == list(range(23))


def test_order_is_a_function_of_seed_and_epoch():
    data = BucketedData(toy_examples(40, seed=1), BUCKETS)
    a = data.epoch_plan(4, seed=3, epoch=0)
    assert a == data.epoch_plan(4, seed=3, epoch=0)
    assert a != data.epoch_plan(4, seed=3, epoch=1) and a != data.epoch_plan(4, seed=4, epoch=0)
    assert len(a) == len(data.epoch_plan(4, seed=3, epoch=1))
    assert data.eval_plan(4) == data.eval_plan(4)  # held-out order is fixed


def test_too_long_and_targetless_examples_are_counted_not_silent():
    ex = toy_examples(5, seed=2)
    no_target = Rendered(ex[0].tokens, ex[0].role_ids, np.zeros_like(ex[0].loss_mask))
    only_first = Rendered(ex[1].tokens, ex[1].role_ids, np.eye(1, len(ex[1].tokens), dtype=bool)[0])
    data = BucketedData([*ex, _long(49), no_target, _long(100), only_first], BUCKETS)
    assert (data.too_long, data.no_target, data.dropped) == (2, 2, 4)
    assert data.kept == (0, 1, 2, 3, 4)
    assert data.describe_dropped() == ("4 of 9 examples dropped: 2 longer than 48 tokens (the largest length "
                                       "bucket), 2 without a target token")
    assert BucketedData(ex, BUCKETS).describe_dropped() == ""


def test_fingerprint_changes_with_the_data():
    ex = toy_examples(6, seed=3)
    a = BucketedData(ex, BUCKETS).fingerprint()
    assert a == BucketedData(toy_examples(6, seed=3), BUCKETS).fingerprint()
    assert a != BucketedData(ex[:5], BUCKETS).fingerprint() and a != BucketedData(ex, (48,)).fingerprint()
