"""The pieces a decoder layer is made of, each written once: norms, rotary embeddings, the MLP
activation, attention masks and probabilities, the embedding and the LM head's soft-cap.

Pure functions of arrays and a :class:`~morse_jax.models.config.ModelConfig`; no layout
decisions (those are the callers': ``morse_jax.models.block`` assembles a layer from these,
``transformer`` and ``decode`` supply the weight and cache layouts).

Shapes: B batch, T new tokens, S key slots, d hidden, H heads, K kv heads, D head dim, L layers,
p per-layer input width (Gemma 4).
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from morse_jax.models.config import ModelConfig

# finite: fully-masked (padding) rows stay NaN-free
NEG_INF = -0.7 * float(np.finfo(np.float32).max)

Rope = tuple[jax.Array, jax.Array]  # (cos, sin), each [..., D]


# --------------------------------------------------------------------------- norms


def rms_norm(x: jax.Array, w: jax.Array, eps: float, offset: float, axis: int = -1) -> jax.Array:
    """RMSNorm over ``axis`` in float32, scale (offset + w); returns x's dtype.

    ``axis=-1``: features last (x [..., d]); ``axis=0``: features first, the decode step's
    transposed activations x [d, B].
    """
    if axis not in (-1, 0):
        raise ValueError(f"rms_norm normalises the first or the last axis, got axis={axis}")
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=axis, keepdims=True) + eps)
    scale = offset + w.astype(jnp.float32)
    return (y * (scale if axis == -1 else scale[:, None])).astype(x.dtype)


def rms_norm_unscaled(x: jax.Array, eps: float) -> jax.Array:
    """RMSNorm without a scale (Gemma 4's value norm), float32 statistics over the last axis."""
    x32 = x.astype(jnp.float32)
    return (x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)).astype(x.dtype)


# --------------------------------------------------------------------------- rotary embeddings


def positions_from_valid(valid: jax.Array, start: jax.Array | None = None) -> jax.Array:
    """Rotary positions int32[B, T] of new tokens: valid tokens before each one in the row
    (+ ``start[B]``, e.g. the tokens already cached); right for left-padded prompts."""
    pos = jnp.maximum(jnp.cumsum(valid, axis=1) - 1, 0)
    return pos if start is None else pos + start[:, None]


def rope_tables(positions: jax.Array, inv_freq: np.ndarray, attention_scaling: float, dtype) -> Rope:
    """cos, sin: [*positions.shape, D] for rotate-half rotary embeddings (HF layout)."""
    freqs = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)[None, None, :]
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return (jnp.cos(emb) * attention_scaling).astype(dtype), (jnp.sin(emb) * attention_scaling).astype(dtype)


def rope_for(cfg: ModelConfig, positions: jax.Array, dtype) -> tuple[Rope, Rope]:
    """((cos, sin) of full-attention layers, (cos, sin) of sliding ones), each [B, T, D]; the
    full ones are ``cfg.full_head_dim`` wide (Gemma 4's full-attention heads are wider)."""
    full = cfg.rope_full
    cos_f, sin_f = rope_tables(positions, full.inv_freq(cfg.full_head_dim), full.attention_scaling, dtype)
    slide = cfg.rope_sliding or cfg.rope_full
    cos_s, sin_s = rope_tables(positions, slide.inv_freq(cfg.head_dim), slide.attention_scaling, dtype)
    return (cos_f, sin_f), (cos_s, sin_s)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """x: [B, T, H, D]; cos/sin: [B, T, D]."""
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos[:, :, None, :] + rotated * sin[:, :, None, :]


# --------------------------------------------------------------------------- MLP


def activation(name: str) -> Callable[[jax.Array], jax.Array]:
    """The MLP (and Gemma 4 per-layer input) activation named by ``ModelConfig.activation``."""
    if name == "silu":
        return jax.nn.silu
    if name == "gelu_tanh":
        return lambda x: jax.nn.gelu(x, approximate=True)
    return lambda x: jax.nn.gelu(x, approximate=False)


# --------------------------------------------------------------------------- attention


def soft_cap(x: jax.Array, cap: float | None) -> jax.Array:
    """cap * tanh(x / cap) (Gemma's attention and final-logit soft-cap); identity for cap None/0."""
    return jnp.tanh(x / cap) * cap if cap else x


