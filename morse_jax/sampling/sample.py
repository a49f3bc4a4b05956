"""Token selection from logits: temperature, top-k, top-p, greedy, per row.

All functions are pure and jittable; per-row settings are arrays so one compiled decode step
serves any mix of settings.
"""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp

from morse_jax import kernels

NEG = -1e30


def truncated_logits(logits: jax.Array, temperature: jax.Array, top_k: jax.Array, top_p: jax.Array,
                     k_cap: int) -> tuple[jax.Array, jax.Array]:
    """Candidate logits after temperature, top-k and top-p, restricted to the ``k_cap`` best tokens.

    Order and semantics follow transformers: temperature, then top-k, then top-p over the
    distribution renormalised after top-k. A full-vocabulary sort is far slower than
    ``lax.top_k`` on CPU (DESIGN §6), so the nucleus is searched inside the top-``k_cap``
    candidates; its cumulative mass is measured against the *full* softmax normaliser (a
    logsumexp over the vocabulary, O(V)), so the result is exact whenever the nucleus fits in
    ``k_cap`` tokens. Only a nucleus wider than ``k_cap`` is cut at ``k_cap``.

    Args:
      logits: float32[B, V]. temperature: float32[B] (> 0). top_k: int32[B] (0 = no limit).
        top_p: float32[B] in (0, 1].
    Returns:
      (cand_logits float32[B, k_cap] — tempered, NEG for excluded candidates —,
       cand_ids int32[B, k_cap]).
    """
    chex.assert_rank(logits, 2)
    vals, ids = jax.lax.optimization_barrier(jax.lax.top_k(logits, k_cap))  # see select_tokens
    cand, _ = _truncate(logits, vals, temperature, top_k, top_p)
    return cand, ids.astype(jnp.int32)


def _truncate(logits, vals, temperature, top_k, top_p):
    """(tempered candidate logits with NEG outside the kept set, log-normaliser of logits at T=1).

    ``vals``: the top-k_cap logits, descending. One pass over the vocabulary computes both the
    tempered normaliser (for top-p mass) and the T=1 one (for behaviour log-probs), shifted by
    the maximum that top-k already found.
    """
    k_cap = vals.shape[-1]
    inv_t = 1.0 / jnp.maximum(temperature, 1e-6)[:, None]
    m = vals[:, :1]
    z = logits - m
    lse_1 = m[:, 0] + jnp.log(jnp.sum(jnp.exp(z), axis=-1))
    lse_t = m[:, 0] * inv_t[:, 0] + jnp.log(jnp.sum(jnp.exp(z * inv_t), axis=-1))
    tv = vals * inv_t
    rank = jnp.arange(k_cap)[None, :]
    limited = (top_k > 0) & (top_k <= k_cap)
    k_eff = jnp.where(limited, top_k, k_cap)
    tv = jnp.where(rank < k_eff[:, None], tv, NEG)
    # Normaliser: over the top-k set when top-k applies, else over the whole vocabulary.
    norm = jnp.where(limited, jax.nn.logsumexp(tv, axis=-1), lse_t)
    probs = jnp.exp(tv - norm[:, None])
    before = jnp.cumsum(probs, axis=-1) - probs  # mass strictly before each candidate
    keep = (before < top_p[:, None]) | (rank == 0)
    return jnp.where(keep, tv, NEG), lse_1


