"""The adapter hook (morse_jax.models.adapters.project) and the layer pieces, pinned from their
definitions: a new adapter type plugged in as documented changes a layer exactly as adding its
matrix to the frozen weight would, in the prefill (rows) and decode-step (columns) layouts."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from morse_jax.models import ModelConfig, init_params
from morse_jax.models import decode as D
from morse_jax.models.layers import rms_norm, soft_cap

CFG = ModelConfig(family="llama", vocab_size=61, hidden_size=32, intermediate_size=48, num_layers=3, num_heads=4,
                  num_kv_heads=2, head_dim=8)
B, P, MAX_LEN = 2, 5, 8


class DenseDelta(NamedTuple):
    """A toy adapter type: a full [d_in, d_out] matrix added to some targets (not low-rank)."""

    m: dict

    def deltas(self, x, group, out_dims, columns):
        out = {}
        for t in out_dims:
            if t in self.m:
                out[t] = self.m[t].T @ x if columns else jnp.einsum("btd,df->btf", x, self.m[t])
        return out


def _merged(params, layer, deltas):
    """params with deltas[t] added to layer ``layer``'s kernel of target t (one stacked segment)."""
    seg = dict(params["layers"][0])
    for t, m in deltas.items():
        seg[t] = {**seg[t], "kernel": seg[t]["kernel"].at[layer].add(m)}
    return {**params, "layers": (seg,)}


def test_a_new_adapter_type_equals_merged_weights_in_prefill_and_decode():
    params = jax.jit(init_params, static_argnums=1)(jax.random.PRNGKey(0), CFG)
    rng = np.random.default_rng(0)
    d, f = CFG.hidden_size, CFG.intermediate_size
    kv = CFG.num_kv_heads * CFG.head_dim
    shapes = {"q": (d, d), "v": (d, kv), "o": (d, d), "up": (d, f), "down": (f, d)}
    m = {t: jnp.asarray(0.05 * rng.normal(size=s), jnp.float32) for t, s in shapes.items()}
    tokens = jnp.asarray(rng.integers(1, CFG.vocab_size, (B, P + 1)), jnp.int32)
    valid = jnp.ones((B, P), bool)
    pos = D.positions_from_valid(valid)

    def run(dp, adapters):
        cache = D.init_decode_cache(CFG, B, MAX_LEN)
        pre, cache = D.forward_cached(dp, CFG, tokens[:, :P], valid, pos, cache, adapters, last_only=False)
        step, _ = D.decode_step(dp, CFG, tokens[:, P], jnp.ones((B,), bool), pos[:, -1] + 1, cache, adapters)
        return pre, step

    # the last layer adapted (decode takes one adapter value per adapted layer, last layers)
    ours = jax.jit(run)(D.decode_params(params, CFG), (DenseDelta(m),))
    ref = jax.jit(run)(D.decode_params(_merged(params, CFG.num_layers - 1, m), CFG), None)
    base = jax.jit(run)(D.decode_params(params, CFG), None)
    for got, want, plain in zip(ours, ref, base):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-5, atol=2e-5)
        assert np.max(np.abs(np.asarray(got) - np.asarray(plain))) > 1e-3  # the adapter did something


def test_rms_norm_over_features_first_is_the_transposed_norm():
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.normal(size=(5, 7)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(7,)), jnp.float32)
    ref = x / np.sqrt(np.mean(np.asarray(x) ** 2, axis=-1, keepdims=True) + 1e-6) * (1.0 + np.asarray(w))
    np.testing.assert_allclose(np.asarray(rms_norm(x, w, 1e-6, 1.0)), ref, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(rms_norm(x.T, w, 1e-6, 1.0, axis=0)), ref.T, rtol=1e-5)


def test_soft_cap_is_cap_tanh_and_identity_without_a_cap():
    x = jnp.asarray([-100.0, -1.0, 0.0, 2.0, 50.0])
    np.testing.assert_allclose(np.asarray(soft_cap(x, 5.0)), 5.0 * np.tanh(np.asarray(x) / 5.0), rtol=1e-6)
    assert soft_cap(x, None) is x and soft_cap(x, 0.0) is x