def attention_masks(cfg: ModelConfig, key_valid: jax.Array, q_slots: jax.Array,
                    k_start: jax.Array | int = 0) -> tuple[jax.Array, jax.Array]:
    """Full and sliding-window masks bool[B, T, S] for queries at slots ``q_slots`` int[T].

    key_valid: bool[B, S], False at padding (never attended to), for the key slots
    ``k_start .. k_start + S - 1`` (a block of the cache; 0: the whole cache). Slots advance with
    positions within a row, so a query attends to valid keys at or before its own slot (and, in
    sliding layers, fewer than ``cfg.sliding_window`` slots back).
    """
    k_slots = k_start + jnp.arange(key_valid.shape[1])
    causal = k_slots[None, :] <= q_slots[:, None]  # [T, S]
    full = key_valid[:, None, :] & causal[None]
    if not cfg.sliding_window:
        return full, full
    return full, full & ((q_slots[:, None] - k_slots[None, :]) < cfg.sliding_window)[None]


def attention_probs(scores: jax.Array, mask: jax.Array, cfg: ModelConfig, dtype) -> jax.Array:
    """Scaled float32 attention scores -> probabilities in ``dtype``: soft-cap, mask, softmax
    over the last (key) axis. ``mask`` broadcasts against ``scores``."""
    scores = soft_cap(scores, cfg.attn_logit_softcap)
    return jax.nn.softmax(jnp.where(mask, scores, NEG_INF), axis=-1).astype(dtype)


def attend(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array, cfg: ModelConfig) -> jax.Array:
    """Grouped-query attention in the model layout: q [B, T, H, D], k/v [B, S, K, D], mask
    bool[B, T, S] -> [B, T, H*D]."""
    B, T, H, D = q.shape
    K = k.shape[2]
    qg = q.reshape(B, T, K, H // K, D)
    scores = jnp.einsum("btkgd,bskd->bkgts", qg, k).astype(jnp.float32) * cfg.scale
    probs = attention_probs(scores, mask[:, None, None, :, :], cfg, q.dtype)
    return jnp.einsum("bkgts,bskd->btkgd", probs, v).reshape(B, T, H * D)


# --------------------------------------------------------------------------- embedding and head


def embed(table: jax.Array, tokens: jax.Array, cfg: ModelConfig) -> jax.Array:
    """Input embeddings [*tokens.shape, d] (scaled by sqrt(d) where the family does)."""
    x = jnp.take(table, tokens, axis=0)
    if cfg.embed_scale:
        x = x * jnp.asarray(cfg.hidden_size ** 0.5, table.dtype)
    return x


def per_layer_inputs(params: dict, cfg: ModelConfig, tokens: jax.Array, x: jax.Array) -> jax.Array:
    """Gemma 4 per-layer embeddings: [B, T, L, p] from token ids and the scaled input embeddings x.

    A token-identity part (a second embedding table, scaled by sqrt(p)) plus a context part (a
    projection of x scaled by 1/sqrt(d), RMS-normalised per layer), averaged with 1/sqrt(2).
    ``params``: any tree holding "ple_embed", "ple_proj", "ple_norm" (backbone or decode params).
    """
    B, T = tokens.shape
    L, p, dtype = cfg.num_layers, cfg.per_layer_input_size, x.dtype
    ids = jnp.take(params["ple_embed"], tokens, axis=0).reshape(B, T, L, p) * jnp.asarray(p ** 0.5, dtype)
    proj = jnp.einsum("btd,df->btf", x, params["ple_proj"]) * jnp.asarray(cfg.hidden_size ** -0.5, dtype)
    proj = rms_norm(proj.reshape(B, T, L, p), params["ple_norm"], cfg.rms_norm_eps, cfg.norm_offset)
    return (proj + ids) * jnp.asarray(2 ** -0.5, dtype)


def final_logits(logits: jax.Array, cfg: ModelConfig) -> jax.Array:
    """The LM head's output (any layout) as float32, soft-capped where the family does."""
    return soft_cap(logits.astype(jnp.float32), cfg.final_logit_softcap)
