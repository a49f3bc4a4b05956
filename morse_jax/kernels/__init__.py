"""Native CPU kernels (C++, XLA FFI), built at first use; see ``native.py`` for the build."""

from morse_jax.kernels.cpu_matmul import ensure_registered, matmul_cols, unavailable_reason
from morse_jax.kernels.native import KernelBuildError

__all__ = ["KernelBuildError", "ensure_registered", "matmul_cols", "unavailable_reason"]
