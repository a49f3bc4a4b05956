"""Native CPU kernels (C++, XLA FFI) for the sampler's decode step, built at first use.

``native.py`` builds and registers them; ``unavailable_reason()`` says whether they can run
here (CPU backend, a C++ compiler, a successful build).
"""

from __future__ import annotations

import jax

from morse_jax.kernels import block_matmul as _block_matmul, cpu_matmul, decode_attention as _attention, topk as _topk
from morse_jax.kernels.cpu_matmul import matmul_cols
from morse_jax.kernels.decode_attention import decode_attention
from morse_jax.kernels.native import KernelBuildError
from morse_jax.kernels.topk import top_k


def ensure_registered(vec_bytes: int | None = None) -> None:
    """Build (first use on this machine) and register every kernel; raises ``KernelBuildError``.
    ``vec_bytes``: a build forced to that SIMD width (see ``native``), registered alongside."""
    cpu_matmul.ensure_registered(vec_bytes)
    _attention.ensure_registered(vec_bytes)
    _topk.ensure_registered(vec_bytes)
    _block_matmul.ensure_registered(vec_bytes)


def unavailable_reason() -> str | None:
    """None when the kernels can run here, otherwise why not (one line)."""
    if jax.default_backend() != "cpu":
        return f"the default backend is {jax.default_backend()}, not cpu"
    try:
        ensure_registered()
    except KernelBuildError as e:
        return str(e).splitlines()[0]
    return None


__all__ = ["KernelBuildError", "decode_attention", "ensure_registered", "matmul_cols", "top_k", "unavailable_reason"]
