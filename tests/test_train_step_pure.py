"""The pure update step (rl.update.train_step): same state and batch give the same result, it is
one AdamW step on the summed gradients, and accumulating micro-batches gives the gradient of the
summed per-example losses."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from morse_jax.models import ModelConfig, init_params
from morse_jax.models.transformer import split_segments
from morse_jax.mole.experts import ExpertBankSpec, execute_set
from morse_jax.rl.examples import RouteExample, SequenceExample
from morse_jax.rl.batch import SequenceBatch, pad_routes, pad_sequences
from morse_jax.rl.logprobs import sequence_logprobs
from morse_jax.rl.update import (TrainConfig, TrainState, UpdateBatch, init_trainable, make_optimizer,
                                 make_train_step, route_gradients)

CFG = ModelConfig(family="llama", vocab_size=32, hidden_size=32, intermediate_size=64, num_layers=3,
                  num_heads=4, num_kv_heads=2, head_dim=8)
SPEC = ExpertBankSpec(n_adapt=2)
TCFG = TrainConfig(lora_lr=0.05, router_lr=0.05, micro_batch=2, length_buckets=(16,), router_dim=8,
                   completion_buckets=None)
START = CFG.num_layers - SPEC.n_adapt


@pytest.fixture(scope="module")
def setup():
    params = init_params(jax.random.key(0), CFG)
    params["lm_head"] = params["lm_head"] * 10.0  # logits that depend on the hidden state
    frozen = split_segments(params, SPEC.n_adapt)
    trainable = init_trainable(jax.random.key(1), CFG, SPEC, TCFG)
    trainable["bank"]["b"] = jax.tree.map(lambda x: 0.1 * jax.random.normal(jax.random.key(2), x.shape),
                                          trainable["bank"]["b"])
    rng = np.random.default_rng(0)
    seqs = []
    for n, adv in enumerate((1.0, -0.5, 2.0, -1.5)):
        ids, ws = zip(*execute_set(SPEC, [n % 4, (n + 1) % 4]))
        c = 3 + n
        seqs.append(SequenceExample([1, 2, 3 + n], rng.integers(1, 32, c).tolist(),
                                    (-1.0 - rng.random(c)).astype(np.float32), ids, ws, adv))
    routes = [RouteExample([5, 6], (0, 1), -1.2, 0.7), RouteExample([7], (2, 3), -1.9, -0.7)]
    return frozen, trainable, seqs, routes


def _pad(seqs) -> SequenceBatch:
    return pad_sequences(seqs, rows=len(seqs), length_buckets=(16,), max_active=TCFG.max_active)


def _copy(tree):
    return jax.tree.map(jnp.copy, tree)  # the optimiser step donates its state


def test_train_step_is_pure(setup):
    frozen, trainable, seqs, routes = setup
    step = make_train_step(CFG, SPEC, TCFG, start_layer=START)
    batch = UpdateBatch(sequences=(_pad(seqs[:2]), _pad(seqs[2:])), routes=pad_routes(routes, rows=2, k=2),
                        reinforce=True)
    state = TrainState.create(trainable, make_optimizer(TCFG).init(trainable))
    out = [step(_copy(state), frozen, batch) for _ in range(2)]
    (s1, m1), (s2, m2) = out
    jax.tree.map(np.testing.assert_array_equal, s1, s2)
    assert m1.keys() == m2.keys()
    for k in m1:
        np.testing.assert_array_equal(m1[k], m2[k], err_msg=k)
    # it moved the params and left its input state alone
    assert any(not np.array_equal(a, b) for a, b in zip(jax.tree.leaves(s1.params), jax.tree.leaves(trainable)))
    assert step.compile_count == 3  # LoRA micro-batch, gradient sum, router + optimiser: once each


def test_train_step_is_one_optimiser_step_on_the_summed_gradients(setup):
    """The step equals AdamW applied once to (sum of the micro-batches' bank gradients, the
    router's gradient), each computed on its own at the input params."""
    frozen, trainable, seqs, routes = setup
    tcfg = TCFG
    step = make_train_step(CFG, SPEC, tcfg, start_layer=START)
    route_batch = pad_routes(routes, rows=2, k=2)
    tx = make_optimizer(tcfg)
    state = TrainState.create(trainable, tx.init(trainable))
    got, metrics = step(_copy(state), frozen, UpdateBatch(sequences=(_pad(seqs[:2]), _pad(seqs[2:])),
                                                          routes=route_batch, reinforce=False))

    bank = _reference_bank_grad(frozen, trainable["bank"], seqs)
    router, _ = jax.jit(functools.partial(route_gradients, cfg=tcfg, reinforce=False))(
        trainable["router"], frozen["embed"], route_batch)
    grads = {"bank": bank, "router": router}
    updates, _ = tx.update(grads, tx.init(trainable), trainable)
    want = optax.apply_updates(trainable, updates)
    for g, w in zip(jax.tree.leaves(got.params), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), atol=1e-5, rtol=1e-5)
    assert metrics["grad_norm"] == pytest.approx(float(optax.global_norm(grads)), rel=1e-4)
    assert int(got.opt_state.inner_states["lora"].inner_state[0].count) == 1


def _reference_bank_grad(frozen, bank, seqs):
    """d/d bank of sum_n L_n, each example's loss from its own one-row batch:
    L_n = -(1/|y_n|) sum_t min(r_t A_n, clip(r_t, 1-eps, 1+eps) A_n), r_t = exp(new_t - old_t)."""
    eps = TCFG.ppo_eps

    def total(bank):
        out = 0.0
        for e in seqs:
            b = _pad([e])
            p, c = len(e.prompt_ids), len(e.completion_ids)
            new = sequence_logprobs(frozen, CFG, SPEC, bank, b)[0, p - 1:p - 1 + c]
            r = jnp.exp(new - jnp.asarray(e.behaviour_logprobs))
            out = out - jnp.mean(jnp.minimum(r * e.advantage, jnp.clip(r, 1 - eps, 1 + eps) * e.advantage))
        return out

    return jax.jit(jax.grad(total))(bank)  # jitted: eager op-by-op backward is slow on CPU


def test_accumulated_micro_batches_equal_one_batch_and_the_summed_losses(setup):
    frozen, trainable, seqs, _ = setup
    step = make_train_step(CFG, SPEC, TCFG, start_layer=START)

    acc = None
    for micro in (_pad(seqs[:1]), _pad(seqs[1:3]), _pad(seqs[3:])):  # k = 3 micro-batches
        g, _ = step.lora(trainable, frozen, micro)
        acc = g if acc is None else step.add(acc, g)
    one, _ = step.lora(trainable, frozen, _pad(seqs))
    ref = _reference_bank_grad(frozen, trainable["bank"], seqs)
    for got, big, want in zip(jax.tree.leaves(acc), jax.tree.leaves(one), jax.tree.leaves(ref)):
        scale = float(np.abs(want).max())
        assert scale > 0
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5 * scale, rtol=1e-4)
        np.testing.assert_allclose(np.asarray(big), np.asarray(want), atol=1e-5 * scale, rtol=1e-4)
