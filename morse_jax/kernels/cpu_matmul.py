"""``W @ X`` for decode steps on CPU through the native kernel in ``cpu_matmul.cc``.

``matmul_cols(w, x)`` is a drop-in for ``w @ x`` with float32 ``w [N, K]`` and a few columns
``x [K, B]`` (a decode step's activations, features first). It is an XLA custom call, so it runs
inside jit and ``lax.while_loop`` like any op, but only on the CPU backend, unsharded, without
autodiff: the sampler uses it for generation only (``SamplerConfig.cpu_kernels``), and the
trainer keeps XLA's differentiable dots.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from morse_jax.kernels import native

TARGET = "morse_cpu_matmul"


def ensure_registered(vec_bytes: int | None = None) -> None:
    """Build (first use on this machine) and register the kernel; raises ``KernelBuildError``.
    ``vec_bytes`` forces the SIMD width (``native.build``; tests, benchmarks)."""
    native.register("cpu_matmul", "MorseCpuMatmul", TARGET, vec_bytes)


def matmul_cols(w: jax.Array, x: jax.Array, *, vec_bytes: int | None = None) -> jax.Array:
    """``w @ x`` for w float32[N, K], x float32[K, B] -> float32[N, B] (native CPU kernel).

    Call ``morse_jax.kernels.ensure_registered()`` first (once per process); with ``vec_bytes``
    (the build forced to that SIMD width), ``ensure_registered(vec_bytes)``.
    """
    if w.ndim != 2 or x.ndim != 2 or w.shape[1] != x.shape[0]:
        raise ValueError(f"matmul_cols expects w [N, K] and x [K, B], got {w.shape} and {x.shape}")
    if w.dtype != jnp.float32 or x.dtype != jnp.float32:
        raise ValueError(f"matmul_cols is float32 only, got {w.dtype} and {x.dtype}")
    out = jax.ShapeDtypeStruct((w.shape[0], x.shape[1]), jnp.float32)
    return jax.ffi.ffi_call(native.target_name(TARGET, vec_bytes), out)(w, x)
