"""Tests for morse_jax.rl.hgrpo: HGRPO / flat-GRPO advantages and Proposition 3.1."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from morse_jax.rl import hgrpo
from morse_jax.rl.hgrpo import (ADVANTAGE_FNS, HGRPOAdvantages, check_rewards,
                                flat_grpo_hierarchical, get_advantage_fn,
                                grpo_advantages, grpo_valid, hgrpo_advantages)

EPS, CLIP, MIN_STD = 1e-6, 5.0, 5e-4


# ----------------------------------------------------------------------------
# numpy references, written from the paper's Eq. 6 and DESIGN §2 directly
# ----------------------------------------------------------------------------

def ref_group(x, eps=EPS, clip=CLIP, min_std=MIN_STD):
    """Standardise a 1-D group: returns (advantages, valid)."""
    x = np.asarray(x, np.float64)
    std = x.std()  # population std, ddof=0
    if std < min_std:
        return np.zeros_like(x), False
    return np.clip((x - x.mean()) / (std + eps), -clip, clip), True


def ref_hgrpo(u, **kw):
    u = np.asarray(u, np.float64)
    B, _ = u.shape
    within = np.zeros_like(u)
    within_valid = np.zeros(B, bool)
    for b in range(B):
        within[b], within_valid[b] = ref_group(u[b], **kw)
    cross, cross_valid = ref_group(u.mean(axis=1), **kw)
    return within, cross, within_valid, cross_valid


def assert_matches_ref(out: HGRPOAdvantages, u, **kw):
    w, c, wv, cv = ref_hgrpo(u, **kw)
    np.testing.assert_allclose(np.asarray(out.within), w, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(out.cross), c, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(out.within_valid), wv)
    assert bool(out.cross_valid) == cv


# ----------------------------------------------------------------------------
# HGRPO against the reference
# ----------------------------------------------------------------------------

@pytest.mark.parametrize("seed", range(4))
def test_hgrpo_random_matches_numpy(seed):
    rng = np.random.default_rng(seed)
    u = rng.uniform(0, 1, size=(4, 4)).astype(np.float32)
    out = hgrpo_advantages(u)
    assert out.within.shape == (4, 4) and out.cross.shape == (4,)
    assert out.within_valid.shape == (4,) and out.cross_valid.shape == ()
    assert out.within_valid.dtype == jnp.bool_ and out.cross_valid.dtype == jnp.bool_
    assert_matches_ref(out, u)


def test_hgrpo_non_square_and_integer_rewards():
    u = np.array([[0, 1, 1], [1, 1, 1], [0, 0, 1], [1, 0, 0], [0, 0, 0]], np.int32)
    out = hgrpo_advantages(u)
    assert jnp.issubdtype(out.within.dtype, jnp.floating)
    assert_matches_ref(out, u)


def test_hgrpo_all_rewards_equal_gives_no_update():
    out = hgrpo_advantages(np.full((4, 4), 0.7, np.float32))
    assert not np.asarray(out.within_valid).any()
    assert not bool(out.cross_valid)
    assert np.all(np.asarray(out.within) == 0) and np.all(np.asarray(out.cross) == 0)


def test_hgrpo_one_constant_route_is_skipped_only_there():
    u = np.array([[0.2, 0.9, 0.4, 0.1],
                  [0.5, 0.5, 0.5, 0.5],
                  [1.0, 0.0, 0.0, 1.0],
                  [0.3, 0.3, 0.3, 0.3004]], np.float32)  # std 1.7e-4 < min_std
    out = hgrpo_advantages(u)
    np.testing.assert_array_equal(np.asarray(out.within_valid), [True, False, True, False])
    assert np.all(np.asarray(out.within)[[1, 3]] == 0)
    assert bool(out.cross_valid)  # route means still differ
    assert_matches_ref(out, u)


def test_hgrpo_single_route_has_no_cross_term():
    u = np.array([[0.1, 0.8, 0.3, 0.6]], np.float32)
    out = hgrpo_advantages(u)
    assert not bool(out.cross_valid) and float(out.cross[0]) == 0.0
    assert bool(out.within_valid[0])
    assert_matches_ref(out, u)


def test_hgrpo_single_candidate_has_no_within_term():
    u = np.array([[0.1], [0.8], [0.3]], np.float32)
    out = hgrpo_advantages(u)
    assert not np.asarray(out.within_valid).any()
    assert np.all(np.asarray(out.within) == 0)
    assert bool(out.cross_valid)
    assert_matches_ref(out, u)


def test_hgrpo_clipping_applied_after_normalising():
    # One outlier among 16: its z-score is sqrt(15) ~ 3.87 and the others' tiny.
    u = np.zeros((1, 16), np.float32)
    u[0, 3] = 1.0
    out = hgrpo_advantages(u, clip=2.0)
    assert float(out.within[0, 3]) == pytest.approx(2.0)
    assert float(out.within[0, 0]) == pytest.approx(-1 / np.sqrt(15), rel=1e-5)
    assert_matches_ref(out, u, clip=2.0)
    unclipped = hgrpo_advantages(u, clip=None)
    assert float(unclipped.within[0, 3]) == pytest.approx(np.sqrt(15), rel=1e-5)


def test_hgrpo_normalized_within_has_unit_population_std():
    rng = np.random.default_rng(7)
    out = hgrpo_advantages(rng.normal(size=(3, 6)).astype(np.float32))
    np.testing.assert_allclose(np.asarray(out.within).std(axis=1), 1.0, rtol=1e-4)
    np.testing.assert_allclose(np.asarray(out.within).mean(axis=1), 0.0, atol=1e-6)


def test_hgrpo_unnormalized_is_centring_only():
    rng = np.random.default_rng(3)
    u = rng.uniform(size=(4, 4)).astype(np.float32)
    out = hgrpo_advantages(u, normalize=False, clip=None)
    np.testing.assert_allclose(np.asarray(out.within), u - u.mean(1, keepdims=True),
                               atol=1e-6)
    mu = u.mean(1)
    np.testing.assert_allclose(np.asarray(out.cross), mu - mu.mean(), atol=1e-6)


def test_hgrpo_leading_axes_vmap_and_jit_agree():
    rng = np.random.default_rng(11)
    u = rng.uniform(size=(5, 4, 4)).astype(np.float32)
    u[2] = 0.5  # one node with no signal at all
    u[4, 1] = 0.25  # one constant route
    direct = hgrpo_advantages(u)
    vmapped = jax.vmap(hgrpo_advantages)(jnp.asarray(u))
    jitted = jax.jit(jax.vmap(lambda r: hgrpo_advantages(r, clip=5.0)))(jnp.asarray(u))
    for out in (direct, vmapped, jitted):
        assert out.within.shape == (5, 4, 4) and out.cross.shape == (5, 4)
        assert out.within_valid.shape == (5, 4) and out.cross_valid.shape == (5,)
        for i in range(5):
            assert_matches_ref(jax.tree.map(lambda x: x[i], out), u[i])


def test_hgrpo_jit_compiles_once_per_shape():
    traces = []

    @jax.jit
    def f(r):
        traces.append(1)
        return hgrpo_advantages(r)

    rng = np.random.default_rng(0)
    for _ in range(3):
        u = rng.uniform(size=(4, 4)).astype(np.float32)
        assert_matches_ref(f(jnp.asarray(u)), u)
    assert len(traces) == 1


def test_hgrpo_is_invariant_to_per_route_reward_offsets():
    """The mechanism of Prop. 3.1: within-route advantages do not see route quality.

    Adding any constant per route (a better or worse expert set) leaves A_within
    unchanged, while flat GRPO's per-candidate advantages change."""
    rng = np.random.default_rng(5)
    u = rng.uniform(size=(4, 4)).astype(np.float64)
    offset = np.array([0.0, 0.6, -0.3, 1.1])[:, None]
    for normalize in (True, False):
        a = hgrpo_advantages(u, normalize=normalize)
        b = hgrpo_advantages(u + offset, normalize=normalize)
        np.testing.assert_allclose(np.asarray(b.within), np.asarray(a.within), atol=2e-5)
        fa = flat_grpo_hierarchical(u, normalize=normalize).within
        fb = flat_grpo_hierarchical(u + offset, normalize=normalize).within
        assert np.abs(np.asarray(fb) - np.asarray(fa)).max() > 0.1


