"""Tests for morse_jax.rl.losses against direct numpy references."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from morse_jax.rl.losses import (kl_to_base, masked_sequence_mean, ppo_clip_token_loss,
                                 prototype_orthogonality, router_loss, routing_entropy)

EPS = 0.2


def _batch(seed=0, n=3, t=6, spread=0.1):
    rng = np.random.default_rng(seed)
    old = np.log(rng.uniform(0.05, 0.9, size=(n, t))).astype(np.float32)
    new = (old + rng.uniform(-spread, spread, size=(n, t))).astype(np.float32)
    mask = np.ones((n, t), np.float32)
    mask[0, 4:] = 0  # shorter first sequence
    mask[1, :2] = 0  # prompt positions
    adv = rng.normal(size=n).astype(np.float32)
    return new, old, mask, adv


def ref_ppo(new, old, mask, adv, eps=EPS, eps_high=None):
    eps_high = eps if eps_high is None else eps_high
    r = np.exp(new.astype(np.float64) - old)
    a = adv[:, None].astype(np.float64)
    surr = np.minimum(r * a, np.clip(r, 1 - eps, 1 + eps_high) * a)
    per_seq = (surr * mask).sum(1) / np.maximum(mask.sum(1), 1)
    clipped = ((r > 1 + eps_high) & (a > 0)) | ((r < 1 - eps) & (a < 0))
    tok = mask.sum()
    # approx_kl has its own test from the definition of KL (test_approx_kl_is_kl_old_to_new)
    return -per_seq.sum(), {
        "clip_fraction": (clipped * mask).sum() / tok,
        "ratio_mean": (r * mask).sum() / tok,
    }


def test_ppo_unclipped_equals_advantage_weighted_ratio():
    new, old, mask, adv = _batch(spread=0.1)  # |log r| < 0.1 -> inside [0.8, 1.2]
    loss, metrics = ppo_clip_token_loss(new, old, mask, adv, eps=EPS)
    r = np.exp(new.astype(np.float64) - old)
    direct = -sum((adv[n] * r[n] * mask[n]).sum() / mask[n].sum() for n in range(3))
    assert float(loss) == pytest.approx(direct, rel=1e-5)
    assert float(metrics["clip_fraction"]) == 0.0
    # At ratio 1 the loss is -sum(A): each sequence counts once, whatever its length.
    loss1, m1 = ppo_clip_token_loss(old, old, mask, adv)
    assert float(loss1) == pytest.approx(-adv.astype(np.float64).sum(), abs=1e-6)
    assert float(m1["approx_kl"]) == pytest.approx(0.0, abs=1e-7)
    assert float(m1["ratio_mean"]) == pytest.approx(1.0, abs=1e-6)


@pytest.mark.parametrize("eps_high", [None, 0.28])
def test_ppo_matches_numpy_with_clipping(eps_high):
    new, old, mask, adv = _batch(seed=1, spread=0.6)
    loss, metrics = ppo_clip_token_loss(new, old, mask, adv, eps=EPS, eps_high=eps_high)
    ref_loss, ref_metrics = ref_ppo(new, old, mask, adv, eps_high=eps_high)
    assert float(loss) == pytest.approx(ref_loss, rel=1e-5, abs=1e-6)
    for k, v in ref_metrics.items():
        assert float(metrics[k]) == pytest.approx(v, rel=1e-4, abs=1e-6), k
    assert 0 < float(metrics["clip_fraction"]) < 1


def test_ppo_gradient_zero_exactly_on_clipped_tokens():
    old = np.zeros((2, 4), np.float32)
    log_r = np.log(np.array([[1.5, 1.1, 0.5, 0.9],     # A > 0: clip only above 1+eps
                             [1.5, 1.1, 0.5, 0.9]],    # A < 0: clip only below 1-eps
                            np.float32))
    new = old + log_r
    mask = np.ones_like(old)
    adv = np.array([2.0, -3.0], np.float32)
    grad = jax.grad(lambda x: ppo_clip_token_loss(x, old, mask, adv)[0])(jnp.asarray(new))
    grad = np.asarray(grad)
    clipped = np.array([[True, False, False, False], [False, False, True, False]])
    assert np.all(grad[clipped] == 0)
    # Elsewhere d/dlogp of -A r / T is -A r / T (T = 4 tokens per sequence).
    expected = -adv[:, None] * np.exp(log_r) / 4
    np.testing.assert_allclose(grad[~clipped], expected[~clipped], rtol=1e-5)
    _, metrics = ppo_clip_token_loss(new, old, mask, adv)
    assert float(metrics["clip_fraction"]) == pytest.approx(2 / 8)


def test_approx_kl_is_kl_old_to_new():
    """The tokens were sampled from the old policy q; approx_kl must estimate KL(q || p_new) =
    sum_i q_i log(q_i / p_i). With q = (1/2, 1/4, 1/4) the four tokens [0, 0, 1, 2] are exactly
    q's frequencies, so the token mean of an unbiased estimator equals the expectation under q."""
    q = np.array([0.5, 0.25, 0.25])
    p = np.array([0.1, 0.6, 0.3])
    tokens = np.array([0, 0, 1, 2])
    old = np.log(q[tokens])[None].astype(np.float32)
    new = np.log(p[tokens])[None].astype(np.float32)
    _, metrics = ppo_clip_token_loss(new, old, np.ones_like(old), np.zeros(1, np.float32))
    kl_old_new = float(np.sum(q * np.log(q / p)))
    kl_new_old = float(np.sum(p * np.log(p / q)))
    assert abs(kl_old_new - kl_new_old) > 0.1  # the two directions differ here
    assert float(metrics["approx_kl"]) == pytest.approx(kl_old_new, rel=1e-5)
    # Monte Carlo from the same definition: tokens drawn from q, the mean tends to KL(q || p).
    draws = np.random.default_rng(0).choice(3, size=20000, p=q)
    _, mc = ppo_clip_token_loss(np.log(p[draws])[None].astype(np.float32),
                                np.log(q[draws])[None].astype(np.float32),
                                np.ones((1, draws.size), np.float32), np.zeros(1, np.float32))
    assert float(mc["approx_kl"]) == pytest.approx(kl_old_new, abs=0.02)


