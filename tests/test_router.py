"""Tests for morse_jax.mole.router (prototype router, set likelihoods, regularisers).

Every check runs under jax.jit and several checks share one jitted program: eager JAX
compiles each primitive separately, and XLA compiles dominate the runtime of small tests on CPU.
"""

from __future__ import annotations

import itertools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.stats

from morse_jax.mole import router as R

set_log_prob = jax.jit(R.set_log_prob)
sample_route = jax.jit(R.sample_route, static_argnums=2)
greedy_route = jax.jit(R.greedy_route, static_argnums=1)
subtask_embedding = jax.jit(R.subtask_embedding, static_argnames=("max_tokens",))
draw_routes = jax.jit(R.draw_routes, static_argnames=("k", "num_samples", "greedy", "approx_set_logp", "max_tokens"))
init_router = jax.jit(
    R.init_router, static_argnums=1, static_argnames=("num_experts", "dim", "dtype")
)


def _random_probs(seed: int, n: int, k_s: int, scale: float = 1.5) -> np.ndarray:
    logits = scale * np.random.default_rng(seed).normal(size=(n, k_s))
    p = np.exp(logits - logits.max(axis=1, keepdims=True))
    return (p / p.sum(axis=1, keepdims=True)).astype(np.float32)


def _all_sets(k_s: int, k: int) -> np.ndarray:
    return np.array(list(itertools.combinations(range(k_s), k)), dtype=np.int32)


def _reference_set_prob(p: np.ndarray, members) -> float:
    """Plain-Python sequential-draw probability of an unordered set (float64)."""
    total = 0.0
    for order in itertools.permutations(members):
        prob, left = 1.0, 1.0
        for m in order:
            prob *= p[m] / left
            left -= p[m]
        total += prob
    return total


# ------------------------------------------------------------------------------------------
# Set likelihoods
# ------------------------------------------------------------------------------------------

_SUM_CASES = [(k_s, k) for k_s in (4, 6, 8) for k in (1, 2, 3)]


@jax.jit
def _set_prob_totals(cases):
    """For each (probs[n, K], sets[C, k]): sum over the C sets of exp(set_log_prob), per row."""
    totals = []
    for probs, sets in cases:
        n, c = probs.shape[0], sets.shape[0]
        logp = R.set_log_prob(jnp.repeat(probs, c, axis=0), jnp.tile(sets, (n, 1)))
        totals.append(jnp.sum(jnp.exp(logp.reshape(n, c)), axis=1))
    return totals


def test_exact_set_probs_sum_to_one():
    cases = [(_random_probs(10 * k_s + k, 5, k_s), _all_sets(k_s, k)) for k_s, k in _SUM_CASES]
    for (k_s, k), total in zip(_SUM_CASES, _set_prob_totals(cases)):
        np.testing.assert_allclose(np.asarray(total), 1.0, atol=1e-5, err_msg=f"K_s={k_s} k={k}")


def test_exact_set_prob_matches_reference_and_is_order_invariant():
    probs = _random_probs(3, 4, 6, scale=2.0)
    members = np.array([[0, 3, 5], [5, 3, 0], [1, 2, 4], [2, 0, 1]], dtype=np.int32)
    got = np.exp(np.asarray(set_log_prob(probs, members)))
    want = [_reference_set_prob(probs[i].astype(np.float64), members[i]) for i in range(4)]
    np.testing.assert_allclose(got, want, rtol=1e-5)
    # Rows 0 and 1 hold the same set in different orders; give them the same probabilities.
    same_rows = np.stack([probs[0], probs[0], probs[2], probs[3]])
    got2 = np.asarray(set_log_prob(same_rows, members))
    np.testing.assert_allclose(got2[0], got2[1], rtol=1e-6)


def test_exact_set_prob_accurate_when_one_expert_dominates():
    # 1 - cumsum would cancel catastrophically here; the log-sum-exp denominators do not.
    probs = np.array([[1.0 - 3e-7, 1e-7, 1e-7, 1e-7]], np.float32)
    got = float(set_log_prob(probs, np.array([[0, 1]], np.int32))[0])
    # P({0,1}) = p0 p1 / (1 - p0) + p1 p0 / (1 - p1) ~= 1/3 + 1e-7
    assert math.isclose(got, math.log(1.0 / 3.0), rel_tol=1e-4)


