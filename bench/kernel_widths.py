"""The native projection kernel at each SIMD vector width against XLA's dot, one process, interleaved.

``kernels.matmul_cols`` built for the ISA (what the sampler uses) and forced to 64, 32 and 16 bytes
(``native.build(vec_bytes=...)``: 32 is AVX2 code, built with -mno-avx512f; 16 SSE code), on the
probe's weight shape (``kernels.probe``: the model's MLP projection, [1536, 576] for SmolLM2-135M)
at 1, 4 and 16 columns. Best of ``--reps`` rounds of 20 calls each; one line per column count with
microseconds per call and each width's ratio to XLA (>1: the kernel is faster).

Then the same for ``kernels.block_matmul_cols`` (decode steps of 1-4 rows reading the GGUF's
Q4_1 / Q8_0 blocks) on random blocks of the same shape at 1 and 4 columns, against XLA's float32
dot of the dequantised matrix (what the sampler runs with ``block_weights="off"``).

Usage:  python bench/kernel_widths.py [--shape 1536,576] [--reps 5] [--old-avx2]

``--old-avx2`` adds the build the per-ISA width replaced, as an AVX2-only host got it: 64-byte
vectors in AVX2 code (-mno-avx512f -DMORSE_VEC_BYTES=64, compiled into a temporary directory),
which GCC splits into ymm halves moved through the stack (2026-12-03's 8x slowdown).

On an AVX-512 host the forced 32-byte build shows what the AVX2 code path does, not what an
AVX2-only machine gets (its XLA runs AVX2 code too, and its memory differs).
"""

from __future__ import annotations

import argparse
import ctypes
import os
import subprocess
import sys
import tempfile
from pathlib import Path


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="1536,576")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--old-avx2", action="store_true", help="add the old 64-byte build in AVX2 code")
    args = ap.parse_args(argv)
    import jax
    import jax.numpy as jnp
    import numpy as np

    from morse_jax.kernels import cpu_matmul, native
    from morse_jax.kernels.probe import best_time

    n, k = (int(v) for v in args.shape.split(","))
    widths = [None, 64, 32, 16]
    for v in widths:
        cpu_matmul.ensure_registered(v)
    isa = native.built_vec_bytes("cpu_matmul")
    print(f"# W [{n}, {k}] float32; ISA width {isa} bytes; load {os.getloadavg()[0]:.1f}", flush=True)
    rng = np.random.default_rng(0)
    w = jnp.asarray(rng.standard_normal((n, k)), jnp.float32)
    fns = {v: jax.jit(lambda w, x, v=v: cpu_matmul.matmul_cols(w, x, vec_bytes=v)) for v in widths}
    if args.old_avx2:
        lib = Path(tempfile.mkdtemp()) / "old_avx2_64.so"
        subprocess.run([native.compiler(), *native.FLAGS, "-mno-avx512f", "-DMORSE_VEC_BYTES=64",
                        f"-I{jax.ffi.include_dir()}", f"-I{native.SOURCE_DIR}",
                        str(native.SOURCE_DIR / "cpu_matmul.cc"), "-o", str(lib)], check=True, capture_output=True)
        jax.ffi.register_ffi_target("bench_old_avx2_64", jax.ffi.pycapsule(ctypes.CDLL(str(lib)).MorseCpuMatmul),
                                    platform="cpu")
        widths.append("avx2-64")
        fns["avx2-64"] = jax.jit(lambda w, x: jax.ffi.ffi_call(
            "bench_old_avx2_64", jax.ShapeDtypeStruct((w.shape[0], x.shape[1]), jnp.float32))(w, x))
    xla = jax.jit(jnp.matmul)
    for b in (1, 4, 16):
        x = jnp.asarray(rng.standard_normal((k, b)), jnp.float32)
        got = {v: float("inf") for v in widths}
        ref = float("inf")
        for _ in range(args.reps):  # interleaved rounds: load changes hit every variant
            for v in widths:
                got[v] = min(got[v], best_time(fns[v], w, x, reps=20))
            ref = min(ref, best_time(xla, w, x, reps=20))
        parts = [f"{'isa' if v is None else v}: {1e6 * t:.0f} us {ref / t:.2f}x" for v, t in got.items()]
        print(f"B={b}: XLA {1e6 * ref:.0f} us; " + ", ".join(parts), flush=True)
    block_widths(n, k, args.reps, rng)


def block_widths(n: int, k: int, reps: int, rng) -> None:
    """``block_matmul_cols`` per width and format vs XLA's float32 dot of the same values."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from morse_jax.kernels import block_matmul as bm
    from morse_jax.kernels.probe import best_time

    widths = [None, 64, 32, 16]
    for v in widths:
        bm.ensure_registered(v)
    fns = {v: jax.jit(lambda w, x, v=v: bm.block_matmul_cols(w, x, vec_bytes=v)) for v in widths}
    xla = jax.jit(jnp.matmul)
    for kind, size in (("Q4_1", 20), ("Q8_0", 34)):  # bytes per block of 32: float16 scale (+ min), ints
        raw = rng.integers(0, 256, (n, k // 32, size), dtype=np.uint8)
        raw[..., 0:2] = (0.02 * rng.standard_normal((n, k // 32, 1))).astype(np.float16).view(np.uint8)
        if kind == "Q4_1":
            raw[..., 2:4] = (0.1 * rng.standard_normal((n, k // 32, 1))).astype(np.float16).view(np.uint8)
        w = jax.tree.map(jnp.asarray, bm.from_gguf_blocks(raw.reshape(n, -1), kind))
        dense = jnp.asarray(rng.standard_normal((n, k)), jnp.float32)  # XLA's side: same shape, float32
        for b in (1, 4):
            x = jnp.asarray(rng.standard_normal((k, b)), jnp.float32)
            got = {v: float("inf") for v in widths}
            ref = float("inf")
            for _ in range(reps):
                for v in widths:
                    got[v] = min(got[v], best_time(fns[v], w, x, reps=20))
                ref = min(ref, best_time(xla, dense, x, reps=20))
            parts = [f"{'isa' if v is None else v}: {1e6 * t:.0f} us {ref / t:.2f}x" for v, t in got.items()]
            print(f"{kind} blocks, B={b}: XLA float32 {1e6 * ref:.0f} us; " + ", ".join(parts), flush=True)


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    main()
