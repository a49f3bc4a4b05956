"""The decode cache's keys in tiles of ``KEY_TILE`` slots: ``[N, S/T, D, T]`` (N = batch x kv heads).

Why tiles: the native decode attention reads, per (row, kv head), the keys of every filled slot.
With keys ``[N, D, S]`` (slots last, what the score dot wants) those are D rows of stride S read
side by side; in tiles, a tile's D rows of T slot-vectors are contiguous and so are the tiles, so
the read is one stream (``kernels/decode_attention.cc``). The last tile is zero-padded when S is
not a multiple of T; callers take S from the values or the mask. Everything else that touches
keys by slot (the prefill's chunk writes and block reads, slot refill's row moves) goes through
the functions here.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

KEY_TILE = 16  # slots per key tile: a multiple of every SIMD width the native kernel builds for


def key_tiles(slots: int) -> int:
    """Tiles holding ``slots`` key slots (the last one zero-padded)."""
    return -(-slots // KEY_TILE)


def tile_keys(keys: jax.Array) -> jax.Array:
    """Keys [N, D, S] (slots last) -> the cache layout [N, ceil(S/T), D, T], zero-padded."""
    N, D, S = keys.shape
    pad = key_tiles(S) * KEY_TILE - S
    keys = jnp.pad(keys, ((0, 0), (0, 0), (0, pad))) if pad else keys
    return jnp.transpose(keys.reshape(N, D, -1, KEY_TILE), (0, 2, 1, 3))


def untile_keys(tiles: jax.Array, slots: int | None = None) -> jax.Array:
    """The cache layout [N, S/T, D, T] -> keys [N, D, S'] (S' = the first ``slots``, or all)."""
    N, n_tiles, D, T = tiles.shape
    keys = jnp.transpose(tiles, (0, 2, 1, 3)).reshape(N, D, n_tiles * T)
    return keys if slots is None else keys[:, :, :slots]


def _key_window(tiles: jax.Array, start: jax.Array, n: int) -> tuple[int, jax.Array]:
    """(tiles in a window holding slots [start, start + n), its first tile): start + n must not
    pass the last tile. The window starts at start's tile, moved back where it would pass the end."""
    n_tiles = tiles.shape[1]
    width = min(n_tiles, -(-n // KEY_TILE) + 1)
    return width, jnp.clip(start // KEY_TILE, 0, n_tiles - width)


def read_key_slots(tiles: jax.Array, start: jax.Array, n: int) -> jax.Array:
    """Keys [N, D, n] of slots [start, start + n) (start traced) from the cache layout; copies only
    the tiles that hold them."""
    width, first = _key_window(tiles, start, n)
    window = untile_keys(jax.lax.dynamic_slice_in_dim(tiles, first, width, axis=1))
    return jax.lax.dynamic_slice_in_dim(window, start - first * KEY_TILE, n, axis=2)


def write_key_slots(tiles: jax.Array, keys: jax.Array, start: jax.Array) -> jax.Array:
    """The cache layout with keys [N, D, n] written at slots [start, start + n)."""
    n = keys.shape[2]
    keys = keys.astype(tiles.dtype)
    if n == 1:  # a decode step: one float per (n, d) row of the slot's tile, in place
        return jax.lax.dynamic_update_slice(tiles, keys.reshape(keys.shape[0], 1, keys.shape[1], 1),
                                            (0, start // KEY_TILE, 0, start % KEY_TILE))
    width, first = _key_window(tiles, start, n)
    window = untile_keys(jax.lax.dynamic_slice_in_dim(tiles, first, width, axis=1))
    window = jax.lax.dynamic_update_slice(window, keys, (0, 0, start - first * KEY_TILE))
    return jax.lax.dynamic_update_slice(tiles, tile_keys(window), (0, first, 0, 0))