def test_invalid_members_get_minus_inf_without_nan_gradients():
    probs = _random_probs(0, 3, 4)
    members = np.array([[0, 0], [1, 7], [2, 3]], np.int32)
    valid = np.array([False, False, True])

    @jax.jit
    def value_and_grad(p):
        safe_sum = lambda q: jnp.sum(jnp.where(valid, R.set_log_prob(q, members), 0.0))
        return R.set_log_prob(p, members), jax.grad(safe_sum)(p)

    logp, grad = (np.asarray(x) for x in value_and_grad(probs))
    assert np.isneginf(logp[:2]).all() and np.isfinite(logp[2])
    assert np.isfinite(grad).all() and np.abs(grad[2]).max() > 0


def test_approx_equals_exact_for_k1_and_differs_for_k_ge_2():
    @jax.jit
    def both(probs):
        out = {}
        for k in (1, 2, 3):
            m = R.greedy_route(probs, k)
            out[k] = (R.set_log_prob(probs, m), R.approx_set_log_prob(probs, m))
        return out

    out = both(_random_probs(1, 8, 6))
    np.testing.assert_allclose(out[1][0], out[1][1], rtol=1e-6)
    for k in (2, 3):
        exact, approx = np.asarray(out[k][0]), np.asarray(out[k][1])
        assert np.all(np.abs(exact - approx) > 1e-3), (k, exact, approx)
        # The members' product is a strict lower bound on the set probability.
        assert np.all(approx < exact)


def test_exact_set_size_limit():
    with pytest.raises(ValueError, match="members.shape"):
        R.set_log_prob(_random_probs(0, 1, 8), np.arange(7, dtype=np.int32)[None])


# ------------------------------------------------------------------------------------------
# Sampling
# ------------------------------------------------------------------------------------------


@jax.jit
def _draws_and_set_probs(key, probs_row, sets):
    """Draw many routes from one distribution and score every possible set; one program."""
    n_draws = 100_000
    k_s = probs_row.shape[0]
    members = R.sample_route(key, jnp.broadcast_to(probs_row, (n_draws, k_s)), sets.shape[1])
    codes = jnp.sum(jnp.left_shift(1, members), axis=1)
    rows = jnp.broadcast_to(probs_row, (sets.shape[0], k_s))
    return codes, R.set_log_prob(rows, sets), R.approx_set_log_prob(rows, sets)


def _observed_and_expected(k_s, k, probs_row, seed):
    sets = _all_sets(k_s, k)
    codes, exact, approx = _draws_and_set_probs(jax.random.PRNGKey(seed), probs_row, sets)
    set_codes = (1 << sets.astype(np.int64)).sum(axis=1)
    codes = np.asarray(codes)
    observed = np.array([(codes == c).sum() for c in set_codes])
    assert observed.sum() == codes.shape[0]  # every draw is one of the C(K, k) valid sets

    def expected(logp):
        p = np.exp(np.asarray(logp, np.float64))
        return codes.shape[0] * p / p.sum()

    return observed, expected(exact), expected(approx)


@pytest.mark.parametrize("k_s,k,seed", [(4, 2, 11), (6, 3, 12)])
def test_gumbel_top_k_matches_exact_set_distribution(k_s, k, seed):
    probs_row = _random_probs(seed, 1, k_s, scale=1.0)[0]
    observed, expected, _ = _observed_and_expected(k_s, k, probs_row, seed)
    pvalue = scipy.stats.chisquare(observed, expected).pvalue
    assert pvalue > 1e-3, (observed, expected, pvalue)


