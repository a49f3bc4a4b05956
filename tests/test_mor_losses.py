"""MoR's losses against hand computations in numpy (float64), written from the formulas in the
module docstring of morse_jax.mor.losses."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from morse_jax.mor import losses

ROLES = ("reasoner", "executor", "summarizer")


def _np_log_softmax(x):
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def _np_softmax(x):
    return np.exp(_np_log_softmax(x))


def test_role_ce_matches_a_token_loop():
    rng = np.random.default_rng(0)
    B, T, V = 2, 7, 11
    logits = rng.normal(size=(B, T, V)).astype(np.float32)
    tokens = rng.integers(0, V, size=(B, T))
    role_ids = np.array([[-1, -1, 0, 0, 1, 1, -1], [-1, 0, 0, -1, 2, 2, 2]])
    loss_mask = role_ids >= 0
    loss_mask[1, 6] = False  # a role token that is not a target
    loss, m = losses.role_ce(jnp.asarray(logits), jnp.asarray(tokens), jnp.asarray(loss_mask), jnp.asarray(role_ids),
                             ROLES)
    per_role = {r: [] for r in range(3)}
    hits = {r: [] for r in range(3)}
    for b in range(B):
        for t in range(1, T):  # token t is predicted from position t - 1
            if loss_mask[b, t]:
                lp = _np_log_softmax(logits[b, t - 1].astype(np.float64))
                per_role[role_ids[b, t]].append(-lp[tokens[b, t]])
                hits[role_ids[b, t]].append(float(np.argmax(lp) == tokens[b, t]))
    every = sum(per_role.values(), [])
    np.testing.assert_allclose(loss, np.mean(every), rtol=1e-5)
    assert m["tokens"] == len(every) == 8
    for r, name in enumerate(ROLES):
        np.testing.assert_allclose(m[f"ce/{name}"], np.mean(per_role[r]), rtol=1e-5)
        np.testing.assert_allclose(m[f"acc/{name}"], np.mean(hits[r]))
        assert m[f"tokens/{name}"] == len(per_role[r])
    # no target at all: zero loss, zero counts (no NaN)
    none = losses.role_ce(jnp.asarray(logits), jnp.asarray(tokens), jnp.zeros((B, T), bool), jnp.asarray(role_ids),
                          ROLES)
    assert none[0] == 0 and all(np.isfinite(v) for v in none[1].values())


def _np_balance(logits, mask, k):
    """E Σ_i f_i P_i per router (first axis), averaged: f from top-k counts, P from probabilities."""
    out = []
    for lg in logits.astype(np.float64):
        p = _np_softmax(lg)[mask]  # [n, E]
        n, E = p.shape
        s = np.zeros_like(p)
        for t in range(n):
            s[t, np.argsort(-p[t], kind="stable")[:k]] = 1
        f = s.sum(0) / (n * k)
        P = p.sum(0) / n
        out.append(E * (f * P).sum())
    return np.mean(out)


def test_balance_loss_matches_hand_computation():
    rng = np.random.default_rng(1)
    L, B, T, E, k = 3, 2, 5, 4, 3
    logits = rng.normal(size=(L, B, T, E)).astype(np.float32)
    mask = rng.random((B, T)) < 0.6
    got = losses.balance_loss(jnp.asarray(logits), jnp.asarray(mask), k)
    np.testing.assert_allclose(got, _np_balance(logits, mask, k), rtol=1e-5)
    # hand example, E = 2, k = 1: probs (0.9, 0.1) and (0.6, 0.4): both pick expert 0 ->
    # f = (1, 0), P = (0.75, 0.25), loss = 2 * 0.75 = 1.5
    lg = np.log(np.array([[[[0.9, 0.1], [0.6, 0.4]]]], np.float32))
    np.testing.assert_allclose(losses.balance_loss(jnp.asarray(lg), jnp.ones((1, 2), bool), 1), 1.5, rtol=1e-6)
    # balanced routing scores 1: probs (0.6, 0.4) and (0.4, 0.6) -> f = P = (0.5, 0.5), 2 * 0.5 = 1
    lg = np.log(np.array([[[[0.6, 0.4], [0.4, 0.6]]]], np.float32))
    np.testing.assert_allclose(losses.balance_loss(jnp.asarray(lg), jnp.ones((1, 2), bool), 1), 1.0, rtol=1e-5)
    assert losses.balance_loss(jnp.asarray(logits), jnp.zeros((B, T), bool), k) == 0
    with pytest.raises(ValueError, match="top_k"):
        losses.balance_loss(jnp.asarray(logits), jnp.asarray(mask), E + 1)


def test_balance_gradient_flows_through_probabilities_only():
    rng = np.random.default_rng(2)
    logits = jnp.asarray(rng.normal(size=(2, 1, 6, 4)), jnp.float32)
    mask = jnp.asarray(rng.random((1, 6)) < 0.7)
    k = 2
    probs = jax.nn.softmax(logits, -1)
    m = mask[None, ..., None].astype(jnp.float32)
    n = mask.sum()
    _, idx = jax.lax.top_k(probs, k)
    f = np.asarray((jax.nn.one_hot(idx, 4).sum(-2) * m).sum((1, 2)) / (n * k))  # a constant

    def reference(lg):
        P = (jax.nn.softmax(lg, -1) * m).sum((1, 2)) / n
        return jnp.mean(4 * (f * P).sum(-1))

    np.testing.assert_allclose(jax.grad(lambda lg: losses.balance_loss(lg, mask, k))(logits),
                               jax.jit(jax.grad(reference))(logits), atol=1e-7)


def test_mor_balance_loss_sums_roles_over_their_own_tokens():
    rng = np.random.default_rng(3)
    role_ids = np.array([[-1, 0, 0, 1, 1, 2], [0, 1, 2, 2, -1, -1]])
    sizes, top_k = (4, 4, 3), (3, 3, 2)
    logits = [rng.normal(size=(2, 2, 6, e)).astype(np.float32) for e in sizes]
    got = losses.mor_balance_loss([jnp.asarray(x) for x in logits], jnp.asarray(role_ids), top_k)
    want = sum(_np_balance(lg, role_ids == r, k) for r, (lg, k) in enumerate(zip(logits, top_k)))
    np.testing.assert_allclose(got, want, rtol=1e-5)


def test_router_stats():
    rng = np.random.default_rng(4)
    logits = rng.normal(size=(2, 2, 5, 4)).astype(np.float32)
    mask = rng.random((2, 5)) < 0.6
    s = losses.router_stats(jnp.asarray(logits), jnp.asarray(mask), 2)
    p = _np_softmax(logits.astype(np.float64))[:, mask]  # [L, n, E]
    slots = np.zeros_like(p)
    for li in range(p.shape[0]):
        for t in range(p.shape[1]):
            slots[li, t, np.argsort(-p[li, t], kind="stable")[:2]] = 1
    np.testing.assert_allclose(s["load"], (slots.sum(1) / (mask.sum() * 2)).mean(0), rtol=1e-5)
    np.testing.assert_allclose(s["importance"], p.mean(1).mean(0), rtol=1e-5)
    np.testing.assert_allclose(s["entropy"], (-(p * np.log(p)).sum(-1)).mean(), rtol=1e-5)
    np.testing.assert_allclose(s["load"].sum(), 1.0, rtol=1e-6)
    uniform = losses.router_stats(jnp.zeros((1, 1, 3, 4)), jnp.ones((1, 3), bool), 1)
    np.testing.assert_allclose(uniform["entropy"], np.log(4), rtol=1e-6)


def _np_cos_sq(a, b, eps):
    """Materialised ΔW_i = A_i B_i in float64."""
    dw = np.einsum("...edr,...ero->...edo", a.astype(np.float64), b.astype(np.float64))
    E = dw.shape[-3]
    out = np.zeros(dw.shape[:-3] + (E, E))
    for i in range(E):
        for j in range(E):
            inner = (dw[..., i, :, :] * dw[..., j, :, :]).sum((-2, -1))
            ni = (dw[..., i, :, :] ** 2).sum((-2, -1))
            nj = (dw[..., j, :, :] ** 2).sum((-2, -1))
            out[..., i, j] = inner ** 2 / (ni * nj + eps)
    return out


def test_orthogonality_matches_materialised_delta_w():
    rng = np.random.default_rng(5)
    L, E, d_in, r, d_out = 3, 4, 6, 2, 5
    a = rng.normal(size=(L, E, d_in, r))
    b = rng.normal(size=(L, E, r, d_out))
    want = _np_cos_sq(a, b, losses.ORTH_EPS)
    np.testing.assert_allclose(losses.lora_cosine_sq(jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32)), want,
                               rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(np.diagonal(want, axis1=-2, axis2=-1), 1.0, rtol=1e-9)
    iu = np.triu_indices(E, 1)
    np.testing.assert_allclose(losses.orthogonality_loss(jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32)),
                               want[:, iu[0], iu[1]].mean(), rtol=1e-4)
    groups = [(a, b), (a[:, :3], b[:, :3])]  # two roles' groups (4 and 3 routed LoRAs)

    def pair_mean(x, y):
        i, j = np.triu_indices(x.shape[1], 1)
        return _np_cos_sq(x, y, losses.ORTH_EPS)[:, i, j].mean()

    got = losses.mor_orthogonality_loss([(jnp.asarray(x, jnp.float32), jnp.asarray(y, jnp.float32))
                                         for x, y in groups])
    np.testing.assert_allclose(got, sum(pair_mean(x, y) for x, y in groups), rtol=1e-4)


def test_orthogonality_gradient_matches_materialised_delta_w():
    """The Gram blocks' written-out gradient (losses.gram_blocks) against autodiff of the
    definition with ΔW_i = A_i B_i materialised."""
    rng = np.random.default_rng(7)
    L, E, d_in, r, d_out = 2, 4, 7, 3, 5
    a = jnp.asarray(rng.normal(size=(L, E, d_in, r)), jnp.float32)
    b = jnp.asarray(rng.normal(size=(L, E, r, d_out)), jnp.float32)

    def definition(a, b):
        dw = jnp.einsum("ledr,lero->ledo", a, b)
        inner = jnp.einsum("lido,ljdo->lij", dw, dw)
        sq = jnp.einsum("lido,lido->li", dw, dw)
        c2 = inner ** 2 / (sq[:, :, None] * sq[:, None, :] + losses.ORTH_EPS)
        i, j = np.triu_indices(E, 1)
        return jnp.mean(c2[:, i, j])

    got = jax.grad(losses.orthogonality_loss, argnums=(0, 1))(a, b)
    want = jax.grad(definition, argnums=(0, 1))(a, b)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=2e-4, atol=1e-6 * float(jnp.max(jnp.abs(w))))
    x = jnp.asarray(rng.normal(size=(3, E, d_in, r)), jnp.float32)  # and the Gram alone, any cotangent
    ct = jnp.asarray(rng.normal(size=(3, E, E, r, r)), jnp.float32)
    np.testing.assert_allclose(jax.vjp(losses.gram_blocks, x)[1](ct)[0],
                               jax.vjp(lambda x: jnp.einsum("...idr,...jds->...ijrs", x, x), x)[1](ct)[0],
                               rtol=1e-5, atol=1e-5)


def test_orthogonality_extremes_and_zero_init():
    rng = np.random.default_rng(6)
    d_in, r, d_out = 8, 2, 6
    a0, b0 = rng.normal(size=(d_in, r)), rng.normal(size=(r, d_out))
    # same direction (rescaled copies) -> 1; disjoint row spaces of A -> 0
    a = np.stack([a0, 3 * a0])
    b = np.stack([b0, -0.5 * b0])
    np.testing.assert_allclose(losses.orthogonality_loss(jnp.asarray(a), jnp.asarray(b)), 1.0, rtol=1e-5)
    a = np.zeros((2, d_in, r))
    a[0, :4], a[1, 4:] = rng.normal(size=(4, r)), rng.normal(size=(4, r))
    assert abs(float(losses.orthogonality_loss(jnp.asarray(a), jnp.asarray(np.stack([b0, b0]))))) < 1e-10
    # B = 0 (initialisation): loss 0 and a finite, zero gradient
    a = jnp.asarray(rng.normal(size=(2, 4, d_in, r)), jnp.float32)
    zero_b = jnp.zeros((2, 4, r, d_out))
    assert losses.orthogonality_loss(a, zero_b) == 0
    g = jax.grad(losses.orthogonality_loss, argnums=(0, 1))(a, zero_b)
    assert all(np.all(np.asarray(x) == 0) for x in g)
    g = jax.grad(losses.orthogonality_loss, argnums=1)(a, 1e-6 * jnp.asarray(rng.normal(size=(2, 4, r, d_out))))
    assert np.all(np.isfinite(np.asarray(g)))


def test_total_loss_weights():
    assert losses.ALPHA_BALANCE == 1e-3 and losses.ALPHA_ORTH == 1e-4  # paper §4.2
    np.testing.assert_allclose(losses.total_loss(2.0, 1.5, 0.25), 2.0 + 1e-3 * 1.5 + 1e-4 * 0.25)