def select_tokens(key: jax.Array, logits: jax.Array, temperature: jax.Array, top_k: jax.Array, top_p: jax.Array,
                  *, k_cap: int = 256, full_vocab: bool = True, barrier: bool = True,
                  native_top_k: bool = False) -> tuple[jax.Array, jax.Array]:
    """Sample one token per row and return it with its log-prob at temperature 1.

    temperature <= 0 means greedy (argmax). Rows with top_k == 0 and top_p >= 1 (untruncated)
    sample from the full vocabulary (Gumbel-max over all logits) when ``full_vocab`` is set, else
    from the top-``k_cap`` candidates. Work a batch does not need is skipped at run time
    (``lax.cond``): no top-k when every row is greedy, no full-vocabulary noise unless some row is
    untruncated, so one compiled step serves every mix of settings.

    ``native_top_k``: take the ``k_cap`` candidates with the native CPU kernel
    (``kernels.top_k``: same values, indices and order as ``lax.top_k``, several times faster at
    a 49k vocabulary; CPU, unsharded, kernels registered: the sampler's ``LoopConfig.native``).

    Args: key: one PRNG key, or one per row ([B] typed keys or uint32[B, 2] raw keys: each row's
      noise then comes from its own key alone, so a row draws the same token whatever the other
      rows are, which slot it sits in or how many rows the batch has); logits float32[B, V];
      temperature float32[B]; top_k int32[B]; top_p float32[B].
    Returns: (tokens int32[B], log_softmax(logits)[token] float32[B]).
    """
    chex.assert_rank(logits, 2)
    B, V = logits.shape
    k_cap = min(k_cap, V)
    logits = logits.astype(jnp.float32)
    temperature = temperature.astype(jnp.float32)
    if per_row_keys(key):
        k1, k2 = (jax.vmap(jax.random.split)(key)[:, i] for i in (0, 1))

        def gumbel(k, shape):
            return jax.vmap(lambda kr: jax.random.gumbel(kr, shape[1:]))(k)
    else:
        k1, k2 = jax.random.split(key)
        gumbel = jax.random.gumbel
    sampling = temperature > 0
    untruncated = sampling & (top_k == 0) & (top_p >= 1.0)

    def full_path(_):
        scaled = logits / jnp.maximum(temperature, 1e-6)[:, None]
        return jnp.argmax(scaled + gumbel(k2, logits.shape), axis=-1).astype(jnp.int32)

    def sampled_path(_):
        # The barrier keeps XLA from rewriting "top-k, then slice its first column" into a full
        # sort of the vocabulary (measured: 100 ms per step at batch 16 instead of 4 ms).
        if native_top_k:  # a custom call: nothing for XLA to rewrite, no barrier needed
            vals, ids = kernels.top_k(logits, k_cap)
        else:
            vals, ids = jax.lax.top_k(logits, k_cap)
            if barrier:  # off under a device mesh: XLA's SPMD partitioner aborts on a barrier inside cond
                vals, ids = jax.lax.optimization_barrier((vals, ids))
        ids = ids.astype(jnp.int32)
        cand, lse_1 = _truncate(logits, vals, temperature, top_k, top_p)
        choice = jnp.argmax(cand + gumbel(k1, cand.shape), axis=-1)
        tok = jnp.take_along_axis(ids, choice[:, None], axis=-1)[:, 0]
        if full_vocab:
            full = jax.lax.cond(jnp.any(untruncated), full_path, lambda _: tok, None)
            tok = jnp.where(untruncated, full, tok)
        return jnp.where(sampling, tok, ids[:, 0]), lse_1  # top_k breaks ties by lower index, as argmax

    def greedy_path(_):
        return jnp.argmax(logits, axis=-1).astype(jnp.int32), jax.nn.logsumexp(logits, axis=-1)

    tok, lse_1 = jax.lax.cond(jnp.any(sampling), sampled_path, greedy_path, None)
    return tok, jnp.take_along_axis(logits, tok[:, None], axis=-1)[:, 0] - lse_1


def per_row_keys(key: jax.Array) -> bool:
    """Whether ``key`` holds one PRNG key per row (typed keys [B], or raw uint32 keys [B, 2])."""
    typed = jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key)
    return key.ndim == (1 if typed else 2)


def sample_tokens(key: jax.Array, logits: jax.Array, temperature: jax.Array, top_k: jax.Array, top_p: jax.Array,
                  *, k_cap: int = 256, full_vocab: bool = True) -> jax.Array:
    """Tokens only of :func:`select_tokens`: int32[B]."""
    return select_tokens(key, logits, temperature, top_k, top_p, k_cap=k_cap, full_vocab=full_vocab)[0]


def token_log_prob(logits: jax.Array, tokens: jax.Array) -> jax.Array:
    """log softmax(logits)[token] at temperature 1: float32[B] (the behaviour log-prob for PPO)."""
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    return jnp.take_along_axis(logp, tokens[:, None], axis=-1)[:, 0]


def restrict_logits(logits: jax.Array, allowed: jax.Array) -> jax.Array:
    """float32[B, V] logits with tokens where ``allowed`` (bool[B, V]) is False at NEG (never
    sampled, never the argmax)."""
    return jnp.where(allowed, logits, NEG)
