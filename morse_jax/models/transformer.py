"""The decoder: one pure-function implementation for Llama, Qwen3 and Gemma 3.

Params are a plain pytree (see :func:`param_shapes`). Layers are grouped into *segments*:
``params["layers"]`` is a tuple of segments, each either

* a dict of arrays stacked on a leading layer axis (run under ``jax.lax.scan``; the default), or
* a tuple of per-layer dicts (run as an unrolled Python loop; what the sampler uses for decode,
  since per-layer cache buffers update in place where a scanned, stacked cache is copied).

A freshly loaded backbone has one segment; :func:`split_segments` splits off the last ``L_adapt``
layers so that LoRA experts attach to that segment only (``morse_jax.mole``).

Shapes: B batch, T new tokens, S cache length, d hidden, H heads, K kv heads, D head dim.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import chex
import jax
import jax.numpy as jnp
import numpy as np

from morse_jax.models.config import ModelConfig

Params = dict[str, Any]
NEG_INF = -0.7 * float(np.finfo(np.float32).max)  # finite: fully-masked (padding) rows stay NaN-free
LORA_TARGETS = ("q", "k", "v", "o", "gate", "up", "down")


class LoraInputs(NamedTuple):
    """Per-row LoRA deltas for the adapted segment, already gathered for each row.

    Either gathered per row — a[target]: [L_adapt, B, K, d_in, r], b[target]: [L_adapt, B, K, r, d_out],
    scale: [B, K] — or all experts with per-row weights — a: [L_adapt, E, d_in, r],
    b: [L_adapt, E, r, d_out], scale: [B, E]. scale = expert weight * alpha / rank; 0 is an exact no-op.
    Built by ``morse_jax.mole.experts.gather_lora``.
    """

    a: dict[str, jax.Array]
    b: dict[str, jax.Array]
    scale: jax.Array


# --------------------------------------------------------------------------- parameters


def param_shapes(cfg: ModelConfig) -> Params:
    """Nested dict of parameter shapes, layers stacked on a leading axis (one segment)."""
    d, f, L = cfg.hidden_size, cfg.intermediate_size, cfg.num_layers
    qd, kvd = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim

    def lin(din, dout, bias):
        p = {"kernel": (L, din, dout)}
        if bias:
            p["bias"] = (L, dout)
        return p

    layer = {
        "attn_norm": (L, d),
        "mlp_norm": (L, d),
        "q": lin(d, qd, cfg.attention_bias),
        "k": lin(d, kvd, cfg.attention_bias),
        "v": lin(d, kvd, cfg.attention_bias),
        "o": lin(qd, d, cfg.attention_bias),
        "gate": lin(d, f, cfg.mlp_bias),
        "up": lin(d, f, cfg.mlp_bias),
        "down": lin(f, d, cfg.mlp_bias),
    }
    if cfg.qk_norm:
        layer["q_norm"] = (L, cfg.head_dim)
        layer["k_norm"] = (L, cfg.head_dim)
    if cfg.post_norms:
        layer["post_attn_norm"] = (L, d)
        layer["post_mlp_norm"] = (L, d)
    shapes = {"embed": (cfg.vocab_size, d), "layers": (layer,), "final_norm": (d,)}
    if not cfg.tie_embeddings:
        shapes["lm_head"] = (d, cfg.vocab_size)
    return shapes


_FLAT_INIT_MAX = 1 << 28  # elements; above this, one draw per leaf (no giant temporary, shards per leaf)


def init_params(key: jax.Array, cfg: ModelConfig, dtype=jnp.float32) -> Params:
    """Random parameters (normal * 0.02; norms at an effective scale of 1). For tests and shapes.

    Small models take one normal draw sliced into all weights: a separate threefry draw per leaf
    made the jitted init of a 4-layer toy model take ~6 s to compile on CPU (one draw: <1 s).
    Large ones draw per leaf, so no flat buffer of the whole model is ever materialised.
    """
    shapes = param_shapes(cfg)
    flat, treedef = jax.tree_util.tree_flatten_with_path(
        shapes, is_leaf=lambda x: isinstance(x, tuple) and all(isinstance(i, int) for i in x))
    is_norm = ["norm" in jax.tree_util.keystr(path) for path, _ in flat]
    total = sum(math.prod(shape) for (_, shape), norm in zip(flat, is_norm) if not norm)
    one_draw = total <= _FLAT_INIT_MAX
    noise = 0.02 * jax.random.normal(key, (total,), jnp.float32) if one_draw else None
    keys = None if one_draw else jax.random.split(key, len(flat))
    out, offset = [], 0
    for i, ((_, shape), norm) in enumerate(zip(flat, is_norm)):
        if norm:
            out.append(jnp.full(shape, 1.0 - cfg.norm_offset, dtype))
        elif one_draw:
            n = math.prod(shape)
            out.append(noise[offset:offset + n].reshape(shape).astype(dtype))
            offset += n
        else:
            out.append((0.02 * jax.random.normal(keys[i], shape, jnp.float32)).astype(dtype))
    return jax.tree.unflatten(treedef, out)


def split_segments(params: Params, n_adapt: int) -> Params:
    """Regroup layers so that the last ``n_adapt`` form their own (final) segment.

    Works on host (numpy) or device arrays; idempotent when the split already holds.
    """
    layers = params["layers"]
    if isinstance(layers, dict):  # tolerate an unwrapped single segment
        layers = (layers,)
    sizes = [_segment_len(s) for s in layers]
    total = sum(sizes)
    if not 0 <= n_adapt <= total:
        raise ValueError(f"n_adapt must be in [0, {total}], got {n_adapt}")
    if n_adapt in (0, total):
        want = [total]
    else:
        want = [total - n_adapt, n_adapt]
    if sizes == want:
        return params
    merged = _concat_segments(layers)
    cut = total - n_adapt
    segs = (merged,) if len(want) == 1 else (
        jax.tree.map(lambda a: a[:cut], merged), jax.tree.map(lambda a: a[cut:], merged))
    return {**params, "layers": segs}


def unstack_segments(params: Params) -> Params:
    """Turn every stacked segment into a tuple of per-layer dicts (unrolled execution)."""
    segs = []
    for seg in params["layers"]:
        if isinstance(seg, dict):
            n = _segment_len(seg)
            seg = tuple(jax.tree.map(lambda a, i=i: a[i], seg) for i in range(n))
        segs.append(seg)
    return {**params, "layers": tuple(segs)}


def _segment_len(seg) -> int:
    if isinstance(seg, (tuple, list)):
        return len(seg)
    return int(seg["attn_norm"].shape[0])


def _concat_segments(segs):
    stacked = []
    for s in segs:
        if isinstance(s, (tuple, list)):
            s = jax.tree.map(lambda *xs: _stack(xs), *s)
        stacked.append(s)
    if len(stacked) == 1:
        return stacked[0]
    return jax.tree.map(lambda *xs: _cat(xs), *stacked)


def _stack(xs):
    return np.stack(xs) if isinstance(xs[0], np.ndarray) else jnp.stack(xs)


def _cat(xs):
    return np.concatenate(xs) if isinstance(xs[0], np.ndarray) else jnp.concatenate(xs)


# --------------------------------------------------------------------------- building blocks


def rms_norm(x: jax.Array, w: jax.Array, eps: float, offset: float) -> jax.Array:
    """RMSNorm in float32, scale (offset + w); returns x's dtype."""
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (y * (offset + w.astype(jnp.float32))).astype(x.dtype)


