"""Frozen-prefix states in SFT: with an adapter on the last layers only, the layers below run once per
example and the steps start from their output. The reference is always the full forward (every
layer run on the tokens): the loss, the gradient and a whole fit must agree with it."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from morse_jax.models import ModelConfig
from morse_jax.models.transformer import forward
from morse_jax.mor.config import MoRConfig
from morse_jax.mor.objective import first_adapted_layer, frozen_prefix, sft_loss
from morse_jax.sft.batching import BucketedData, StepPlan
from morse_jax.sft.config import SFTConfig
from morse_jax.sft.trainer import SFTTrainer
import sft_common as common

CFG = ModelConfig(family="llama", vocab_size=common.VOCAB, hidden_size=32, intermediate_size=64, num_layers=4,
                  num_heads=4, num_kv_heads=2, head_dim=8)
MOR = MoRConfig(routed=(2, 2, 2), top_k=(1, 1, 1), rank=4, n_adapt=2)  # layers 2 and 3 adapted
BUCKETS = (48,)


def _frozen():
    return common.backbone(cfg=CFG, mor=MOR)


def _trainable(b_scale=0.3):
    return common.trainable(b_scale=b_scale, cfg=CFG, mor=MOR)


LOSS = functools.partial(sft_loss, model_cfg=CFG, mor_cfg=MOR)
PREFIX = functools.partial(frozen_prefix, model_cfg=CFG, mor_cfg=MOR)


def test_prefix_is_the_residual_entering_the_first_adapted_layer():
    frozen = _frozen()
    data = BucketedData(common.toy_examples(3, seed=3), BUCKETS)
    batch = data.batch(StepPlan(48, (0, 1, 2)), 4)
    assert first_adapted_layer(CFG, MOR) == 2
    got = PREFIX(frozen, batch)
    want, _ = forward(frozen, CFG, batch.tokens, positions=batch.positions, valid=batch.valid, stop_layer=2)
    assert got.shape == (4, 48, CFG.hidden_size)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    every = MoRConfig(routed=(2, 2, 2), top_k=(1, 1, 1), rank=4, n_adapt=None)
    with pytest.raises(ValueError, match="every layer"):
        frozen_prefix(frozen, batch, CFG, every)


def test_loss_metrics_and_gradient_from_prefix_states_equal_the_full_forward():
    frozen, params = _frozen(), _trainable()
    data = BucketedData(common.toy_examples(5, seed=4), BUCKETS)
    plan = StepPlan(48, (4, 0, 2))  # three rows and a padding row
    full = data.batch(plan, 4)
    data.compute_prefix_states(jax.jit(lambda b: PREFIX(frozen, b)), rows=2)
    cached = data.batch(plan, 4)
    assert full.prefix_hidden is None and cached.prefix_hidden.shape == (4, 48, CFG.hidden_size)
    grad = jax.jit(jax.value_and_grad(LOSS, has_aux=True))
    (l_full, m_full), g_full = grad(params, frozen, full)
    (l_cached, m_cached), g_cached = grad(params, frozen, cached)
    np.testing.assert_allclose(float(l_cached), float(l_full), rtol=1e-5)
    for k in m_full:
        np.testing.assert_allclose(np.asarray(m_cached[k]), np.asarray(m_full[k]), rtol=1e-4, atol=1e-6, err_msg=k)
    for a, b in zip(jax.tree.leaves(g_cached), jax.tree.leaves(g_full)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-6)
    assert max(float(jnp.max(jnp.abs(x))) for x in jax.tree.leaves(g_full)) > 0  # a real gradient


def test_states_are_computed_once_per_example_and_batched_with_zeros_at_padding():
    """A stand-in compute (hidden = token id + 0.5 in every feature) shows where each example's
    states land in a shuffled, accumulated step layout."""
    examples = common.toy_examples(7, seed=5)
    data = BucketedData(examples, BUCKETS)
    calls = []

    def compute(batch):
        calls.append(batch.tokens.shape)
        return np.repeat(np.asarray(batch.tokens, np.float32)[..., None] + 0.5, 3, axis=-1)

    nbytes = data.compute_prefix_states(compute, rows=3)
    assert calls == [(3, 48)] * 3  # 7 examples in rows of 3
    assert nbytes == sum(len(e.tokens) for e in examples) * 3 * 4
    assert data.compute_prefix_states(compute, rows=3) == nbytes and len(calls) == 3  # kept, not recomputed
    plan = data.epoch_plan(4, seed=0, epoch=1)[0]
    b = data.batch(plan, 2, 2)
    hidden, tokens, valid = (np.asarray(x).reshape(4, 48, *np.shape(x)[3:])
                             for x in (b.prefix_hidden, b.tokens, b.valid))
    assert b.prefix_hidden.shape == (2, 2, 48, 3)
    np.testing.assert_array_equal(hidden[..., 0], np.where(valid, tokens + 0.5, 0.0))


@pytest.mark.slow
def test_a_fit_from_prefix_states_matches_a_fit_of_every_layer(tmp_path):
    """Two epochs (the second reuses the states) with held-out evaluations: the same adapter
    weights and held-out CE as the trainer running every layer (up to float rounding)."""
    frozen = _frozen()
    cfg = SFTConfig(learning_rate=3e-3, epochs=2, micro_batch=2, accum_steps=2, length_buckets=BUCKETS, seed=0)
    results = []
    for prefix_fn in (None, PREFIX):
        train = BucketedData(common.toy_examples(12, seed=6), BUCKETS)
        held = BucketedData(common.toy_examples(4, seed=7), BUCKETS)
        trainer = SFTTrainer(cfg, LOSS, frozen, progress=False, prefix_fn=prefix_fn)
        results.append(trainer.fit(_trainable(b_scale=0.0), train, held))
        assert (train.prefix_states is None) == (prefix_fn is None)
    full, cached = results
    for a, b in zip(jax.tree.leaves(cached.state.params), jax.tree.leaves(full.state.params)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-3, atol=1e-5)
    assert cached.last_eval["ce"] == pytest.approx(full.last_eval["ce"], rel=1e-4)
    assert max(float(jnp.max(jnp.abs(b))) for b in full.state.params["b"].values()) > 1e-4  # it trained
