"""The SFT step and trainer: accumulation equals one batch, warmup + cosine, purity, frozen backbone,
held-out CE per role drops on a learnable toy set, exact resume after a kill."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from morse_jax.run.metrics_log import MetricsWriter
from morse_jax.mor.losses import role_ce
from morse_jax.sft.batching import BucketedData, StepPlan
from morse_jax.sft.config import SFTConfig
from morse_jax.sft.state import SFTState, lr_schedule, make_optimizer
from morse_jax.sft.step import accumulate_gradients
from morse_jax.sft.trainer import EVAL_KIND, TRAIN_KIND, SFTTrainer, compiled_train_step
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


def _bigram_ce(params, frozen, batch):
    """A cheap token-mean objective (the accumulation is objective-independent): next-token logits
    from a trainable bigram table plus a frozen bias, role-masked CE."""
    logits = params["w"][batch.tokens] + frozen["bias"]
    return role_ce(logits, batch.tokens, batch.loss_mask & batch.valid, batch.role_ids, ROLE_NAMES)


def test_accumulated_gradient_is_the_gradient_of_the_token_mean_over_all_rows():
    """Two micro-batches of 2 rows (different target counts) give the gradient and metrics of one
    batch of the 4 rows, whose loss is the mean CE over all their target tokens."""
    V = common.VOCAB
    params = {"w": jax.random.normal(jax.random.key(0), (V, V))}
    frozen = {"bias": jax.random.normal(jax.random.key(1), (V,))}
    data = BucketedData(common.toy_examples(4, seed=7), (48,))
    step = StepPlan(48, (0, 1, 2, 3))
    two = data.batch(step, 2, 2)
    one = data.batch(step, 4)
    assert len({int(np.asarray(two.loss_mask[m]).sum()) for m in range(2)}) == 2  # unequal weights matter
    g, m = jax.jit(lambda p, f, b: accumulate_gradients(p, f, b, loss_fn=_bigram_ce))(params, frozen, two)
    # the reference, from the definition: mean NLL over every target token of the 4 rows
    logp = jax.nn.log_softmax(params["w"][one.tokens[:, :-1]] + frozen["bias"], axis=-1)
    nll = -np.take_along_axis(np.asarray(logp), np.asarray(one.tokens[:, 1:])[..., None], -1)[..., 0]
    tgt = np.asarray(one.loss_mask[:, 1:] & one.valid[:, 1:])
    loss_ref = nll[tgt].mean()
    g_ref = jax.grad(lambda p: _bigram_ce(p, frozen, one)[0])(params)
    np.testing.assert_allclose(g["w"], g_ref["w"], rtol=1e-5, atol=1e-7)
    assert float(m["loss"]) == pytest.approx(loss_ref, rel=1e-6)
    for i, r in enumerate(ROLE_NAMES):
        sel = tgt & (np.asarray(one.role_ids[:, 1:]) == i)
        assert float(m[f"ce/{r}"]) == pytest.approx(nll[sel].mean(), rel=1e-6)
        assert float(m[f"tokens/{r}"]) == sel.sum()


# One config and data size for every trainer test: the jitted step is cached per (objective, config,
# total steps), so they share one compile.
TCFG = SFTConfig(learning_rate=2e-2, warmup_fraction=0.1, epochs=3, micro_batch=2, accum_steps=2,
                 length_buckets=BUCKETS, eval_every=4)  # checkpoints at each epoch's end (6 steps)
N_TRAIN = 24


def test_train_step_is_pure_and_touches_only_the_adapter():
    frozen, loss_fn = common.backbone(), common.objective()
    frozen_before = _bits(frozen)
    data = BucketedData(common.toy_examples(N_TRAIN, seed=0), BUCKETS)
    plan = data.epoch_plan(TCFG.rows_per_step, seed=0, epoch=0)[:3]
    total = TCFG.epochs * data.steps_per_epoch(TCFG.rows_per_step)
    step = compiled_train_step(loss_fn, TCFG, total)
    tx = make_optimizer(TCFG, total)
    init = common.trainable()

    def run():
        state = SFTState.create(jax.tree.map(jnp.copy, init), tx, jax.random.key(0))
        ms = []
        for p in plan:
            state, m = step(state, frozen, data.batch(p, TCFG.micro_batch, TCFG.accum_steps))
            ms.append(jax.device_get(m))
        return state, ms

    (s1, m1), (s2, m2) = run(), run()
    assert _bits(s1) == _bits(s2) and _bits(m1) == _bits(m2)  # same inputs, same bits
    assert _bits(frozen) == frozen_before  # the backbone is bitwise unchanged
    assert int(s1.step) == len(plan)
    moved = jax.tree.map(lambda a, b: not np.array_equal(a, b), s1.params, init)
    assert all(jax.tree.leaves(moved)), moved  # every adapter leaf (B from step 1; A, routers once B != 0)


def _fit(workdir, *, on_step=None, seed_data=0, sink=True):
    frozen = common.backbone()
    writer = MetricsWriter(workdir, tensorboard=False) if sink else None
    trainer = SFTTrainer(TCFG, common.objective(), frozen, workdir=workdir, sink=writer, progress=False)
    train = BucketedData(common.toy_examples(N_TRAIN, seed=seed_data), BUCKETS)
    held = BucketedData(common.toy_examples(12, seed=100), BUCKETS)
    res = trainer.fit(common.trainable(), train, held, on_step=on_step)
    return res, writer, frozen


def test_fit_lowers_held_out_ce_of_every_role(tmp_path):
    """The fast figure: a toy multi-role set (per-role rules), plain LoRA on a tiny random model."""
    res, writer, _ = _fit(tmp_path)
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
        if step == 8:  # checkpoints at 6, 12, 18: resume re-does steps 7 and 8
            raise Killed

    with pytest.raises(Killed):
        _fit(tmp_path / "cut", on_step=kill)
    resumed, w_cut, _ = _fit(tmp_path / "cut")
    assert resumed.resumed_from == 6
    assert _bits(resumed.state) == _bits(full.state)  # step, params, optimiser state, PRNG key
    for kind in (TRAIN_KIND, EVAL_KIND, "sft_data"):
        assert w_cut.read(kind) == w_full.read(kind), kind


def test_resuming_with_other_data_is_an_error(tmp_path):
    def kill(step, _):
        if step == 6:  # after the checkpoint at step 6
            raise Killed

    with pytest.raises(Killed):
        _fit(tmp_path, sink=False, on_step=kill)
    with pytest.raises(ValueError, match="other data or settings.*data:"):
        _fit(tmp_path, seed_data=1, sink=False)
