"""The decode cache's key tiles (``models.decode``: keys [N, S/T, D, T]) read and written by slot.

References are plain slot-order arrays [N, D, S] sliced and updated with numpy."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from morse_jax.models.key_tiles import KEY_TILE, key_tiles, read_key_slots, tile_keys, untile_keys, write_key_slots


@pytest.mark.parametrize("S", [1, 15, 16, 40, 48, 384])
def test_tiles_round_trip_and_hold_slot_s_at_tile_s_over_t(S):
    keys = np.random.default_rng(S).normal(size=(3, 5, S)).astype(np.float32)
    tiles = np.asarray(tile_keys(jnp.asarray(keys)))
    assert tiles.shape == (3, key_tiles(S), 5, KEY_TILE) and key_tiles(S) * KEY_TILE >= S > (key_tiles(S) - 1) * KEY_TILE
    for s in range(S):
        np.testing.assert_array_equal(tiles[:, s // KEY_TILE, :, s % KEY_TILE], keys[:, :, s])
    padding = np.transpose(tiles, (0, 2, 1, 3)).reshape(3, 5, -1)[:, :, S:]
    assert not padding.any()  # the last tile's padding is zero
    np.testing.assert_array_equal(np.asarray(untile_keys(jnp.asarray(tiles), S)), keys)


@pytest.mark.parametrize("S,n", [(40, 1), (40, 7), (40, 16), (40, 40), (48, 17), (384, 32), (33, 33)])
def test_read_and_write_any_run_of_slots(S, n):
    """Every start of an n-slot run that fits the S slots, including runs across tile edges and
    windows clamped at the last tile."""
    rng = np.random.default_rng(S * 100 + n)
    keys = rng.normal(size=(2, 3, S)).astype(np.float32)
    new = rng.normal(size=(2, 3, n)).astype(np.float32)
    read = jax.jit(lambda t, s: read_key_slots(t, s, n))
    write = jax.jit(write_key_slots)
    tiles = tile_keys(jnp.asarray(keys))
    for start in range(S - n + 1):
        np.testing.assert_array_equal(np.asarray(read(tiles, jnp.int32(start))), keys[:, :, start:start + n])
        want = keys.copy()
        want[:, :, start:start + n] = new
        got = write(tiles, jnp.asarray(new), jnp.int32(start))
        np.testing.assert_array_equal(np.asarray(untile_keys(got, S)), want, err_msg=f"start {start}")
