"""The SFT objective's LM head at target positions only (``SFTBatch.logit_index``).

The reference is the objective with the head at every position (``BucketedData(...,
gather_targets=False)``): loss, metrics, gradient and a short fit must agree; and the index
itself is checked against the definition (position t is listed when token t + 1 is a target).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from morse_jax.models import ModelConfig
from morse_jax.mor.config import MoRConfig
from morse_jax.mor.objective import frozen_prefix, sft_loss
from morse_jax.sft.batching import TARGET_COLUMNS_MULTIPLE, BucketedData, StepPlan
from morse_jax.sft.config import SFTConfig
from morse_jax.sft.trainer import SFTTrainer
import sft_common as common

CFG = ModelConfig(family="llama", vocab_size=common.VOCAB, hidden_size=32, intermediate_size=64, num_layers=4,
                  num_heads=4, num_kv_heads=2, head_dim=8)
MOR = MoRConfig(routed=(2, 2, 2), top_k=(1, 1, 1), rank=4, n_adapt=2)
BUCKETS = (40, 48, 128)
LOSS = functools.partial(sft_loss, model_cfg=CFG, mor_cfg=MOR)


def _frozen():
    return common.backbone(cfg=CFG, mor=MOR)


def _trainable(b_scale=0.3):
    return common.trainable(b_scale=b_scale, cfg=CFG, mor=MOR)


def test_logit_index_lists_the_positions_that_predict_a_target():
    examples = common.toy_examples(9, seed=11, max_len=20)
    data = BucketedData(examples, BUCKETS)
    for length, C in data.target_columns.items():
        members = [i for i in data.kept if len(examples[i].tokens) <= length
                   and not any(len(examples[i].tokens) <= b for b in BUCKETS if b < length)]
        most = max(int(np.sum(examples[i].loss_mask[1:])) for i in members)
        assert most <= C < length and (C % TARGET_COLUMNS_MULTIPLE == 0 or C == length - 1)
    plan = data.epoch_plan(4, seed=0, epoch=0)[0]
    b = data.batch(plan, 2, 2)  # [accum, micro, ...]
    C = data.target_columns[plan.length]
    assert b.logit_index.shape == b.logit_mask.shape == (2, 2, C)
    index, mask = np.asarray(b.logit_index).reshape(4, C), np.asarray(b.logit_mask).reshape(4, C)
    for r in range(4):
        if r >= len(plan.rows):
            assert not mask[r].any()
            continue
        ex = examples[plan.rows[r]]
        want = [t for t in range(len(ex.tokens) - 1) if ex.loss_mask[t + 1]]
        assert index[r][mask[r]].tolist() == want
        assert set(index[r][~mask[r]].tolist()) <= {want[-1]}  # padding repeats a real position
    assert BucketedData(examples, BUCKETS, gather_targets=False).batch(plan, 4).logit_index is None


@pytest.mark.parametrize("prefix", [False, True])
def test_loss_metrics_and_gradient_equal_the_head_at_every_position(prefix):
    frozen, params = _frozen(), _trainable()
    examples = common.toy_examples(5, seed=4, max_len=12)
    plan = StepPlan(48, (4, 0, 2))  # three rows and a padding row
    batches = []
    for gather in (False, True):
        data = BucketedData(examples, (48,), gather_targets=gather)
        if prefix:
            data.compute_prefix_states(jax.jit(lambda b: frozen_prefix(frozen, b, CFG, MOR)), rows=2)
        batches.append(data.batch(plan, 4))
    every, gathered = batches
    assert every.logit_index is None and gathered.logit_index.shape[1] < 48
    grad = jax.jit(jax.value_and_grad(LOSS, has_aux=True))
    (l_every, m_every), g_every = grad(params, frozen, every)
    (l_gath, m_gath), g_gath = grad(params, frozen, gathered)
    np.testing.assert_allclose(float(l_gath), float(l_every), rtol=1e-5)
    assert set(m_gath) == set(m_every)
    for k in m_every:
        np.testing.assert_allclose(np.asarray(m_gath[k]), np.asarray(m_every[k]), rtol=1e-5, atol=1e-6, err_msg=k)
    for a, b in zip(jax.tree.leaves(g_gath), jax.tree.leaves(g_every)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-6)
    assert float(m_every["tokens"]) > 0 and max(float(jnp.max(jnp.abs(x))) for x in jax.tree.leaves(g_every)) > 0


def test_a_fit_with_the_gathered_head_matches_one_with_the_head_everywhere():
    """One epoch of accumulated steps (the [accum, micro, C] layout through the step's scan) and a
    held-out evaluation."""
    frozen = _frozen()
    cfg = SFTConfig(learning_rate=3e-3, epochs=1, micro_batch=2, accum_steps=2, length_buckets=(48,), seed=0)
    results = []
    for gather in (False, True):
        train = BucketedData(common.toy_examples(8, seed=6), (48,), gather_targets=gather)
        held = BucketedData(common.toy_examples(3, seed=7), (48,), gather_targets=gather)
        results.append(SFTTrainer(cfg, LOSS, frozen, progress=False).fit(_trainable(b_scale=0.0), train, held))
    every, gathered = results
    for a, b in zip(jax.tree.leaves(gathered.state.params), jax.tree.leaves(every.state.params)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-3, atol=1e-5)
    assert gathered.last_eval["ce"] == pytest.approx(every.last_eval["ce"], rel=1e-4)
    assert max(float(jnp.max(jnp.abs(b))) for b in every.state.params["b"].values()) > 1e-4  # it trained
