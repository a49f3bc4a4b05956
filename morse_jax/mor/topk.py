"""The top-k selection mask MoR's routers use, as elementwise comparisons (no sort).

``topk_mask(x, k)`` marks the k largest entries along the last axis with the tie rule of
``jax.lax.top_k`` (among equal values the lower index is taken first): entry i is kept iff fewer
than k entries beat it, where j beats i when ``x_j > x_i`` or (``x_j == x_i`` and j < i). Every
entry gets a distinct rank 0..E-1 under this order, so exactly k are kept, the same set
``lax.top_k`` returns. Built from an [..., E, E] comparison that XLA fuses with its neighbours;
MoR's groups are small (E <= 4 in the paper), where this is cheaper than ``lax.top_k``'s sort (a
separate, unfusable op per router on CPU). Inputs must not contain NaN (router logits and
probabilities never do).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def topk_mask(x: jax.Array, k: int) -> jax.Array:
    """bool[..., E], True on the ``k`` largest of ``x`` [..., E] along the last axis (ties: lower
    index first, as ``jax.lax.top_k``); 1 <= k <= E."""
    e = x.shape[-1]
    if not 1 <= k <= e:
        raise ValueError(f"topk_mask: k must be in [1, {e}], got {k}")
    if k == e:
        return jnp.ones(x.shape, bool)
    x = jax.lax.stop_gradient(x)
    xi, xj = x[..., :, None], x[..., None, :]  # [..., i, j]
    earlier = jnp.arange(e)[None, :] < jnp.arange(e)[:, None]  # j < i
    beaten_by = jnp.sum((xj > xi) | ((xj == xi) & earlier), axis=-1)  # rank of i, 0 = largest
    return beaten_by < k
