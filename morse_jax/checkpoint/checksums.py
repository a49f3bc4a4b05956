"""Content checksums of checkpointed arrays, the same value from numpy or a sharded jax.Array.

Per leaf two 32-bit sums over the leaf's 32-bit words w_i with odd, index-dependent weights,
modulo 2**32. Integer sums are order-independent, so the value is the same whichever device
layout or reduction order computed it, and a change to any single word always changes both
sums (odd weights are invertible mod 2**32).
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

_UINT = {8: jnp.uint8, 16: jnp.uint16, 32: jnp.uint32, 64: jnp.uint64}
_GOLD = 0x9E3779B1


def dtype_bits(dtype) -> int:
    """Bits per element of a bool / float / int dtype (-1 for any other dtype)."""
    dtype = jnp.dtype(dtype)
    if dtype == jnp.bool_:
        return 8
    if jnp.issubdtype(dtype, jnp.floating):
        return int(jnp.finfo(dtype).bits)
    if jnp.issubdtype(dtype, jnp.integer):
        return int(jnp.iinfo(dtype).bits)
    return -1


def _words_jnp(x: jax.Array) -> jax.Array:
    x = jnp.ravel(x)
    if x.dtype == jnp.bool_:
        x = x.astype(jnp.uint8)
    bits = dtype_bits(x.dtype)
    u = jax.lax.bitcast_convert_type(x, _UINT[bits])
    if bits == 64:  # [n] -> [n, 2] little-endian words, as numpy's view gives
        return jax.lax.bitcast_convert_type(u, jnp.uint32).reshape(-1)
    return u.astype(jnp.uint32)


def _words_np(x: np.ndarray) -> np.ndarray:
    a = np.ascontiguousarray(x).reshape(-1)
    if a.dtype == np.bool_:
        a = a.view(np.uint8)
    bits = dtype_bits(a.dtype)
    a = a.astype(a.dtype.newbyteorder("<"), copy=False)
    u = a.view(np.dtype(f"<u{bits // 8}"))
    return u.view("<u4").astype(np.uint32) if bits == 64 else u.astype(np.uint32)


def _mix(u, i, xp):
    s1 = xp.sum(u * (i * xp.uint32(2) + xp.uint32(1)), dtype=xp.uint32)
    rot = (u << 13) | (u >> 19)
    s2 = xp.sum(rot * ((i * xp.uint32(_GOLD)) | xp.uint32(1)), dtype=xp.uint32)
    return s1, s2


@jax.jit
def _checksums_jit(leaves: list) -> jax.Array:
    out = []
    for x in leaves:
        u = _words_jnp(x)
        s1, s2 = _mix(u, jax.lax.iota(jnp.uint32, u.shape[0]), jnp)
        out.append(jnp.stack([s1, s2]))
    return jnp.stack(out).reshape(len(leaves), 2)


def _checksum_np(x: np.ndarray) -> list[int]:
    u = _words_np(x)
    with np.errstate(over="ignore"):
        s1, s2 = _mix(u, np.arange(u.size, dtype=np.uint32), np)
    return [int(s1), int(s2)]


def tree_checksums(leaves: list) -> list[list[int]]:
    """``[[s1, s2], ...]`` (Python ints) for a list of jax / numpy arrays, in order.

    Same value for the same bits whether a leaf is a numpy array or a (sharded) jax.Array.
    """
    out: list[Optional[list[int]]] = [None] * len(leaves)
    jax_idx = [i for i, x in enumerate(leaves) if isinstance(x, jax.Array)]
    for i, x in enumerate(leaves):
        if not isinstance(x, jax.Array):
            out[i] = _checksum_np(np.asarray(x))
    if jax_idx:
        sums = _checksums_jit([leaves[i] for i in jax_idx])
        if not sums.is_fully_addressable:  # multi-host: full reductions come back replicated
            assert sums.is_fully_replicated, sums.sharding
            sums = sums.addressable_data(0)
        for i, row in zip(jax_idx, np.asarray(sums).tolist()):
            out[i] = [int(v) for v in row]
    return out  # type: ignore[return-value]

