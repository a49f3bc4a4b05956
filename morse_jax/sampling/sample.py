"""Token selection from logits: temperature, top-k, top-p, greedy, per row.

All functions are pure and jittable; per-row settings are arrays so one compiled decode step
serves any mix of settings.
"""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp

NEG = -1e30


def truncated_logits(logits: jax.Array, temperature: jax.Array, top_k: jax.Array, top_p: jax.Array,
                     k_cap: int) -> tuple[jax.Array, jax.Array]:
    """Candidate logits after temperature, top-k and top-p, restricted to the ``k_cap`` best tokens.

    A full-vocabulary sort is far slower than ``lax.top_k`` on CPU (DESIGN §6), so nucleus
    filtering runs inside the top-``k_cap`` candidates.

    Args:
      logits: float32[B, V]. temperature: float32[B] (> 0). top_k: int32[B] (0 = no limit, i.e.
        k_cap). top_p: float32[B] in (0, 1].
    Returns:
      (cand_logits float32[B, k_cap] with NEG for excluded candidates, cand_ids int32[B, k_cap]).
    """
    chex.assert_rank(logits, 2)
    vals, ids = jax.lax.top_k(logits, k_cap)
    vals = vals / jnp.maximum(temperature, 1e-6)[:, None]
    rank = jnp.arange(k_cap)[None, :]
    k_eff = jnp.where(top_k > 0, jnp.minimum(top_k, k_cap), k_cap)
    vals = jnp.where(rank < k_eff[:, None], vals, NEG)
    probs = jax.nn.softmax(vals, axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs  # mass strictly before each candidate
    keep = (before < top_p[:, None]) | (rank == 0)
    return jnp.where(keep, vals, NEG), ids


def sample_tokens(key: jax.Array, logits: jax.Array, temperature: jax.Array, top_k: jax.Array, top_p: jax.Array,
                  *, k_cap: int = 256, full_vocab: bool = False) -> jax.Array:
    """Sample one token per row. temperature <= 0 means greedy (argmax).

    Rows with top_k == 0 and top_p >= 1 sample from the full vocabulary when ``full_vocab`` is set
    (Gumbel-max over all logits); otherwise from the top-``k_cap`` candidates.
    Returns int32[B].
    """
    B, V = logits.shape
    k_cap = min(k_cap, V)
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    k1, k2 = jax.random.split(key)
    cand, ids = truncated_logits(logits, temperature, top_k, top_p, k_cap)
    gumbel = jax.random.gumbel(k1, cand.shape)
    choice = jnp.argmax(cand + gumbel, axis=-1)
    sampled = jnp.take_along_axis(ids, choice[:, None], axis=-1)[:, 0].astype(jnp.int32)
    if full_vocab:
        untruncated = (top_k == 0) & (top_p >= 1.0)
        scaled = logits / jnp.maximum(temperature, 1e-6)[:, None]
        full = jnp.argmax(scaled + jax.random.gumbel(k2, logits.shape), axis=-1).astype(jnp.int32)
        sampled = jnp.where(untruncated, full, sampled)
    return jnp.where(temperature > 0, sampled, greedy)


def token_log_prob(logits: jax.Array, tokens: jax.Array) -> jax.Array:
    """log softmax(logits)[token] at temperature 1: float32[B] (the behaviour log-prob for PPO)."""
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    return jnp.take_along_axis(logp, tokens[:, None], axis=-1)[:, 0]
