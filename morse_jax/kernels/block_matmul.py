"""``W @ X`` for decode steps of 1-4 rows, with ``W`` in llama.cpp's block-quantised form (``block_matmul.cc``).

A decode step at batch 1 is bound by the bytes of weight it streams. A GGUF file such as the
embedded SmolLM2 stores its projections as Q4_1 and its embedding as Q8_0 (blocks of 32 values
along the input dimension); the loader dequantises them to float32 for training. Kept in their
block form as well (:class:`Q41` / :class:`Q80`, built by :func:`from_gguf_blocks`), a decode step
reads 0.75 / 1.125 bytes a weight instead of 4, with the same weight values (so the product
equals the float32 one up to summation order). CPU, unsharded, no autodiff: generation only.
"""

from __future__ import annotations

from typing import NamedTuple, Union

import jax
import jax.numpy as jnp
import numpy as np

from morse_jax.kernels import native

TARGETS = {"q4_1": "morse_block_matmul_q4_1", "q8_0": "morse_block_matmul_q8_0"}
BLOCK = 32  # values per block along the input dimension (llama.cpp's QK4_1 = QK8_0 = 32)
MAX_COLUMNS = 4  # the kernel's columns per call (decode rows); more rows read the float32 weights


class Q41(NamedTuple):
    """A [N, K] matrix in Q4_1 blocks: ``W[n, 32j + i] = scale[n, j] * q + min[n, j]`` with q the
    i-th 4-bit value of block j (byte i's low nibble for i < 16, byte i - 16's high nibble after).

    scale, min: float32[N, K/32] (the file's float16, widened). nibbles: uint8[N, K/2].
    """

    scale: jax.Array
    min: jax.Array
    nibbles: jax.Array


class Q80(NamedTuple):
    """A [N, K] matrix in Q8_0 blocks: ``W[n, 32j + i] = scale[n, j] * q[n, 32j + i]``.

    scale: float32[N, K/32]. q: int8[N, K].
    """

    scale: jax.Array
    q: jax.Array


BlockMatrix = Union[Q41, Q80]
# GGUF bytes per block: float16 d (and m for Q4_1) then the values
_BLOCK_BYTES = {"Q4_1": 20, "Q8_0": 34}


def from_gguf_blocks(raw: np.ndarray, kind: str) -> BlockMatrix:
    """A GGUF tensor's raw blocks (uint8[N, K/32 * bytes per block], as ``gguf.GGUFReader`` gives
    ``tensor.data``; rows = the output dimension) as a :class:`Q41` / :class:`Q80` of numpy arrays.
    ``kind``: "Q4_1" or "Q8_0" (the tensor type's name)."""
    if kind not in _BLOCK_BYTES:
        raise ValueError(f"from_gguf_blocks: {kind!r} is not a supported block type ({sorted(_BLOCK_BYTES)})")
    raw = np.asarray(raw)
    size = _BLOCK_BYTES[kind]
    if raw.dtype != np.uint8 or raw.ndim != 2 or raw.shape[1] % size:
        raise ValueError(f"from_gguf_blocks: expects uint8 [N, K/32 * {size}] for {kind}, got {raw.dtype} {raw.shape}")
    blocks = raw.reshape(raw.shape[0], -1, size)  # [N, nb, bytes]
    scale = np.ascontiguousarray(blocks[..., 0:2]).view(np.float16)[..., 0].astype(np.float32)  # [N, nb]
    if kind == "Q4_1":
        m = np.ascontiguousarray(blocks[..., 2:4]).view(np.float16)[..., 0].astype(np.float32)
        return Q41(scale, m, np.ascontiguousarray(blocks[..., 4:].reshape(raw.shape[0], -1)))
    return Q80(scale, np.ascontiguousarray(blocks[..., 2:]).view(np.int8).reshape(raw.shape[0], -1))


def take_rows(w: BlockMatrix, index) -> BlockMatrix:
    """Rows ``index`` of every part (a row permutation or slice; numpy or jax arrays)."""
    return type(w)(*(a[index] for a in w))


def concat_rows(parts: list[BlockMatrix]) -> BlockMatrix:
    """Matrices of one kind and K stacked along N (a fused projection's parts, in order)."""
    kinds = {type(p) for p in parts}
    if len(kinds) != 1:
        raise ValueError(f"concat_rows: parts of different kinds {sorted(k.__name__ for k in kinds)}")
    return type(parts[0])(*(jnp.concatenate(arrays, axis=0) for arrays in zip(*parts)))


def shape(w: BlockMatrix) -> tuple[int, int]:
    """(N, K) of the matrix ``w`` stands for."""
    return int(w.scale.shape[0]), int(w.scale.shape[1]) * BLOCK


def ensure_registered(vec_bytes: int | None = None) -> None:
    """Build (first use on this machine) and register both kernels; raises ``KernelBuildError``.
    ``vec_bytes`` forces the SIMD width (``native.build``; tests, benchmarks)."""
    native.register("block_matmul", "MorseBlockMatmulQ41", TARGETS["q4_1"], vec_bytes)
    native.register("block_matmul", "MorseBlockMatmulQ80", TARGETS["q8_0"], vec_bytes)


def unpack_simd_bytes(vec_bytes: int | None = None) -> int:
    """How the kernel built at ``vec_bytes`` turns a block's integers into floats: with intrinsics of
    that vector width (64: AVX-512, 32: AVX2), or 0: plain loops (other ISAs and forced widths)."""
    return native.build_fact("block_matmul", "MorseBlockUnpackBytes", vec_bytes)


def block_matmul_cols(w: BlockMatrix, x: jax.Array, *, vec_bytes: int | None = None) -> jax.Array:
    """``W @ x`` for ``W`` [N, K] in block form and x float32[K, B] (1 <= B <= 4) -> float32[N, B].

    Call ``morse_jax.kernels.ensure_registered()`` first (once per process).
    """
    n, k = shape(w)
    if x.ndim != 2 or x.shape[0] != k or not 1 <= x.shape[1] <= MAX_COLUMNS or x.dtype != jnp.float32:
        raise ValueError(f"block_matmul_cols: expects float32 x [{k}, B] with 1 <= B <= {MAX_COLUMNS}, "
                         f"got {x.dtype} {x.shape}")
    out = jax.ShapeDtypeStruct((n, x.shape[1]), jnp.float32)
    kind = "q4_1" if isinstance(w, Q41) else "q8_0"
    return jax.ffi.ffi_call(native.target_name(TARGETS[kind], vec_bytes), out)(*w, x)
