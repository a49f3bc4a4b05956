"""models.head_logprobs: log softmax(LM head(h))[target] and its gradient w.r.t. h, against the
definition evaluated in float64 numpy (not against the code's own formula)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from morse_jax.models.config import ModelConfig
from morse_jax.models.head_logprobs import head_token_logprobs

V, D = 61, 12


def _cfg(tied: bool, cap: float | None) -> ModelConfig:
    return ModelConfig(family="llama", vocab_size=V, hidden_size=D, intermediate_size=16, num_layers=1, num_heads=2,
                       num_kv_heads=1, head_dim=6, tie_embeddings=tied, final_logit_softcap=cap)


def _params(rng, tied: bool) -> dict:
    p = {"embed": rng.normal(size=(V, D)).astype(np.float32)}
    if not tied:
        p["lm_head"] = rng.normal(size=(D, V)).astype(np.float32)
    return p


def _reference(params, tied, cap, h, t, g):
    """float64: lp = log softmax(z)[t] with z = cap*tanh(hW/cap) (or hW); d(sum g*lp)/dh by the
    chain rule written out: g * (onehot(t) - softmax(z)) * dz/du @ W^T."""
    W = np.asarray(params["embed"], np.float64).T if tied else np.asarray(params["lm_head"], np.float64)  # [d, V]
    h = np.asarray(h, np.float64)
    u = h @ W
    z = cap * np.tanh(u / cap) if cap else u
    zmax = z.max(-1, keepdims=True)
    logsm = z - zmax - np.log(np.exp(z - zmax).sum(-1, keepdims=True))
    lp = np.take_along_axis(logsm, t[..., None], -1)[..., 0]
    onehot = np.eye(V)[t]
    dz = onehot - np.exp(logsm)
    if cap:
        dz = dz * (1 - np.tanh(u / cap) ** 2)
    return lp, (g[..., None] * dz) @ W.T


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("cap", [None, 3.0])
@pytest.mark.parametrize("chunk_rows", [None, 1, 4, 5, 64])
def test_values_and_gradient_match_the_definition(tied, cap, chunk_rows):
    rng = np.random.default_rng(7)
    params = _params(rng, tied)
    h = rng.normal(size=(3, 7, D)).astype(np.float32)  # 21 positions: chunks of 4 and 5 leave a tail
    t = rng.integers(0, V, size=(3, 7)).astype(np.int32)
    g = rng.normal(size=(3, 7)).astype(np.float32)
    cfg = _cfg(tied, cap)
    lp = head_token_logprobs(params, cfg, jnp.asarray(h), jnp.asarray(t), chunk_rows=chunk_rows)
    grad = jax.grad(lambda x: jnp.sum(head_token_logprobs(params, cfg, x, jnp.asarray(t), chunk_rows=chunk_rows)
                                      * g))(jnp.asarray(h))
    want_lp, want_grad = _reference(params, tied, cap, h, t, g)
    assert lp.shape == (3, 7) and lp.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(lp), want_lp, rtol=1e-5, atol=2e-5)
    np.testing.assert_allclose(np.asarray(grad), want_grad, rtol=1e-4, atol=2e-5)


def test_jitted_gradient_equals_eager_and_head_gets_none():
    rng = np.random.default_rng(1)
    params = _params(rng, True)
    cfg = _cfg(True, None)
    h = jnp.asarray(rng.normal(size=(10, D)).astype(np.float32))
    t = jnp.asarray(rng.integers(0, V, size=(10,)).astype(np.int32))

    def loss(x, emb):
        return jnp.sum(head_token_logprobs({"embed": emb}, cfg, x, t, chunk_rows=4) ** 2)

    gh, ge = jax.jit(jax.grad(loss, argnums=(0, 1)))(h, jnp.asarray(params["embed"]))
    gh_eager = jax.grad(loss)(h, jnp.asarray(params["embed"]))
    np.testing.assert_allclose(np.asarray(gh), np.asarray(gh_eager), rtol=1e-6, atol=1e-7)
    # the head is frozen by definition (entered through stop_gradient): its gradient is zero
    assert not np.any(np.asarray(ge))


def test_bad_input_is_refused():
    rng = np.random.default_rng(2)
    params, cfg = _params(rng, True), _cfg(True, None)
    h = jnp.zeros((4, D), jnp.float32)
    with pytest.raises(AssertionError):
        head_token_logprobs(params, cfg, h, jnp.zeros((5,), jnp.int32))
    with pytest.raises(ValueError, match="chunk_rows"):
        head_token_logprobs(params, cfg, h, jnp.zeros((4,), jnp.int32), chunk_rows=0)