def rope_tables(positions: jax.Array, inv_freq: np.ndarray, attention_scaling: float, dtype):
    """cos, sin: [B, T, D] for rotate-half rotary embeddings (HF layout)."""
    freqs = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)[None, None, :]
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return (jnp.cos(emb) * attention_scaling).astype(dtype), (jnp.sin(emb) * attention_scaling).astype(dtype)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """x: [B, T, H, D]; cos/sin: [B, T, D]."""
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos[:, :, None, :] + rotated * sin[:, :, None, :]


def _activation(name: str):
    if name == "silu":
        return jax.nn.silu
    if name == "gelu_tanh":
        return lambda x: jax.nn.gelu(x, approximate=True)
    return lambda x: jax.nn.gelu(x, approximate=False)


def _linear(x, p, target, lora, layer_lora):
    y = jnp.einsum("btd,df->btf", x, p["kernel"])
    if "bias" in p:
        y = y + p["bias"]
    if layer_lora is not None and target in layer_lora[0]:
        a, b = layer_lora[0][target], layer_lora[1][target]
        scale = lora.scale.astype(x.dtype)[:, None, :, None]
        if a.ndim == 4:  # gathered per row: [B, K, d_in, r], [B, K, r, d_out]
            xa = jnp.einsum("btd,bkdr->btkr", x, a.astype(x.dtype)) * scale
            y = y + jnp.einsum("btkr,bkro->bto", xa, b.astype(x.dtype))
        else:  # all experts, per-row weights scattered over them: [E, d_in, r], [E, r, d_out]
            xa = jnp.einsum("btd,edr->bter", x, a.astype(x.dtype)) * scale
            y = y + jnp.einsum("bter,ero->bto", xa, b.astype(x.dtype))
    return y