def test_loss_normalisation_by_hand():
    """Eq. 7's per-candidate term under both aggregations, computed by hand.

    Sequence 0 (A = 2) has ratios (1.1, 0.9); sequence 1 (A = -2) has ratios (1.0, 1.05, 0.95) after
    one prompt position; no ratio leaves [0.8, 1.2], so every surrogate is r * A.
      sequence_mean: -[2 * (1.1 + 0.9) / 2 + (-2) * (1.0 + 1.05 + 0.95) / 3] = -(2 - 2) = 0
      sequence_sum:  -[2 * (1.1 + 0.9) + (-2) * (1.0 + 1.05 + 0.95)]       = -(4 - 6) = 2
    d loss / d new_logp[n, t] = -A_n r_t / |y_n| (mean) or -A_n r_t (sum).
    """
    r = np.array([[1.1, 0.9, 1.0, 1.0], [1.0, 1.0, 1.05, 0.95]])
    mask = np.array([[1, 1, 0, 0], [0, 1, 1, 1]], np.float32)
    old = np.zeros((2, 4), np.float32)
    new = np.log(r).astype(np.float32)
    adv = np.array([2.0, -2.0], np.float32)
    lengths = np.array([[2.0], [3.0]])
    for norm, want, scale in (("sequence_mean", 0.0, 1 / lengths), ("sequence_sum", 2.0, np.ones((2, 1)))):
        loss, grad = jax.value_and_grad(
            lambda x: ppo_clip_token_loss(x, old, mask, adv, normalisation=norm)[0])(jnp.asarray(new))
        assert float(loss) == pytest.approx(want, abs=1e-6), norm
        np.testing.assert_allclose(np.asarray(grad), -adv[:, None] * r * scale * mask, rtol=1e-5, atol=1e-7)
    with pytest.raises(ValueError, match="normalisation"):
        ppo_clip_token_loss(new, old, mask, adv, normalisation="token_mean")


def test_ppo_respects_mask():
    new, old, mask, adv = _batch(seed=2, spread=0.5)
    f = jax.jit(jax.value_and_grad(lambda x, o: ppo_clip_token_loss(x, o, mask, adv)[0]))
    loss, grad = f(jnp.asarray(new), jnp.asarray(old))
    junk_new, junk_old = new.copy(), old.copy()
    junk_new[mask == 0] = 7.0
    junk_old[mask == 0] = -9.0
    loss2, grad2 = f(jnp.asarray(junk_new), jnp.asarray(junk_old))
    assert float(loss2) == pytest.approx(float(loss), rel=1e-6)
    assert np.all(np.asarray(grad)[mask == 0] == 0)
    np.testing.assert_allclose(np.asarray(grad2), np.asarray(grad), rtol=1e-6)
    _, m2 = ppo_clip_token_loss(junk_new, junk_old, mask, adv)
    _, m1 = ppo_clip_token_loss(new, old, mask, adv)
    for k in m1:
        assert float(m2[k]) == pytest.approx(float(m1[k]), rel=1e-6)
    # A sequence without generated tokens contributes nothing.
    empty = mask.copy()
    empty[2] = 0
    l_empty, _ = ppo_clip_token_loss(new, old, empty, adv)
    l_two, _ = ppo_clip_token_loss(new[:2], old[:2], mask[:2], adv[:2])
    assert float(l_empty) == pytest.approx(float(l_two), rel=1e-6)


