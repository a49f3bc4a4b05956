"""Backbone parameter shapes and random initialisation (tests, shape checks, memory plans).

Shapes per layer come from ``ModelConfig.layer_*`` (Gemma 4 layers differ), and the layers of a
fresh tree are stacked in segments of identically shaped layers (:func:`segment_sizes`);
:func:`num_params` counts them (here rather than on ``ModelConfig``: the config knows no params). See
``morse_jax.models.transformer`` for how segments run and ``morse_jax.models.segments`` for
regrouping them.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp

from morse_jax.models.config import ModelConfig

Params = dict[str, Any]


def layer_shapes(cfg: ModelConfig, i: int) -> Params:
    """Parameter shapes of layer ``i`` alone (no leading layer axis)."""
    d, f = cfg.hidden_size, cfg.layer_intermediate_size(i)
    D = cfg.layer_head_dim(i)
    qd, kvd = cfg.num_heads * D, cfg.layer_kv_heads(i) * D
    reuse = cfg.kv_sharing_modes[i] == "reuse"

    def lin(din, dout, bias):
        p = {"kernel": (din, dout)}
        if bias:
            p["bias"] = (dout,)
        return p

    layer = {
        "attn_norm": (d,),
        "mlp_norm": (d,),
        "q": lin(d, qd, cfg.attention_bias),
        "o": lin(qd, d, cfg.attention_bias),
        "gate": lin(d, f, cfg.mlp_bias),
        "up": lin(d, f, cfg.mlp_bias),
        "down": lin(f, d, cfg.mlp_bias),
    }
    if not reuse:  # KV-shared layers attend to another layer's keys and values
        layer["k"] = lin(d, kvd, cfg.attention_bias)
        if cfg.layer_has_v(i):
            layer["v"] = lin(d, kvd, cfg.attention_bias)
    if cfg.qk_norm:
        layer["q_norm"] = (D,)
        if not reuse:
            layer["k_norm"] = (D,)
    if cfg.post_norms:
        layer["post_attn_norm"] = (d,)
        layer["post_mlp_norm"] = (d,)
    if cfg.per_layer_input_size:
        p = cfg.per_layer_input_size
        layer["ple_gate"] = lin(d, p, False)
        layer["ple_out"] = lin(p, d, False)
        layer["ple_post_norm"] = (d,)
    if cfg.layer_scalar:
        layer["layer_scalar"] = (1,)
    return layer


def segment_sizes(cfg: ModelConfig) -> list[int]:
    """Lengths of the stacked segments of a freshly built param tree: maximal runs of
    consecutive layers with identical shapes (one run for every family but Gemma 4)."""
    sizes, prev = [], None
    for i in range(cfg.num_layers):
        key = (layer_shapes(cfg, i), cfg.layer_types[i] if cfg.kv_sharing_modes[i] == "reuse" else None)
        if key == prev:
            sizes[-1] += 1
        else:
            sizes.append(1)
        prev = key
    return sizes


def param_shapes(cfg: ModelConfig) -> Params:
    """Nested dict of parameter shapes, layers stacked on a leading axis.

    ``"layers"`` holds one stacked segment per run of identically shaped layers
    (:func:`segment_sizes`): one segment for every family but Gemma 4, whose full-attention
    layers differ in shape from its sliding ones.
    """
    d = cfg.hidden_size
    segs, start = [], 0
    for n in segment_sizes(cfg):
        one = layer_shapes(cfg, start)
        segs.append(jax.tree.map(lambda s, n=n: (n, *s), one, is_leaf=_is_shape))
        start += n
    shapes = {"embed": (cfg.vocab_size, d), "layers": tuple(segs), "final_norm": (d,)}
    if not cfg.tie_embeddings:
        shapes["lm_head"] = (d, cfg.vocab_size)
    if cfg.per_layer_input_size:
        width = cfg.num_layers * cfg.per_layer_input_size
        shapes["ple_embed"] = (cfg.per_layer_vocab_size, width)
        shapes["ple_proj"] = (d, width)
        shapes["ple_norm"] = (cfg.per_layer_input_size,)
    return shapes


def num_params(cfg: ModelConfig) -> int:
    """Parameter count implied by the config (matches ``init_params`` leaves)."""
    flat = jax.tree_util.tree_leaves(param_shapes(cfg), is_leaf=_is_shape)
    return int(sum(math.prod(s) for s in flat))


def _is_shape(x) -> bool:
    return isinstance(x, tuple) and all(isinstance(i, int) for i in x)


_FLAT_INIT_MAX = 1 << 28  # elements; above this, one draw per leaf (no giant temporary, shards per leaf)


def init_params(key: jax.Array, cfg: ModelConfig, dtype=jnp.float32) -> Params:
    """Random parameters (normal * 0.02; norms at an effective scale of 1). For tests and shapes.

    Small models take one normal draw sliced into all weights: a separate threefry draw per leaf
    made the jitted init of a 4-layer toy model take ~6 s to compile on CPU (one draw: <1 s).
    Large ones draw per leaf, so no flat buffer of the whole model is ever materialised.
    """
    shapes = param_shapes(cfg)
    flat, treedef = jax.tree_util.tree_flatten_with_path(shapes, is_leaf=_is_shape)
    names = [jax.tree_util.keystr(path) for path, _ in flat]
    is_scalar = ["layer_scalar" in name for name in names]  # Gemma 4's per-layer output scale: 1
    is_norm = ["norm" in name or sc for name, sc in zip(names, is_scalar)]
    total = sum(math.prod(shape) for (_, shape), norm in zip(flat, is_norm) if not norm)
    one_draw = total <= _FLAT_INIT_MAX
    noise = 0.02 * jax.random.normal(key, (total,), jnp.float32) if one_draw else None
    keys = None if one_draw else jax.random.split(key, len(flat))
    out, offset = [], 0
    for i, ((_, shape), norm) in enumerate(zip(flat, is_norm)):
        if is_scalar[i]:
            out.append(jnp.ones(shape, dtype))
        elif norm:
            out.append(jnp.full(shape, 1.0 - cfg.norm_offset, dtype))
        elif one_draw:
            n = math.prod(shape)
            out.append(noise[offset:offset + n].reshape(shape).astype(dtype))
            offset += n
        else:
            out.append((0.02 * jax.random.normal(keys[i], shape, jnp.float32)).astype(dtype))
    return jax.tree.unflatten(treedef, out)
