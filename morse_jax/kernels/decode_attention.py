"""One decode step's attention on CPU through the native kernel in ``decode_attention.cc``.

``decode_attention(q, keys, values, mask, scale)`` computes, for every (batch row, kv head)
group, ``softmax(scale * q . k)`` over the slots ``mask`` allows and the weighted sum of the
values, in float32, reading each group's cache once and only over the key tiles from its first to its last valid slot. The
layouts are :mod:`morse_jax.models.decode`'s. No logit soft-capping (Gemma 2's attention
cap): callers keep XLA's path for such models. Generation only: no autodiff, CPU, unsharded.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from morse_jax.kernels import native

TARGET = "morse_decode_attention"


def ensure_registered(vec_bytes: int | None = None) -> None:
    """Build (first use on this machine) and register the kernel; raises ``KernelBuildError``.
    ``vec_bytes`` forces the SIMD width (``native.build``; tests, benchmarks)."""
    native.register("decode_attention", "MorseDecodeAttention", TARGET, vec_bytes)


def decode_attention(q: jax.Array, keys: jax.Array, values: jax.Array, mask: jax.Array, scale: float, *,
                     vec_bytes: int | None = None) -> jax.Array:
    """Attention of one new token per row.

    Args:
      q: float32[B*K, G, D] (G query heads per kv head). keys: float32[B*K, S/T, D, T]: the slots
        in tiles of T (a multiple of 16; ``models.key_tiles.tile_keys``), the last tile padded.
      values: float32[B*K, S, D]. mask: bool[B, S], True where a slot may be attended.
      scale: the score scale (1/sqrt(D) for most models).
    Returns:
      float32[B*K, G, D]. A row whose mask is all False (padding) gets zeros.

    Call ``morse_jax.kernels.ensure_registered()`` first (once per process); with ``vec_bytes``
    (the build forced to that SIMD width), ``decode_attention.ensure_registered(vec_bytes)``.
    """
    N, G, D = q.shape
    B, S = mask.shape
    tiled = keys.ndim == 4 and keys.shape[0] == N and keys.shape[2] == D and keys.shape[3] % 16 == 0 \
        and keys.shape[1] == -(-S // max(keys.shape[3], 1))
    if not tiled or values.shape != (N, S, D) or B == 0 or N % B:
        raise ValueError(f"decode_attention: expects q [N, G, D], keys [N, S/T, D, T] (T a multiple of 16), "
                         f"values [N, S, D], mask [B, S] with N a multiple of B; got {q.shape}, {keys.shape}, "
                         f"{values.shape}, {mask.shape}")
    if any(x.dtype != jnp.float32 for x in (q, keys, values)) or mask.dtype != jnp.bool_:
        raise ValueError(f"decode_attention: float32 q/keys/values and a bool mask, got "
                         f"{q.dtype}, {keys.dtype}, {values.dtype}, {mask.dtype}")
    out = jax.ShapeDtypeStruct((N, G, D), jnp.float32)
    return jax.ffi.ffi_call(native.target_name(TARGET, vec_bytes), out)(q, keys, values, mask,
                                                                        scale=np.float32(scale))
