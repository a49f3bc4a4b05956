"""``mor.topk.topk_mask`` against the definition (a stable sort: the k largest, ties to the lower
index) and against ``jax.lax.top_k``, with many ties."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from morse_jax.mor.topk import topk_mask


def _np_topk_mask(x, k):
    order = np.argsort(-x, axis=-1, kind="stable")[..., :k]  # stable: equal values keep index order
    out = np.zeros(x.shape, bool)
    np.put_along_axis(out, order, True, axis=-1)
    return out


@pytest.mark.parametrize("e", [1, 2, 3, 4, 5])
def test_topk_mask_matches_stable_sort_and_lax_top_k(e):
    rng = np.random.default_rng(e)
    # small integers: many ties, including all-equal rows
    x = rng.integers(0, 3, size=(7, 11, e)).astype(np.float32)
    x[0, 0] = 1.0
    for k in range(1, e + 1):
        got = np.asarray(jax.jit(topk_mask, static_argnums=1)(jnp.asarray(x), k))
        np.testing.assert_array_equal(got, _np_topk_mask(x, k))
        _, idx = jax.lax.top_k(jnp.asarray(x), k)
        np.testing.assert_array_equal(got, np.asarray(jax.nn.one_hot(idx, e).sum(-2) > 0))
        np.testing.assert_array_equal(got.sum(-1), k)


def test_topk_mask_rejects_bad_k():
    with pytest.raises(ValueError, match="k must be"):
        topk_mask(jnp.zeros((2, 3)), 4)
    with pytest.raises(ValueError, match="k must be"):
        topk_mask(jnp.zeros((2, 3)), 0)