# ----------------------------------------------------------------------------
# flat GRPO
# ----------------------------------------------------------------------------

@pytest.mark.parametrize("rewards", [
    np.random.default_rng(1).uniform(size=16),
    np.array([0.0, 0.0, 0.0, 1.0]),
    np.array([0.4, 0.4, 0.4]),
    np.array([0.9]),
])
def test_grpo_matches_numpy(rewards):
    rewards = rewards.astype(np.float32)
    adv = grpo_advantages(rewards)
    ref, valid = ref_group(rewards)
    assert adv.shape == rewards.shape
    np.testing.assert_allclose(np.asarray(adv), ref, rtol=1e-5, atol=1e-5)
    assert bool(grpo_valid(rewards)) == valid


def test_grpo_clip_and_batch_axes():
    u = np.zeros((3, 16), np.float32)
    u[0, 0] = 1.0
    u[1] = np.linspace(0, 1, 16)
    adv = jax.jit(jax.vmap(lambda r: grpo_advantages(r, clip=3.0)))(jnp.asarray(u))
    direct = grpo_advantages(u, clip=3.0)
    for i in range(3):
        ref, valid = ref_group(u[i], clip=3.0)
        np.testing.assert_allclose(np.asarray(adv[i]), ref, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(np.asarray(direct[i]), ref, rtol=1e-5, atol=1e-5)
    assert float(adv[0, 0]) == pytest.approx(3.0)
    np.testing.assert_array_equal(np.asarray(grpo_valid(u)), [True, True, False])


def test_flat_grpo_hierarchical_layout():
    rng = np.random.default_rng(2)
    u = rng.uniform(size=(4, 3)).astype(np.float32)
    out = flat_grpo_hierarchical(u)
    ref, valid = ref_group(u.reshape(-1))
    np.testing.assert_allclose(np.asarray(out.within), ref.reshape(4, 3), rtol=1e-5,
                               atol=1e-5)
    # Router gets the shared per-candidate advantage summed over each route.
    np.testing.assert_allclose(np.asarray(out.cross), ref.reshape(4, 3).sum(1), rtol=1e-5,
                               atol=1e-5)
    assert np.asarray(out.within_valid).tolist() == [valid] * 4 and bool(out.cross_valid)
    # Ablation C: one candidate per route -> cross is each candidate's advantage.
    one = flat_grpo_hierarchical(u.reshape(-1, 1))
    np.testing.assert_allclose(np.asarray(one.cross), ref, rtol=1e-5, atol=1e-5)
    const = flat_grpo_hierarchical(np.ones((2, 2)))
    assert not bool(const.cross_valid) and not np.asarray(const.within_valid).any()


def test_registry():
    assert set(ADVANTAGE_FNS) == {"hgrpo", "grpo"}
    assert get_advantage_fn("hgrpo") is hgrpo_advantages
    assert get_advantage_fn("grpo") is flat_grpo_hierarchical
    u = np.random.default_rng(0).uniform(size=(4, 4))
    for name in ADVANTAGE_FNS:
        out = jax.jit(get_advantage_fn(name))(jnp.asarray(u))
        assert isinstance(out, HGRPOAdvantages) and out.within.shape == (4, 4)
    with pytest.raises(ValueError, match="advantage.*'ppo'.*grpo.*hgrpo"):
        get_advantage_fn("ppo")


# ----------------------------------------------------------------------------
# input validation
# ----------------------------------------------------------------------------

@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_rewards_raise(bad):
    u = np.full((4, 4), 0.5, np.float32)
    u[2, 1] = bad
    with pytest.raises(ValueError, match=r"rewards: 1 non-finite.*\(2, 1\)"):
        hgrpo_advantages(u)
    with pytest.raises(ValueError, match="rewards: 1 non-finite"):
        hgrpo_advantages(jnp.asarray(u))  # concrete device arrays are checked too
    with pytest.raises(ValueError, match="non-finite"):
        grpo_advantages(u.reshape(-1))
    with pytest.raises(ValueError, match="non-finite"):
        flat_grpo_hierarchical(u)
    with pytest.raises(ValueError, match="non-finite"):
        check_rewards(u)


def test_check_rewards_is_a_noop_under_trace():
    # Inside jit the values are unknown; the check must not break tracing.
    out = jax.jit(hgrpo_advantages)(jnp.full((2, 2), jnp.nan))
    assert np.isnan(np.asarray(out.within)).all()


@pytest.mark.parametrize("bad_shape", [(), (4,)])
def test_hgrpo_rejects_low_rank(bad_shape):
    with pytest.raises(ValueError, match="rewards: expected at least 2 axes"):
        hgrpo_advantages(np.zeros(bad_shape, np.float32))


def test_bad_hyperparameters_raise():
    u = np.ones((2, 2), np.float32)
    with pytest.raises(ValueError, match="eps"):
        hgrpo_advantages(u, eps=-1.0)
    with pytest.raises(ValueError, match="clip"):
        hgrpo_advantages(u, clip=0.0)
    with pytest.raises(ValueError, match="min_std"):
        grpo_advantages(u[0], min_std=-1e-3)
    with pytest.raises(ValueError, match="normalize"):
        hgrpo_advantages(u, normalize=jnp.array(True))
    with pytest.raises(ValueError, match="rewards: expected a real numeric"):
        hgrpo_advantages(np.array([["a", "b"]]))


def test_zero_eps_and_min_std_constant_group_is_finite():
    # No 0/0: with both guards off a constant group must still give finite output
    # (rounding noise may be normalised, which is why min_std exists).
    out = hgrpo_advantages(np.ones((2, 3), np.float32), eps=0.0, min_std=0.0)
    assert np.isfinite(np.asarray(out.within)).all()
    assert np.isfinite(np.asarray(out.cross)).all()
    assert np.isfinite(np.asarray(grpo_advantages(np.ones(4), eps=0.0, min_std=0.0))).all()


def test_constant_rewards_skipped_under_jit_despite_rounding():
    # 0.7 is inexact in binary; fused reductions must not turn noise into signal.
    for shape in [(4, 4), (3, 5), (8, 16)]:
        out = jax.jit(hgrpo_advantages)(jnp.full(shape, 0.7))
        assert not np.asarray(out.within_valid).any() and not bool(out.cross_valid)
        assert not np.asarray(out.within).any() and not np.asarray(out.cross).any()


# ----------------------------------------------------------------------------
# Proposition 3.1 (paper §3.3, proof in Appendix G), empirically
# ----------------------------------------------------------------------------

B, M, D = 4, 4, 3
S = 20_000  # independent replicates ("seeds"), drawn vectorised
ROUTE_QUALITY = np.array([0.0, 0.4, 0.8, 1.2, 1.6, 2.0])  # the 6 = C(4,2) expert pairs
W = np.array([0.15, -0.1, 0.05])  # reward sensitivity to the score direction
NOISE = 0.05


def _synthetic(seed, route_quality=ROUTE_QUALITY, w=W, noise=NOISE, m=M):
    """Draws S independent HGRPO nodes.

    Route b picks expert set k_b uniformly from len(route_quality) sets (i.i.d.
    route draws, as in the proof's setup). Candidate (b, m) is y ~ N(theta_b, I_D)
    under that set's LoRA parameters theta_b, so its score function is
    g[b, m] = y - theta_b ~ N(0, I_D): zero mean given the route and independent
    of the route's quality, which is what the proof assumes ("independence of
    the score function from the cross-route deviation"). The reward is
    u = q[k_b] + w . g + noise * e, so the route mean is mu_b = q[k_b],
    sigma_C^2 = Var(q) (population), sigma_W^2 = |w|^2 + noise^2, and the true
    per-candidate policy gradient is E[u g] = w.
    """
    rng = np.random.default_rng(seed)
    k = rng.integers(0, len(route_quality), size=(S, B))
    g = rng.standard_normal((S, B, m, D))
    u = route_quality[k][..., None] + g @ w + noise * rng.standard_normal((S, B, m))
    return u, g, route_quality[k]


def _estimator(adv, g):
    """LoRA gradient estimator sum_{b,m} A[b,m] g[b,m], per replicate: [S, D]."""
    return np.einsum("sbm,sbmd->sd", np.asarray(adv, np.float64), g)


def _mean_diff_within(x, tol_se=4.5):
    """Asserts E[x] = 0 for paired per-replicate differences x[S, D]."""
    se = x.std(axis=0, ddof=1) / np.sqrt(len(x))
    assert np.all(np.abs(x.mean(axis=0)) < tol_se * se), (x.mean(axis=0), se)


def test_prop31_population_baselines_exact_statement():
    """Prop. 3.1 as stated: population baselines mu_b = E[u|b], mu_bar = E[u].

    g_H = sum (u - mu_b) g and g_single = sum (u - mu_bar) g have the same mean
    (B*M*w) and Var[g_single] - Var[g_H] = B*M*sigma_C^2*E||g||^2 = B*M*D*Var(q).
    This checks the synthetic problem satisfies the proposition's assumptions,
    which the finite-sample tests below rely on."""
    u, g, mu_b = _synthetic(0)
    g_h = _estimator(u - mu_b[..., None], g)
    g_s = _estimator(u - ROUTE_QUALITY.mean(), g)
    _mean_diff_within(g_s - g_h)
    _mean_diff_within(g_h - B * M * W)
    # Paired per-replicate statistic whose mean is exactly the variance gap.
    true_mean = B * M * W
    gap = ((g_s - true_mean) ** 2).sum(1) - ((g_h - true_mean) ** 2).sum(1)
    predicted = B * M * D * ROUTE_QUALITY.var()
    se = gap.std(ddof=1) / np.sqrt(S)
    assert abs(gap.mean() - predicted) < 4.5 * se, (gap.mean(), predicted, se)
    assert predicted > 20 * se  # the reduction is large compared with the noise


def test_prop31_implemented_unnormalized_estimators():
    """The implemented advantages (empirical group statistics, no std scaling).

    With empirical baselines a candidate's own reward sits in its baseline, so
    E[g_H] = B*(M-1)*w and E[g_GRPO] = (B*M-1)*w exactly in this model (the
    "(1-1/M) factor absorbed by the learning rate" of Appendix G); after that
    rescaling the means agree. The route effect enters flat GRPO only through
    sum_b (mu_b - mean_b mu_b) sum_m g[b,m], adding exactly
    (B-1)*M*D*sigma_C^2 of variance, while HGRPO is unaffected by it. With
    cross-route variance dominating (sigma_C^2 >> sigma_W^2 / M, the regime the
    paper targets) the rescaled HGRPO estimator has clearly lower variance.
    (When sigma_C^2 is comparable to sigma_W^2, at M=4 the finite-sample
    self-inclusion of the within-route baseline nearly cancels the gain; the
    strict reduction is a population-baseline statement.)
    """
    u, g, mu_b = _synthetic(1)
    hgrpo_fn, flat_fn = (
        jax.jit(jax.vmap(lambda r, f=f: f(r, normalize=False, clip=None).within))
        for f in (hgrpo_advantages, flat_grpo_hierarchical))
    g_h = _estimator(hgrpo_fn(jnp.asarray(u)), g)
    g_f = _estimator(flat_fn(jnp.asarray(u)), g)
    # Same problem with the route effect removed (every route equally good).
    u0 = u - mu_b[..., None]
    g_h0 = _estimator(hgrpo_fn(jnp.asarray(u0)), g)
    g_f0 = _estimator(flat_fn(jnp.asarray(u0)), g)

    np.testing.assert_allclose(g_h, g_h0, atol=1e-3)  # HGRPO never sees route quality
    h_unit, f_unit = g_h / (B * (M - 1)), g_f / (B * M - 1)
    _mean_diff_within(h_unit - W)
    _mean_diff_within(f_unit - W)
    _mean_diff_within(h_unit - f_unit)

    true_f = (B * M - 1) * W
    gap = ((g_f - true_f) ** 2).sum(1) - ((g_f0 - true_f) ** 2).sum(1)
    predicted = (B - 1) * M * D * ROUTE_QUALITY.var()
    se = gap.std(ddof=1) / np.sqrt(S)
    assert abs(gap.mean() - predicted) < 4.5 * se, (gap.mean(), predicted, se)

    # Variance of the mean-matched estimators, paired per replicate.
    var_gap = ((f_unit - W) ** 2).sum(1) - ((h_unit - W) ** 2).sum(1)
    se = var_gap.std(ddof=1) / np.sqrt(S)
    assert var_gap.mean() > 10 * se
    assert ((h_unit - W) ** 2).sum(1).mean() < 0.5 * ((f_unit - W) ** 2).sum(1).mean()


def test_prop31_implemented_normalized_defaults():
    """The default (std-normalised, clipped) advantages used in training.

    Normalising by sigma_b (HGRPO) or the global std (GRPO) rescales each
    estimator by a different data-dependent step size, so only the direction
    of the mean is shared: in this rotation-symmetric model both means are
    exactly parallel to w (the component orthogonal to w is zero in
    expectation). Variance is compared relative to the squared mean norm
    (noise-to-signal), which is invariant to the scale; HGRPO's is lower.
    """
    u, g, _ = _synthetic(2)
    g_h = _estimator(jax.vmap(hgrpo_advantages)(jnp.asarray(u)).within, g)
    g_f = _estimator(jax.vmap(flat_grpo_hierarchical)(jnp.asarray(u)).within, g)
    w_hat = W / np.linalg.norm(W)
    for est in (g_h, g_f):
        _mean_diff_within(est - np.outer(est @ w_hat, w_hat))  # no off-w component
        assert est.mean(0) @ w_hat > 20 * (est @ w_hat).std() / np.sqrt(S)

    def noise_to_signal(est):
        mean = est.mean(0)
        return ((est - mean) ** 2).sum(1).mean() / (mean @ mean)

    assert noise_to_signal(g_h) < 0.5 * noise_to_signal(g_f)


def test_public_names_exported():
    for name in hgrpo.__all__:
        assert hasattr(hgrpo, name)