def test_ppo_zero_advantage_and_old_logp_get_no_gradient():
    new, old, mask, _ = _batch(seed=3)
    adv = np.zeros(3, np.float32)
    g_new, g_old, g_adv = jax.grad(
        lambda x, o, a: ppo_clip_token_loss(x, o, mask, a)[0], argnums=(0, 1, 2))(
            jnp.asarray(new), jnp.asarray(old), jnp.asarray(adv))
    assert not np.asarray(g_new).any()
    assert not np.asarray(g_old).any() and not np.asarray(g_adv).any()


def test_ppo_bf16_inputs_computed_in_float32():
    new, old, mask, adv = _batch(seed=4)
    loss, metrics = ppo_clip_token_loss(jnp.asarray(new, jnp.bfloat16),
                                        jnp.asarray(old, jnp.bfloat16), mask, adv)
    assert loss.dtype == jnp.float32 and metrics["approx_kl"].dtype == jnp.float32


def test_ppo_rejects_bad_shapes_and_eps():
    new, old, mask, adv = _batch()
    with pytest.raises(AssertionError):
        ppo_clip_token_loss(new, old[:, :-1], mask, adv)
    with pytest.raises(AssertionError):
        ppo_clip_token_loss(new, old, mask, adv[:2])
    with pytest.raises(AssertionError):
        ppo_clip_token_loss(new[0], old[0], mask[0], adv)
    with pytest.raises(ValueError, match="eps_high"):
        ppo_clip_token_loss(new, old, mask, adv, eps_high=0.0)
    with pytest.raises(ValueError, match="eps"):
        ppo_clip_token_loss(new, old, mask, adv, eps=-0.1)


def test_masked_sequence_mean():
    x = np.arange(8, dtype=np.float32).reshape(2, 4)
    mask = np.array([[1, 1, 0, 0], [0, 0, 0, 0]])
    np.testing.assert_allclose(np.asarray(masked_sequence_mean(x, mask)), [0.5, 0.0])


# ----------------------------------------------------------------------------
# router loss
# ----------------------------------------------------------------------------

def test_router_loss_reinforce_and_ppo_forms():
    rng = np.random.default_rng(0)
    old = np.log(rng.uniform(0.05, 0.5, 4)).astype(np.float32)
    new = (old + np.array([0.5, -0.5, 0.05, -0.05])).astype(np.float32)
    adv = np.array([1.0, -1.0, -0.5, 2.0], np.float32)
    alpha = 0.15

    loss_rf, _ = router_loss(new, old, adv, alpha_pi=alpha, reinforce=True)
    assert float(loss_rf) == pytest.approx(alpha * np.sum(-adv * new), rel=1e-5)

    loss_ppo, metrics = router_loss(new, old, adv, alpha_pi=alpha, eps=EPS)
    r = np.exp(new.astype(np.float64) - old)
    ref = -alpha * np.minimum(r * adv, np.clip(r, 1 - EPS, 1 + EPS) * adv).sum()
    assert float(loss_ppo) == pytest.approx(ref, rel=1e-5)
    # Routes 0 (r=1.65, A>0) and 1 (r=0.61, A<0) are clipped.
    assert float(metrics["clip_fraction"]) == pytest.approx(0.5)
    g = np.asarray(jax.grad(lambda x: router_loss(x, old, adv, alpha_pi=alpha)[0])(new))
    assert g[0] == 0 and g[1] == 0
    np.testing.assert_allclose(g[2:], -alpha * adv[2:] * r[2:], rtol=1e-5)


def test_router_reinforce_gradient_equals_ppo_at_ratio_one():
    rng = np.random.default_rng(1)
    logp = np.log(rng.uniform(0.05, 0.5, 4)).astype(np.float32)
    adv = rng.normal(size=4).astype(np.float32)
    g_rf = jax.grad(lambda x: router_loss(x, logp, adv, reinforce=True)[0])(logp)
    g_ppo = jax.grad(lambda x: router_loss(x, logp, adv, reinforce=False)[0])(logp)
    np.testing.assert_allclose(np.asarray(g_rf), np.asarray(g_ppo), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(g_rf), -0.15 * adv, rtol=1e-6)


