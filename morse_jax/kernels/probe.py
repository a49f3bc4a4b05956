"""Does the native projection kernel pay on this machine? A short timing against XLA's dot.

Why: the kernels were written and measured on a 2-core AVX-512 machine, where ``matmul_cols``
beat XLA's dot (about 190 against 100 GFLOP/s at 16 columns). On another machine the same
source, built with ``-march=native``, can lose badly: on a 2-core AMD EPYC (znver3: AVX2, no
AVX-512) it ran at 1-2 GFLOP/s against XLA's 15-50, which made the sampler several times slower
than transformers. The cause is the kernels' 64-byte vector-extension type (``v16``): without
AVX-512, GCC 12 splits it into ymm halves and moves them through the stack on every iteration
(a standalone 1536x576 dot loop: 0.8 GFLOP/s with 64-byte vectors, 6.5 with 32-byte ones).
The width is now chosen per instruction set at build time (``cpu_common.h``: 32 bytes on AVX2);
the probe stays as the guard for machines where the kernels still lose to XLA's dot.
``sampler.cpu_kernels="auto"`` uses the kernels only where this probe finds them faster; "on"
still forces them.

The probe times both on one weight shape of the model (the widest decode projection) at 1 and
16 columns, interleaved, best of a few calls each (the best is the least disturbed by other
load); about 50 ms. Results are cached per shape for the process.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

COLUMNS = (1, 16)  # decode batch sizes probed: one request, a full rollout batch
# How much slower than XLA the native kernel may be at one probed column count and still pay.
# Why not 1.0: a best-of-5 timing of a ~0.1 ms call moves by a few per cent with other load, and
# on a 2-core AVX-512 host a strict rule turned the kernels off for 97 vs 95 us at one column
# while they were 2.5x faster at 16 (138 vs 341 us). The guard is for the 5-50x losses above.
TOLERANCE = 1.15


@dataclasses.dataclass(frozen=True)
class ProbeResult:
    """Best seconds per call, per probed column count: native and XLA."""

    shape: tuple[int, int]
    native_s: dict[int, float]
    xla_s: dict[int, float]

    @property
    def native_pays(self) -> bool:
        """Native is faster than XLA over the probed column counts together (sum of the best times)
        and at none of them slower by more than ``TOLERANCE``."""
        worst = max(self.native_s[b] / self.xla_s[b] for b in self.native_s)
        return worst <= TOLERANCE and sum(self.native_s.values()) <= sum(self.xla_s.values())

    def describe(self) -> str:
        n, k = self.shape
        parts = [f"B={b}: native {1e6 * self.native_s[b]:.0f} us vs XLA {1e6 * self.xla_s[b]:.0f} us"
                 for b in sorted(self.native_s)]
        return f"[{n},{k}] projection, " + ", ".join(parts)


def best_time(fn: Callable, *args, reps: int = 5) -> float:
    """Best wall seconds of ``reps`` calls of ``fn(*args)`` (after one warm-up call)."""
    jax.block_until_ready(fn(*args))
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        best = min(best, time.perf_counter() - t)
    return best


@functools.lru_cache(maxsize=8)
def probe_matmul(n: int, k: int, reps: int = 5) -> ProbeResult:
    """Time ``kernels.matmul_cols`` against XLA's ``W @ x`` for W float32[n, k] (call after
    ``ensure_registered``)."""
    from morse_jax.kernels.cpu_matmul import matmul_cols

    rng = np.random.default_rng(0)
    w = jnp.asarray(rng.standard_normal((n, k)), jnp.float32)
    native_fn, xla_fn = jax.jit(matmul_cols), jax.jit(jnp.matmul)
    native_s, xla_s = {}, {}
    for b in COLUMNS:
        x = jnp.asarray(rng.standard_normal((k, b)), jnp.float32)
        native_s[b] = best_time(native_fn, w, x, reps=reps)
        xla_s[b] = best_time(xla_fn, w, x, reps=reps)
    return ProbeResult((n, k), native_s, xla_s)