def test_chi_square_has_power_against_the_approximation():
    # The normalised product of member probabilities is the wrong set distribution; the same
    # test must reject it, otherwise the test above proves nothing.
    probs_row = np.array([0.5, 0.25, 0.15, 0.1], np.float32)
    observed, expected, wrong = _observed_and_expected(4, 2, probs_row, 5)
    assert scipy.stats.chisquare(observed, expected).pvalue > 1e-3
    assert scipy.stats.chisquare(observed, wrong).pvalue < 1e-6


def test_sample_route_distinct_members_per_row():
    probs = _random_probs(2, 4096, 8, scale=4.0)
    # Degenerate row: zero probabilities must still yield k distinct experts.
    probs[0] = np.eye(8, dtype=np.float32)[0]
    members = np.asarray(sample_route(jax.random.PRNGKey(0), probs, 3))
    assert members.dtype == np.int32 and members.shape == (4096, 3)
    assert ((members >= 0) & (members < 8)).all()
    assert (np.diff(np.sort(members, axis=1), axis=1) > 0).all()
    assert members[0, 0] == 0
    # Different keys give different routes (the sampler is not secretly greedy).
    other = np.asarray(sample_route(jax.random.PRNGKey(1), probs, 3))
    assert (np.sort(other, axis=1) != np.sort(members, axis=1)).any(axis=1).mean() > 0.1


def test_greedy_route_picks_top_k():
    probs = _random_probs(4, 64, 8)
    members = np.asarray(greedy_route(probs, 3))
    assert members.dtype == np.int32
    np.testing.assert_array_equal(members, np.argsort(-probs, axis=1, kind="stable")[:, :3])


@pytest.mark.parametrize("k", [0, 5, 2.0, True])
def test_bad_k_rejected(k):
    probs = _random_probs(0, 2, 4)
    with pytest.raises(ValueError, match="k"):
        R.sample_route(jax.random.PRNGKey(0), probs, k)
    with pytest.raises(ValueError, match="k"):
        R.greedy_route(probs, k)


# ------------------------------------------------------------------------------------------
# Parameters, logits and gradients
# ------------------------------------------------------------------------------------------


def _params_and_emb(n=10, d_model=16, seed=3):
    params = init_router(jax.random.PRNGKey(seed), d_model, num_experts=4, dim=8)
    emb = np.random.default_rng(seed).normal(size=(n, d_model)).astype(np.float32)
    return params, emb


def test_init_router_shapes_and_validation():
    params = init_router(jax.random.PRNGKey(0), 24, num_experts=5, dim=16, dtype=jnp.bfloat16)
    shapes = jax.tree_util.tree_map(lambda x: (x.shape, x.dtype), params)
    assert shapes == {
        "proj": {"kernel": ((24, 16), jnp.bfloat16), "bias": ((16,), jnp.bfloat16)},
        "prototypes": ((5, 16), jnp.bfloat16),
    }
    kernel = np.asarray(params["proj"]["kernel"], np.float32)
    assert 0.5 / math.sqrt(24) < kernel.std() < 2.0 / math.sqrt(24)
    assert np.abs(np.asarray(params["proj"]["bias"], np.float32)).max() == 0
    protos = np.asarray(params["prototypes"], np.float32)
    assert 0.005 < protos.std() < 0.05 and np.linalg.matrix_rank(protos) == 5
    with pytest.raises(ValueError, match="d_model"):
        R.init_router(jax.random.PRNGKey(0), 0)
    with pytest.raises(ValueError, match="num_experts"):
        R.init_router(jax.random.PRNGKey(0), 8, num_experts=-1)
    with pytest.raises(ValueError, match="dim"):
        R.init_router(jax.random.PRNGKey(0), 8, dim=2.5)
    with pytest.raises(ValueError, match="dtype"):
        R.init_router(jax.random.PRNGKey(0), 8, dtype=jnp.int32)