def test_router_loss_jit_and_validation():
    x = jnp.zeros(3)
    loss, _ = jax.jit(lambda a: router_loss(a, a, jnp.ones(3)))(x)
    assert float(loss) == pytest.approx(-0.15 * 3)
    with pytest.raises(ValueError, match="reinforce"):
        router_loss(x, x, x, reinforce=1)
    with pytest.raises(ValueError, match="alpha_pi"):
        router_loss(x, x, x, alpha_pi=-0.1)
    with pytest.raises(AssertionError):
        router_loss(x, x, jnp.zeros(4))


# ----------------------------------------------------------------------------
# regularisers
# ----------------------------------------------------------------------------

@pytest.mark.parametrize("k", [2, 4, 6])
def test_routing_entropy_uniform_is_log_k(k):
    assert float(routing_entropy(np.full(k, 1 / k))) == pytest.approx(np.log(k), rel=1e-6)


def test_routing_entropy_batch_reference_and_one_hot_gradient():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(2, 3, 4))
    p = np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)
    ent = routing_entropy(p.astype(np.float32))
    assert ent.shape == (2, 3)
    np.testing.assert_allclose(np.asarray(ent), -(p * np.log(p)).sum(-1), rtol=1e-5)
    one_hot = jnp.array([0.0, 1.0, 0.0, 0.0])
    assert float(routing_entropy(one_hot)) == 0.0
    assert np.isfinite(np.asarray(jax.grad(routing_entropy)(one_hot))).all()
    # Through a softmax (how the router uses it) the gradient is finite and the
    # uniform distribution is a stationary point.
    g = jax.grad(lambda z: routing_entropy(jax.nn.softmax(z)))(jnp.zeros(4))
    np.testing.assert_allclose(np.asarray(g), 0.0, atol=1e-7)


def test_prototype_orthogonality():
    rng = np.random.default_rng(0)
    q, _ = np.linalg.qr(rng.normal(size=(16, 4)))
    orthonormal = q.T.astype(np.float32)  # [K=4, D=16] orthonormal rows
    assert float(prototype_orthogonality(orthonormal)) == pytest.approx(0.0, abs=1e-5)
    scaled = orthonormal * np.array([[3.0], [0.1], [1.0], [7.0]], np.float32)
    assert float(prototype_orthogonality(scaled)) == pytest.approx(0.0, abs=1e-5)

    p = rng.normal(size=(4, 8))
    p_hat = p / np.linalg.norm(p, axis=1, keepdims=True)
    ref = ((p_hat @ p_hat.T - np.eye(4)) ** 2).sum()
    assert float(prototype_orthogonality(p.astype(np.float32))) == pytest.approx(ref, rel=1e-5)
    # Two identical prototypes: off-diagonal entries 1 twice.
    dup = np.stack([orthonormal[0], orthonormal[0]])
    assert float(prototype_orthogonality(dup)) == pytest.approx(2.0, rel=1e-5)
    # More prototypes than dimensions cannot be orthogonal.
    assert float(prototype_orthogonality(rng.normal(size=(5, 3)).astype(np.float32))) > 0.5
    g = jax.grad(prototype_orthogonality)(jnp.asarray(p, jnp.float32))
    assert np.isfinite(np.asarray(g)).all() and np.abs(np.asarray(g)).sum() > 0
    zero_row = np.vstack([orthonormal[:3], np.zeros((1, 16), np.float32)])
    assert np.isfinite(float(prototype_orthogonality(zero_row)))


def test_kl_to_base():
    new, base, mask, _ = _batch(seed=5, spread=0.4)
    kl = kl_to_base(new, base, mask)
    lr = base.astype(np.float64) - new
    k3 = np.exp(lr) - lr - 1
    ref = sum((k3[n] * mask[n]).sum() / mask[n].sum() for n in range(3))
    assert float(kl) == pytest.approx(ref, rel=1e-5)
    assert float(kl) > 0
    assert float(kl_to_base(new, new, mask)) == pytest.approx(0.0, abs=1e-7)
    # Gradient flows to the current log-probs only, and is zero at new == base.
    g_new, g_base = jax.grad(kl_to_base, argnums=(0, 1))(jnp.asarray(new), jnp.asarray(base),
                                                         mask)
    assert not np.asarray(g_base).any() and np.asarray(g_new).any()
    g0 = jax.grad(kl_to_base)(jnp.asarray(base), jnp.asarray(base), mask)
    np.testing.assert_allclose(np.asarray(g0), 0.0, atol=1e-7)
    ref_sum = sum((k3[n] * mask[n]).sum() for n in range(3))
    assert float(kl_to_base(new, base, mask, "sequence_sum")) == pytest.approx(ref_sum, rel=1e-5)
