"""``jax.lax.top_k`` over the last axis of a float32 matrix through the native kernel in ``topk.cc``.

The sampler's token selection takes the ``k_cap`` best logits of every row each decode step;
XLA's CPU top-k sorts far more than it keeps (3.3 of a 71 ms step at batch 16 on SmolLM2's
49152-token vocabulary). The kernel selects through block maxima and sorts only the few hundred
entries that can be among the k. Same values, indices and order as ``lax.top_k`` (descending,
ties by the lower index, NaN first). CPU, unsharded, no autodiff: generation only.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from morse_jax.kernels import native

TARGET = "morse_top_k"


def ensure_registered(vec_bytes: int | None = None) -> None:
    """Build (first use on this machine) and register the kernel; raises ``KernelBuildError``.
    ``vec_bytes`` forces the SIMD width (``native.build``; tests, benchmarks)."""
    native.register("topk", "MorseTopK", TARGET, vec_bytes)


def top_k(x: jax.Array, k: int, *, vec_bytes: int | None = None) -> tuple[jax.Array, jax.Array]:
    """The ``k`` largest entries of each row: (float32[B, k] descending, int32[B, k] indices).

    Args: x float32[B, V]; 1 <= k <= V. Call ``morse_jax.kernels.ensure_registered()`` first.
    """
    if x.ndim != 2 or x.dtype != jnp.float32:
        raise ValueError(f"top_k expects float32 [B, V], got {x.dtype} {x.shape}")
    if not 1 <= k <= x.shape[1]:
        raise ValueError(f"top_k: k must be in [1, {x.shape[1]}], got {k}")
    out = (jax.ShapeDtypeStruct((x.shape[0], k), jnp.float32), jax.ShapeDtypeStruct((x.shape[0], k), jnp.int32))
    return jax.ffi.ffi_call(native.target_name(TARGET, vec_bytes), out)(x)