def test_router_logits_are_scaled_cosines():
    params, emb = _params_and_emb(n=6)
    logits_and_probs = jax.jit(
        lambda p, e: (R.router_logits(p, e, temperature=0.5), R.router_probs(p, e, temperature=0.5))
    )
    z, probs = (np.asarray(x) for x in logits_and_probs(params, emb))
    h = emb @ np.asarray(params["proj"]["kernel"]) + np.asarray(params["proj"]["bias"])
    p = np.asarray(params["prototypes"])
    h_hat = h / np.linalg.norm(h, axis=1, keepdims=True)
    p_hat = p / np.linalg.norm(p, axis=1, keepdims=True)
    np.testing.assert_allclose(z, h_hat @ p_hat.T / 0.5, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(probs.sum(1), 1.0, rtol=1e-6)
    np.testing.assert_allclose(probs, np.exp(z) / np.exp(z).sum(1, keepdims=True), rtol=1e-5)
    for bad in (0.0, -1.0, float("nan")):
        with pytest.raises(ValueError, match="temperature"):
            R.router_logits(params, emb, temperature=bad)


@jax.jit
def _router_grads(params, emb, key):
    """Gradients of four router objectives w.r.t. all router params, in one program."""
    members = R.sample_route(key, R.router_probs(params, emb), 2)
    objectives = {
        "exact": lambda p: jnp.mean(R.set_log_prob(R.router_probs(p, emb), members)),
        "approx": lambda p: jnp.mean(R.approx_set_log_prob(R.router_probs(p, emb), members)),
        "entropy": lambda p: jnp.mean(R.routing_entropy(R.router_probs(p, emb))),
        "regularizer": lambda p: R.router_regularizer(p, R.router_probs(p, emb)),
    }
    return {name: jax.grad(f)(params) for name, f in objectives.items()}


def test_router_gradients_finite_and_nonzero():
    params, emb = _params_and_emb()
    grads = _router_grads(params, emb, jax.random.PRNGKey(5))
    for name, g in grads.items():
        assert set(g) == {"proj", "prototypes"}, name
        for path, leaf in jax.tree_util.tree_leaves_with_path(g):
            leaf = np.asarray(leaf)
            assert np.isfinite(leaf).all(), (name, path)
            assert np.abs(leaf).max() > 0, (name, path)


def test_routing_entropy_and_regularizer_values():
    params, emb = _params_and_emb()
    fixed = np.array([[0.25, 0.25, 0.25, 0.25], [1.0, 0, 0, 0], [0.5, 0.5, 0, 0]], np.float32)

    @jax.jit
    def values(params, emb, fixed):
        probs = R.router_probs(params, emb)
        manual = -R.ENTROPY_WEIGHT * R.routing_entropy(probs).mean() + R.ORTHOGONALITY_WEIGHT * (
            R.prototype_orthogonality(params["prototypes"])
        )
        entropy_grad = jax.grad(lambda p: R.routing_entropy(p).sum())(fixed)
        return R.routing_entropy(fixed), entropy_grad, R.router_regularizer(params, probs), manual

    entropy, entropy_grad, reg, manual = values(params, emb, fixed)
    np.testing.assert_allclose(entropy, [math.log(4), 0.0, math.log(2)], atol=1e-6)
    assert np.isfinite(np.asarray(entropy_grad)).all()
    np.testing.assert_allclose(reg, manual, rtol=1e-6)
    assert (R.ENTROPY_WEIGHT, R.ORTHOGONALITY_WEIGHT) == (0.02, 0.05)


def test_orthogonality_penalty_zero_at_orthonormal_and_known_value():
    q, _ = np.linalg.qr(np.random.default_rng(0).normal(size=(16, 4)))
    rows = q.T.astype(np.float32)  # [4, 16] orthonormal rows
    scaled = rows * np.array([[0.01], [3.0], [1.0], [50.0]], np.float32)  # scale is removed
    same = np.ones((4, 16), np.float32)  # identical rows: 12 off-diagonal ones -> penalty 12
    values = jax.jit(jax.vmap(R.prototype_orthogonality))(np.stack([rows, scaled, same]))
    np.testing.assert_allclose(values, [0.0, 0.0, 12.0], atol=1e-5)


def test_orthogonality_penalty_falls_under_gradient_descent():
    rng = np.random.default_rng(6)
    # Strongly correlated start: a shared direction plus small noise.
    protos = (rng.normal(size=(1, 8)) + 0.2 * rng.normal(size=(4, 8))).astype(np.float32)

    @jax.jit
    def run(p):
        def step(p, _):
            v, g = jax.value_and_grad(R.prototype_orthogonality)(p)
            return p - 0.05 * g, v

        p_final, trace = jax.lax.scan(step, p, None, length=200)
        return R.prototype_orthogonality(p_final), trace

    final, trace = run(protos)
    trace = np.asarray(trace)
    start, final = float(trace[0]), float(final)
    assert start > 5.0
    assert final < 0.01 * start, (start, final)
    assert np.all(np.diff(trace)[:20] < 0)


# ------------------------------------------------------------------------------------------
# Subtask embedding
# ------------------------------------------------------------------------------------------


def _table(v=200, d=6, seed=7):
    return np.random.default_rng(seed).normal(size=(v, d)).astype(np.float32)


def test_subtask_embedding_padding_changes_nothing():
    table = _table()
    ids = np.arange(10, dtype=np.int32) + 3
    garbage = np.random.default_rng(0).integers(0, 200, size=7).astype(np.int32)
    real, pad = np.ones(10, bool), np.zeros(7, bool)
    # Row 0: right padding; row 1: left padding; row 2: padding in the middle.
    batch_ids = np.stack(
        [np.r_[ids, garbage], np.r_[garbage, ids], np.r_[ids[:4], garbage, ids[4:]]]
    )
    batch_mask = np.stack([np.r_[real, pad], np.r_[pad, real], np.r_[real[:4], pad, real[4:]]])
    out = np.asarray(subtask_embedding(table, batch_ids, batch_mask))
    want = table[3:13].mean(0)
    np.testing.assert_allclose(out, np.broadcast_to(want, out.shape), rtol=1e-5, atol=1e-6)


def test_subtask_embedding_truncates_to_first_max_tokens():
    table = _table()
    ids = np.stack([np.arange(100, dtype=np.int32) + 50, np.arange(100, dtype=np.int32)])
    mask = np.ones_like(ids)
    mask[1, :40] = 0  # 60 real tokens: all of them count
    got = np.asarray(subtask_embedding(table, ids, mask))
    np.testing.assert_allclose(got[0], table[50:114].mean(0), rtol=1e-5, atol=1e-6)
    assert not np.allclose(got[0], table[50:150].mean(0), rtol=1e-3)
    np.testing.assert_allclose(got[1], table[40:100].mean(0), rtol=1e-5, atol=1e-6)
    # The first 4 REAL tokens count, not the first 4 positions.
    ids2 = np.array([[5, 6, 7, 8, 9, 10, 11]], np.int32)
    mask2 = np.array([[1, 0, 1, 0, 1, 1, 1]], np.int32)
    got2 = np.asarray(subtask_embedding(table, ids2, mask2, max_tokens=4))
    np.testing.assert_allclose(got2[0], table[[5, 7, 9, 10]].mean(0), rtol=1e-5)


def test_subtask_embedding_all_masked_row_is_zero_and_frozen():
    params, _ = _params_and_emb()
    table = _table(d=16)
    ids = np.array([[1, 2, 3], [4, 5, 6]], np.int32)
    mask = np.array([[0, 0, 0], [1, 1, 0]], np.int32)

    @jax.jit
    def run(table):
        emb = R.subtask_embedding(table, ids, mask)
        grad = jax.grad(lambda t: jnp.sum(R.subtask_embedding(t, ids, mask) ** 2))(table)
        return emb, grad, R.draw_routes(params, table, ids, mask, None, k=2, greedy=True)

    emb, grad, (members, logp, probs) = run(table)
    np.testing.assert_array_equal(np.asarray(emb[0]), 0.0)
    np.testing.assert_allclose(emb[1], table[[4, 5]].mean(0), rtol=1e-6)
    np.testing.assert_array_equal(np.asarray(grad), 0.0)  # frozen backbone: no gradient
    # A fully-masked row still routes without NaN.
    assert np.isfinite(np.asarray(probs)).all() and np.isfinite(np.asarray(logp)).all()


def test_subtask_embedding_dtype_and_validation():
    table = jnp.asarray(_table(), jnp.bfloat16)
    ids = np.array([[1, 2]], np.int32)
    assert subtask_embedding(table, ids, np.ones_like(ids)).dtype == jnp.float32
    with pytest.raises(ValueError, match="max_tokens"):
        R.subtask_embedding(table, ids, np.ones_like(ids), max_tokens=0)
    with pytest.raises(ValueError, match="token_ids"):
        R.subtask_embedding(table, ids.astype(np.float32), np.ones_like(ids))
    with pytest.raises(AssertionError):
        R.subtask_embedding(table, ids, np.ones((1, 3)))


# ------------------------------------------------------------------------------------------
# draw_routes(): jit, batching and several draws
# ------------------------------------------------------------------------------------------


def _route_inputs(n=6, t=9, d=16):
    params, _ = _params_and_emb(d_model=d)
    table = _table(d=d, seed=9)
    ids = np.random.default_rng(10).integers(0, table.shape[0], size=(n, t)).astype(np.int32)
    mask = np.arange(t)[None] < (np.arange(n) % t + 1)[:, None]
    return params, table, ids, mask


def test_route_jit_and_batching():
    params, table, ids, mask = _route_inputs()
    key = jax.random.PRNGKey(11)
    members, logp, probs = (np.asarray(x) for x in draw_routes(params, table, ids, mask, key, k=2))
    assert members.shape == (6, 1, 2) and logp.shape == (6, 1)
    members, logp = members[:, 0], logp[:, 0]
    assert members.shape == (6, 2) and members.dtype == np.int32
    assert probs.shape == (6, 4) and logp.shape == (6,)
    assert (members[:, 0] != members[:, 1]).all()

    @jax.jit
    def per_row(params, table, ids, mask, members):
        """Each subtask routed on its own (a batch of one), vmapped over the rows."""

        def one(ids_row, mask_row, members_row):
            m, approx, p = R.draw_routes(
                params, table, ids_row[None], mask_row[None], None, k=2, greedy=True, approx_set_logp=True
            )
            return m[0, 0], p[0], approx[0, 0], R.set_log_prob(p, members_row[None])[0]

        return jax.vmap(one)(ids, mask, members)

    g_members, row_probs, g_approx, row_logp = per_row(params, table, ids, mask, members)
    np.testing.assert_allclose(row_probs, probs, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(row_logp, logp, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(g_members, np.argsort(-probs, axis=1, kind="stable")[:, :2])
    approx = np.log(np.take_along_axis(probs, np.asarray(g_members), axis=1)).sum(1)
    np.testing.assert_allclose(g_approx, approx, rtol=1e-5)


def test_route_requires_key_when_sampling():
    params, table, ids, mask = _route_inputs()
    with pytest.raises(ValueError, match="key"):
        R.draw_routes(params, table, ids, mask, None, k=2, greedy=False)


def test_draw_routes_several_samples_are_independent_draws_with_their_set_likelihood():
    """S draws per subtask: each a set of k distinct experts, its log-likelihood the exact
    Plackett-Luce set probability (computed here by enumerating orders), greedy ignores S."""
    params, table, ids, mask = _route_inputs(n=3)
    members, logp, probs = (np.asarray(x) for x in draw_routes(params, table, ids, mask, jax.random.PRNGKey(3),
                                                                k=2, num_samples=5))
    assert members.shape == (3, 5, 2) and logp.shape == (3, 5) and probs.shape == (3, 4)
    assert (members[..., 0] != members[..., 1]).all()
    for n in range(3):
        for s in range(5):
            a, b = members[n, s]
            p = probs[n].astype(np.float64)
            want = p[a] * p[b] / (1 - p[a]) + p[b] * p[a] / (1 - p[b])
            np.testing.assert_allclose(logp[n, s], np.log(want), rtol=1e-5)
    g_members, g_logp, _ = draw_routes(params, table, ids, mask, None, k=2, num_samples=5, greedy=True)
    assert g_members.shape == (3, 1, 2) and g_logp.shape == (3, 1)