# --------------------------------------------------------------------------- forward


class AttnInputs(NamedTuple):
    cos_full: jax.Array
    sin_full: jax.Array
    cos_slide: jax.Array
    sin_slide: jax.Array
    mask_full: jax.Array  # bool [B, T, S]
    mask_slide: jax.Array  # bool [B, T, S]
    write_index: jax.Array | None  # int32 [] when a cache is used


def _block(cfg: ModelConfig, lp, x, sliding, attn: AttnInputs, cache_kv, lora, layer_lora):
    """One decoder block. Returns (x, (k_cache, v_cache) or None)."""
    B, T, _ = x.shape
    H, K, D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    eps, off = cfg.rms_norm_eps, cfg.norm_offset

    h = rms_norm(x, lp["attn_norm"], eps, off)
    q = _linear(h, lp["q"], "q", lora, layer_lora).reshape(B, T, H, D)
    k = _linear(h, lp["k"], "k", lora, layer_lora).reshape(B, T, K, D)
    v = _linear(h, lp["v"], "v", lora, layer_lora).reshape(B, T, K, D)
    if cfg.qk_norm:
        q = rms_norm(q, lp["q_norm"], eps, off)
        k = rms_norm(k, lp["k_norm"], eps, off)
    cos = jnp.where(sliding, attn.cos_slide, attn.cos_full)
    sin = jnp.where(sliding, attn.sin_slide, attn.sin_full)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)

    new_cache = None
    if cache_kv is not None:
        ck, cv = cache_kv
        ck = jax.lax.dynamic_update_slice(ck, k.astype(ck.dtype), (0, attn.write_index, 0, 0))
        cv = jax.lax.dynamic_update_slice(cv, v.astype(cv.dtype), (0, attn.write_index, 0, 0))
        new_cache = (ck, cv)
        k, v = ck.astype(x.dtype), cv.astype(x.dtype)

    mask = jnp.where(sliding, attn.mask_slide, attn.mask_full)  # [B, T, S]
    qg = q.reshape(B, T, K, H // K, D)
    logits = jnp.einsum("btkgd,bskd->bkgts", qg, k).astype(jnp.float32) * cfg.scale
    if cfg.attn_logit_softcap:
        logits = jnp.tanh(logits / cfg.attn_logit_softcap) * cfg.attn_logit_softcap
    logits = jnp.where(mask[:, None, None, :, :], logits, NEG_INF)
    probs = jax.nn.softmax(logits, axis=-1).astype(x.dtype)
    out = jnp.einsum("bkgts,bskd->btkgd", probs, v).reshape(B, T, H * D)
    out = _linear(out, lp["o"], "o", lora, layer_lora)
    if cfg.post_norms:
        out = rms_norm(out, lp["post_attn_norm"], eps, off)
    x = x + out

    h = rms_norm(x, lp["mlp_norm"], eps, off)
    act = _activation(cfg.activation)
    gate = _linear(h, lp["gate"], "gate", lora, layer_lora)
    up = _linear(h, lp["up"], "up", lora, layer_lora)
    out = _linear(act(gate) * up, lp["down"], "down", lora, layer_lora)
    if cfg.post_norms:
        out = rms_norm(out, lp["post_mlp_norm"], eps, off)
    return x + out, new_cache


def _run_segment(cfg, seg, flags, x, attn, seg_cache, lora):
    """Run one segment; ``lora`` applies to every layer of it when given."""
    if isinstance(seg, (tuple, list)):  # unrolled
        new_caches = []
        for i, lp in enumerate(seg):
            layer_lora = None
            if lora is not None:
                layer_lora = ({t: a[i] for t, a in lora.a.items()}, {t: b[i] for t, b in lora.b.items()})
            kv = None if seg_cache is None else (seg_cache[i]["k"], seg_cache[i]["v"])
            x, nc = _block(cfg, lp, x, bool(flags[i]), attn, kv, lora, layer_lora)
            new_caches.append(None if nc is None else {"k": nc[0], "v": nc[1]})
        return x, (None if seg_cache is None else tuple(new_caches))

    def body(x, xs):
        lp, sliding, kv, layer_lora = xs
        x, nc = _block(cfg, lp, x, sliding, attn, kv, lora, layer_lora)
        return x, nc

    kv = None if seg_cache is None else (seg_cache["k"], seg_cache["v"])
    layer_lora = None if lora is None else (lora.a, lora.b)
    x, nc = jax.lax.scan(body, x, (seg, jnp.asarray(flags), kv, layer_lora))
    return x, (None if nc is None else {"k": nc[0], "v": nc[1]})


def init_cache(cfg: ModelConfig, params: Params, batch: int, max_len: int, dtype=jnp.float32) -> dict:
    """An empty KV cache whose per-segment layout mirrors ``params["layers"]``.

    Returns {"layers": per segment {"k","v": [L_s, B, S, K, D]} (or a tuple of per-layer dicts
    for unrolled segments), "valid": bool[B, S], "index": int32[] next write slot}.
    """
    shape = (batch, max_len, cfg.num_kv_heads, cfg.head_dim)
    segs = []
    for seg in params["layers"]:
        n = _segment_len(seg)
        if isinstance(seg, (tuple, list)):
            segs.append(tuple({"k": jnp.zeros(shape, dtype), "v": jnp.zeros(shape, dtype)} for _ in range(n)))
        else:
            segs.append({"k": jnp.zeros((n, *shape), dtype), "v": jnp.zeros((n, *shape), dtype)})
    return {"layers": tuple(segs), "valid": jnp.zeros((batch, max_len), bool), "index": jnp.zeros((), jnp.int32)}


def forward(
    params: Params,
    cfg: ModelConfig,
    tokens: jax.Array,
    *,
    positions: jax.Array | None = None,
    valid: jax.Array | None = None,
    cache: dict | None = None,
    lora: LoraInputs | None = None,
    logits_mode: str = "all",
):
    """Decoder forward pass.

    Args:
      tokens: int32[B, T].
      positions: int32[B, T] rotary positions; default: count of valid tokens before each one
        (right for left-padded prompts).
      valid: bool[B, T], False at padding. Padding keys are never attended to.
      cache: from :func:`init_cache` (or a previous call). Tokens are written at
        ``cache["index"]``; queries attend to every valid cached key at or before them.
      lora: per-row LoRA deltas for the last segment (:class:`LoraInputs`).
      logits_mode: "all" -> [B, T, V]; "last" -> [B, V] at the last position; "hidden" -> final
        normed hidden states [B, T, d] (no LM head).

    Returns:
      (logits float32, new_cache or None).
    """
    chex.assert_rank(tokens, 2)
    B, T = tokens.shape
    if valid is None:
        valid = jnp.ones((B, T), bool)
    valid = valid.astype(bool)
    if positions is None:
        positions = jnp.maximum(jnp.cumsum(valid, axis=1) - 1, 0)
        if cache is not None:  # continue from the tokens already cached
            positions = positions + jnp.sum(cache["valid"], axis=1, keepdims=True)
    dtype = params["embed"].dtype

    x = jnp.take(params["embed"], tokens, axis=0)
    if cfg.embed_scale:
        x = x * jnp.asarray(cfg.hidden_size ** 0.5, dtype)

    q_idx = jnp.arange(T)
    if cache is None:
        key_valid, k_idx, write_index = valid, jnp.arange(T), None
    else:
        write_index = cache["index"]
        q_idx = q_idx + write_index
        key_valid = jax.lax.dynamic_update_slice(cache["valid"], valid, (0, write_index))
        k_idx = jnp.arange(key_valid.shape[1])
    causal = k_idx[None, :] <= q_idx[:, None]  # [T, S]
    mask_full = key_valid[:, None, :] & causal[None]
    if cfg.sliding_window:
        in_window = (q_idx[:, None] - k_idx[None, :]) < cfg.sliding_window
        mask_slide = mask_full & in_window[None]
    else:
        mask_slide = mask_full
    cos_f, sin_f = rope_tables(positions, cfg.rope_full.inv_freq(cfg.head_dim), cfg.rope_full.attention_scaling, dtype)
    rs = cfg.rope_sliding or cfg.rope_full
    cos_s, sin_s = rope_tables(positions, rs.inv_freq(cfg.head_dim), rs.attention_scaling, dtype)
    attn = AttnInputs(cos_f, sin_f, cos_s, sin_s, mask_full, mask_slide, write_index)

    flags, offset = cfg.sliding_flags, 0
    segs, new_segs = params["layers"], []
    for si, seg in enumerate(segs):
        n = _segment_len(seg)
        seg_lora = lora if (lora is not None and si == len(segs) - 1) else None
        if seg_lora is not None:
            n_lora = next(iter(seg_lora.a.values())).shape[0]
            if n_lora != n:
                raise ValueError(
                    f"LoRA covers {n_lora} layers but the last segment has {n}; call split_segments(params, {n_lora})")
        seg_cache = None if cache is None else cache["layers"][si]
        x, nc = _run_segment(cfg, seg, flags[offset:offset + n], x, attn, seg_cache, seg_lora)
        new_segs.append(nc)
        offset += n

    new_cache = None
    if cache is not None:
        new_cache = {"layers": tuple(new_segs), "valid": key_valid, "index": write_index + T}

    x = rms_norm(x, params["final_norm"], cfg.rms_norm_eps, cfg.norm_offset)
    if logits_mode == "hidden":
        return x, new_cache
    if logits_mode == "last":
        x = x[:, -1]
    elif logits_mode != "all":
        raise ValueError(f"logits_mode must be 'all', 'last' or 'hidden', got {logits_mode!r}")
    head = params["embed"].T if cfg.tie_embeddings else params["lm_head"]
    logits = jnp.einsum("...d,dv->...v", x, head).astype(jnp.float32)
    if cfg.final_logit_softcap:
        logits = jnp.tanh(logits / cfg.final_logit_softcap) * cfg.final_logit_softcap
    return logits, new_cache
