"""Token log-probs through the LM head with a memory-light gradient: log softmax(head(h))[target].

The RL update needs, per generated token, ``log p(target) = z[target] - logsumexp(z)`` with
``z = softcap(h @ W)`` over the whole vocabulary, and its gradient w.r.t. ``h`` only (the head
``W`` is frozen). Left to autodiff, the backward pass keeps the [N, V] logits, rebuilds the
softmax, and scatters the target's one-hot into a zero-filled [N, V] buffer: at N = 1536
positions of SmolLM2's V = 49152 that is ~0.9 GB of temporaries per micro-batch, every byte of
it page-faulted afresh each step on CPU.

Here the gradient is known in closed form per position,

    d log p(t) / d h = (onehot(t) - softmax(z)) * softcap'(z)  @  W^T      (a [d] vector),

so the forward pass of the differentiated function computes it next to the log-prob (the same
second [N, V] x [V, d] product autodiff would run in the backward pass) and keeps only that
[N, d] Jacobian; the backward pass scales it by the incoming cotangent. Both passes walk the
positions in chunks (``chunk_rows``), so the [N, V] logits never exist at once. Without
differentiation the plain function runs: the logits product, logsumexp and the picked logit
only. The head enters through ``stop_gradient``: its cotangent is zero by definition here.
"""

from __future__ import annotations

import functools

import chex
import jax
import jax.numpy as jnp

from morse_jax.models.config import ModelConfig
from morse_jax.models.layers import soft_cap

# Logits per chunk: 2**24 float32 = 64 MiB (256 positions of a 49152-token vocabulary)
CHUNK_LOGITS = 1 << 24


def head_token_logprobs(params: dict, cfg: ModelConfig, hidden: jax.Array, targets: jax.Array, *,
                        chunk_rows: int | None = None) -> jax.Array:
    """log softmax(LM head(hidden))[target]: float32[...] for final-normed ``hidden`` [..., d]
    and ``targets`` int32[...] (tokens in [0, V)).

    Same values as ``log_softmax(transformer.lm_head(params, cfg, hidden))[target]`` (the logits
    product in the params' dtype, soft-cap and softmax in float32); differentiable in ``hidden``
    only. ``chunk_rows``: positions per chunk (default: the power of two that keeps a chunk's
    logits at ``CHUNK_LOGITS`` entries, at least 16).
    """
    tied = cfg.tie_embeddings
    head = params["embed"] if tied else params["lm_head"]  # [V, d] tied, [d, V] untied
    vocab = head.shape[0] if tied else head.shape[1]
    chex.assert_equal(hidden.shape[:-1], targets.shape)
    chex.assert_equal(hidden.shape[-1], cfg.hidden_size)
    if chunk_rows is None:
        chunk_rows = max(16, 1 << max(0, (CHUNK_LOGITS // vocab).bit_length() - 1))
    if chunk_rows < 1:
        raise ValueError(f"chunk_rows must be positive, got {chunk_rows}")
    lead = targets.shape
    h = hidden.reshape(-1, hidden.shape[-1])  # [N, d]
    t = targets.reshape(-1).astype(jnp.int32)  # [N]
    n = h.shape[0]
    rows = min(chunk_rows, max(n, 1))
    pad = -n % rows
    h = jnp.pad(h, ((0, pad), (0, 0)))  # [Np, d], padded rows give finite values, dropped below
    t = jnp.pad(t, (0, pad))  # [Np]
    fn = _logprobs_fn(bool(tied), float(cfg.final_logit_softcap or 0.0), rows)
    lp = fn(h.reshape(-1, rows, h.shape[-1]), t.reshape(-1, rows), jax.lax.stop_gradient(head))  # [C, rows]
    return lp.reshape(-1)[:n].reshape(lead)


def _logits(h: jax.Array, head: jax.Array, tied: bool, cap: float) -> jax.Array:
    """[c, d] -> float32 [c, V]: the product in the operands' dtype (as ``lm_head``), then capped."""
    z = jnp.einsum("cd,vd->cv", h, head) if tied else jnp.einsum("cd,dv->cv", h, head)  # [c, V]
    return soft_cap(z.astype(jnp.float32), cap)


def _chunk_logprobs(h: jax.Array, t: jax.Array, head: jax.Array, tied: bool, cap: float) -> jax.Array:
    """One chunk's log-probs: float32[c] for h [c, d], t int32[c]."""
    z = _logits(h, head, tied, cap)  # [c, V]
    picked = jnp.take_along_axis(z, t[:, None], axis=1)[:, 0]  # [c]
    return picked - jax.nn.logsumexp(z, axis=1)


def _chunk_logprobs_and_jacobian(h: jax.Array, t: jax.Array, head: jax.Array, tied: bool,
                                 cap: float) -> tuple[jax.Array, jax.Array]:
    """One chunk's log-probs float32[c] and d logp / d h [c, d] (in h's dtype)."""
    z = _logits(h, head, tied, cap)  # [c, V]
    m = jnp.max(z, axis=1, keepdims=True)  # [c, 1]
    e = jnp.exp(z - m)  # [c, V]
    s = jnp.sum(e, axis=1, keepdims=True)  # [c, 1]
    picked = jnp.take_along_axis(z, t[:, None], axis=1)[:, 0]  # [c]
    lp = picked - (m[:, 0] + jnp.log(s[:, 0]))  # [c]
    onehot = jnp.arange(z.shape[1], dtype=jnp.int32)[None, :] == t[:, None]  # [c, V]
    dz = jnp.where(onehot, 1.0, 0.0) - e / s  # d logp / d z, [c, V]
    if cap:  # z = cap * tanh(u / cap): dz/du = 1 - tanh^2 = 1 - (z / cap)^2
        dz = dz * (1.0 - jnp.square(z / cap))
    dz = dz.astype(h.dtype)  # what autodiff's transpose of the float32 cast hands the product
    jac = jnp.einsum("cv,vd->cd", dz, head) if tied else jnp.einsum("cv,dv->cd", dz, head)  # [c, d]
    return lp, jac


@functools.lru_cache(maxsize=None)
def _logprobs_fn(tied: bool, cap: float, rows: int):
    """The chunked function with its custom VJP, for one head layout, soft-cap and chunk size.

    Arguments: h [C, rows, d], t int32[C, rows], head (no gradient); result float32[C, rows].
    """

    def plain(h, t, head):
        return jax.lax.map(lambda ht: _chunk_logprobs(ht[0], ht[1], head, tied, cap), (h, t))

    @jax.custom_vjp
    def f(h, t, head):
        return plain(h, t, head)

    def fwd(h, t, head):
        lp, jac = jax.lax.map(lambda ht: _chunk_logprobs_and_jacobian(ht[0], ht[1], head, tied, cap), (h, t))
        return lp, (jac, t, head)

    def bwd(res, g):  # g: float32[C, rows], the cotangent of the log-probs
        jac, t, head = res
        dh = (g[..., None] * jac).astype(jac.dtype)  # [C, rows, d]
        # targets are integers (float0 cotangent); the head is frozen (entered via stop_gradient)
        return dh, jnp.zeros(t.shape, jax.dtypes.float0), jnp.zeros_like(head)

    f.defvjp(fwd, bwd)
    return f
