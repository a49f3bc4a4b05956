"""The SFT step and trainer: accumulation equals one batch, warmup + cosine, purity, frozen backbone,
held-out CE per role drops on a learnable toy set, exact resume after a kill."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from morse_jax.mor.batch import SFTBatch
from morse_jax.run.metrics_log import MetricsWriter
from morse_jax.sft.batching import BucketedData, StepPlan
from morse_jax.sft.config import SFTConfig
from morse_jax.sft.state import SFTState, lr_schedule, make_optimizer
from morse_jax.sft.step import accumulate_gradients, make_train_step
from morse_jax.sft.trainer import EVAL_KIND, TRAIN_KIND, SFTTrainer
from morse_jax.tasks.trajectories import ROLE_NAMES
import sft_common as common

BUCKETS = (48,)  # one shape: one compile (trainer tests; bucketing is test_sft_batching's)


def _bits(tree):
    return [np.asarray(jax.random.key_data(x) if jnp.issubdtype(x.dtype, jax.dtypes.prng_key) else x).tobytes()
            for x in jax.tree.leaves(tree)]


def test_lr_schedule_is_linear_warmup_then_cosine():
    cfg = SFTConfig(learning_rate=1e-3, warmup_fraction=0.1, final_lr_fraction=0.1)
    total = 50
    f = lr_schedule(cfg, total)
    w = 5  # 10 % of 50
    for s in range(total + 1):
        if s < w:
            want = 1e-3 * s / w
        else:
            want = 1e-4 + (1e-3 - 1e-4) * 0.5 * (1 + math.cos(math.pi * (s - w) / (total - w)))
        assert float(f(s)) == pytest.approx(want, rel=1e-5, abs=1e-9), s


def test_accumulated_gradient_is_the_gradient_of_the_token_mean_over_all_rows():
    """Two micro-batches of 2 rows (different target counts) give the gradient and metrics of one
    batch of the 4 rows, whose loss is the mean CE over all their target tokens."""
    frozen, loss_fn = common.backbone(), common.objective()
    params = common.trainable(b_scale=0.1)
    data = BucketedData(common.toy_examples(4, seed=7), (48,))
    step = StepPlan(48, (0, 1, 2, 3))
    two = data.batch(step, 2, 2)
    one = data.batch(step, 4)
    assert len({int(np.asarray(two.loss_mask[m]).sum()) for m in range(2)}) == 2  # unequal weights matter
    g, m = jax.jit(lambda p, f, b: accumulate_gradients(p, f, b, loss_fn=loss_fn))(params, frozen, two)
    (loss_ref, m_ref), g_ref = jax.jit(jax.value_and_grad(loss_fn, has_aux=True))(params, frozen, one)
    for x, y in zip(jax.tree.leaves(g), jax.tree.leaves(g_ref)):
        np.testing.assert_allclose(x, y, rtol=1e-4, atol=1e-6)  # float32 sums in another order
    assert float(m["loss"]) == pytest.approx(float(loss_ref), rel=1e-6)
    for r in ROLE_NAMES:
        assert float(m[f"ce/{r}"]) == pytest.approx(float(m_ref[f"ce/{r}"]), rel=1e-6)
        assert float(m[f"tokens/{r}"]) == float(m_ref[f"tokens/{r}"])


def test_train_step_is_pure_and_touches_only_the_adapter():
    frozen, loss_fn = common.backbone(), common.objective()
    frozen_before = _bits(frozen)
    cfg = SFTConfig(learning_rate=1e-2, warmup_fraction=0.0)
    tx = make_optimizer(cfg, 10)
    data = BucketedData(common.toy_examples(8, seed=3), BUCKETS)
    plan = data.epoch_plan(4, seed=0, epoch=0)
    step = make_train_step(loss_fn, tx, lr_schedule(cfg, 10))
    init = common.trainable()

    def run():
        state = SFTState.create(jax.tree.map(jnp.copy, init), tx, jax.random.key(0))
        ms = []
        for p in plan:
            state, m = step(state, frozen, data.batch(p, 2, 2))
            ms.append(jax.device_get(m))
        return state, ms

    (s1, m1), (s2, m2) = run(), run()
    assert _bits(s1) == _bits(s2) and _bits(m1) == _bits(m2)  # same inputs, same bits
    assert _bits(frozen) == frozen_before  # the backbone is bitwise unchanged
    assert int(s1.step) == len(plan) >= 2
    for t in init["a"]:  # every adapter leaf moved (B from step 1, A once B is non-zero)
        assert not np.array_equal(s1.params["a"][t], init["a"][t]) and not np.array_equal(s1.params["b"][t],
                                                                                          init["b"][t])


def _fit(workdir, *, epochs=3, on_step=None, seed_data=0, sink=True):
    frozen = common.backbone()
    cfg = SFTConfig(learning_rate=2e-2, warmup_fraction=0.1, epochs=epochs, micro_batch=2, accum_steps=2,
                    length_buckets=BUCKETS, checkpoint_every=2, eval_every=3)
    writer = MetricsWriter(workdir, tensorboard=False) if sink else None
    trainer = SFTTrainer(cfg, common.objective(), frozen, workdir=workdir, sink=writer, progress=False)
    train = BucketedData(common.toy_examples(24, seed=seed_data), BUCKETS)
    held = BucketedData(common.toy_examples(12, seed=100), BUCKETS)
    res = trainer.fit(common.trainable(), train, held, on_step=on_step)
    return res, writer, frozen


def test_fit_lowers_held_out_ce_of_every_role(tmp_path):
    """The fast figure: a toy multi-role set (per-role rules), plain LoRA on a tiny random model."""
    res, writer, _ = _fit(tmp_path, epochs=4)
    evals = writer.read(EVAL_KIND)
    first, last = evals[0], evals[-1]
    assert first["step"] == 0 and last["step"] == res.total_steps
    for r in ROLE_NAMES:
        assert last[f"ce/{r}"] < 0.8 * first[f"ce/{r}"], (r, first[f"ce/{r}"], last[f"ce/{r}"])
    assert len(writer.read(TRAIN_KIND)) == res.total_steps


class Killed(Exception):
    pass


def test_resume_after_a_kill_is_bitwise_exact(tmp_path):
    full, w_full, _ = _fit(tmp_path / "full")

    def kill(step, _):
        if step == 5:  # checkpoints at 2 and 4 (and each epoch's end): resume re-does step 5
            raise Killed

    with pytest.raises(Killed):
        _fit(tmp_path / "cut", on_step=kill)
    resumed, w_cut, _ = _fit(tmp_path / "cut")
    assert resumed.resumed_from == 4
    assert _bits(resumed.state) == _bits(full.state)  # step, params, optimiser state, PRNG key
    for kind in (TRAIN_KIND, EVAL_KIND, "sft_data"):
        assert w_cut.read(kind) == w_full.read(kind), kind


def test_resuming_with_other_data_is_an_error(tmp_path):
    _fit(tmp_path, epochs=1, sink=False)
    with pytest.raises(ValueError, match="other data or settings.*data:"):
        _fit(tmp_path, epochs=1, seed_data=1, sink=False)
