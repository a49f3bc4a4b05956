"""The decoder: one pure-function implementation for Llama, Qwen3, Gemma 3 and Gemma 4 (text).

Params are a plain pytree (see ``morse_jax.models.params.param_shapes``). Layers are grouped into *segments*:
``params["layers"]`` is a tuple of segments, each either

* a dict of arrays stacked on a leading layer axis (run under ``jax.lax.scan``; the default), or
* a tuple of per-layer dicts (run as an unrolled Python loop; what the sampler uses for decode,
  since per-layer cache buffers update in place where a scanned, stacked cache is copied).

A freshly loaded backbone has one segment; :func:`split_segments` splits off the last ``L_adapt``
layers so that LoRA experts attach to that segment only (``morse_jax.mole``). Gemma 4 layers
differ in shape (wider full-attention heads, no v where k = v, no k/v in KV-shared layers), so
there every run of identically shaped layers is its own stacked segment and the adapted layers
may span several; per-layer shapes come from ``ModelConfig.layer_*`` and the arrays themselves.

Shapes: B batch, T new tokens, S cache length, d hidden, H heads, K kv heads, D head dim.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import chex
import jax
import jax.numpy as jnp
import numpy as np

from morse_jax.models.config import ModelConfig
from morse_jax.models.params import init_params, layer_shapes, param_shapes, segment_sizes  # noqa: F401 - re-exported
from morse_jax.models.segments import segment_len as _segment_len
from morse_jax.models.segments import split_segments, unstack_segments  # noqa: F401 - re-exported

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
        a, b = _fit_lora(layer_lora[0][target], layer_lora[1][target], p["kernel"].shape, target)
        scale = lora.scale.astype(x.dtype)[:, None, :, None]
        if a.ndim == 4:  # gathered per row: [B, K, d_in, r], [B, K, r, d_out]
            xa = jnp.einsum("btd,bkdr->btkr", x, a.astype(x.dtype)) * scale
            y = y + jnp.einsum("btkr,bkro->bto", xa, b.astype(x.dtype))
        else:  # all experts, per-row weights scattered over them: [E, d_in, r], [E, r, d_out]
            xa = jnp.einsum("btd,edr->bter", x, a.astype(x.dtype)) * scale
            y = y + jnp.einsum("bter,ero->bto", xa, b.astype(x.dtype))
    return y


def _fit_lora(a, b, kernel_shape, target):
    """LoRA factors sized for the widest layer (``ModelConfig.target_dims``) cut to this layer's
    projection: a narrower layer (Gemma 4 sliding next to full attention) uses the leading
    input rows of A and output columns of B. Factors that are too small are an error."""
    d_in, d_out = kernel_shape
    if a.shape[-2] == d_in and b.shape[-1] == d_out:
        return a, b
    if a.shape[-2] < d_in or b.shape[-1] < d_out:
        raise ValueError(f"LoRA factors for {target!r} are {a.shape[-2]} -> {b.shape[-1]} but a layer's projection "
                         f"is {d_in} -> {d_out}; size expert banks with ModelConfig.target_dims")
    return a[..., :d_in, :], b[..., :d_out]


def rms_norm_unscaled(x: jax.Array, eps: float) -> jax.Array:
    """RMSNorm without a scale (Gemma 4's value norm), float32 statistics."""
    x32 = x.astype(jnp.float32)
    return (x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)).astype(x.dtype)


# --------------------------------------------------------------------------- forward


class AttnInputs(NamedTuple):
    cos_full: jax.Array  # [B, T, D_full]
    sin_full: jax.Array
    cos_slide: jax.Array  # [B, T, D_sliding]
    sin_slide: jax.Array
    mask_full: jax.Array  # bool [B, T, S]
    mask_slide: jax.Array  # bool [B, T, S]
    write_index: jax.Array | None  # int32 [] when a cache is used


def _rotary(attn: AttnInputs, sliding, D: int):
    """(cos, sin) for a layer of head dim D. Where full and sliding tables differ in width (Gemma
    4) the width says which one; otherwise ``sliding`` (possibly traced, under scan) selects."""
    if attn.cos_full.shape[-1] == attn.cos_slide.shape[-1]:
        return jnp.where(sliding, attn.cos_slide, attn.cos_full), jnp.where(sliding, attn.sin_slide, attn.sin_full)
    if D == attn.cos_full.shape[-1]:
        return attn.cos_full, attn.sin_full
    return attn.cos_slide, attn.sin_slide


def _block(cfg: ModelConfig, lp, x, sliding, attn: AttnInputs, cache_kv, lora, layer_lora, ple=None, shared=None):
    """One decoder block.

    ``ple``: [B, T, p] this layer's per-layer input (Gemma 4), or None. ``shared``: (k, v) of the
    layer whose keys/values a KV-shared layer (no k weights) attends to.
    Returns (x, (k_cache, v_cache) or None, (k, v) attended to).
    """
    B, T, _ = x.shape
    H = cfg.num_heads
    D = lp["q"]["kernel"].shape[-1] // H
    eps, off = cfg.rms_norm_eps, cfg.norm_offset

    h = rms_norm(x, lp["attn_norm"], eps, off)
    q = _linear(h, lp["q"], "q", lora, layer_lora).reshape(B, T, H, D)
    cos, sin = _rotary(attn, sliding, D)
    new_cache = None
    if "k" in lp:
        K = lp["k"]["kernel"].shape[-1] // D
        k = _linear(h, lp["k"], "k", lora, layer_lora).reshape(B, T, K, D)
        # Gemma 4 full-attention layers without v weights use the k projection as values
        v = _linear(h, lp["v"], "v", lora, layer_lora).reshape(B, T, K, D) if "v" in lp else k
        if cfg.qk_norm:
            q = rms_norm(q, lp["q_norm"], eps, off)
            k = rms_norm(k, lp["k_norm"], eps, off)
        if cfg.v_norm:
            v = rms_norm_unscaled(v, eps)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if cache_kv is not None:
            ck, cv = cache_kv
            ck = jax.lax.dynamic_update_slice(ck, k.astype(ck.dtype), (0, attn.write_index, 0, 0))
            cv = jax.lax.dynamic_update_slice(cv, v.astype(cv.dtype), (0, attn.write_index, 0, 0))
            new_cache = (ck, cv)
            k, v = ck.astype(x.dtype), cv.astype(x.dtype)
    else:  # KV-shared layer
        if cfg.qk_norm:
            q = rms_norm(q, lp["q_norm"], eps, off)
        q = apply_rope(q, cos, sin)
        k, v = (t.astype(x.dtype) for t in shared)
        K = k.shape[2]

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
    x = x + out
    if ple is not None:  # Gemma 4 per-layer input: a gated residual branch after the MLP
        g = act(_linear(x, lp["ple_gate"], "ple_gate", None, None)) * ple
        x = x + rms_norm(_linear(g, lp["ple_out"], "ple_out", None, None), lp["ple_post_norm"], eps, off)
    if "layer_scalar" in lp:
        x = x * lp["layer_scalar"].astype(x.dtype)
    return x, new_cache, (k, v)


def _run_segment(cfg, seg, layer_ids, x, attn, seg_cache, lora, ple=None, shared=None, want_kv=False,
                 kv_store=None):
    """Run one segment. ``lora``: LoraInputs for every layer of a stacked segment; for an unrolled
    one, per layer (a, b, LoraInputs) or None (see ``_segment_lora``).

    layer_ids: the segment's (global) layer indices. KV sharing (Gemma 4): a stacked segment of
    KV-shared layers attends to ``shared`` (k, v); with ``want_kv`` it also returns every layer's
    attended (k, v) [n, ...]. An unrolled segment reads and records producers' (k, v) in
    ``kv_store`` (by layer index) as it goes. ple: [n, B, T, p] per-layer inputs (a list when
    unrolled) or None.
    Returns (x, new segment cache or None, per-layer (k, v) or None).
    """
    flags = cfg.sliding_flags[list(layer_ids)]
    if isinstance(seg, (tuple, list)):  # unrolled
        modes = cfg.kv_sharing_modes
        new_caches = []
        for i, lp in enumerate(seg):
            entry = None if lora is None else lora[i]
            lora_i, layer_lora = (None, None) if entry is None else (entry[2], entry[:2])
            kv = None if seg_cache is None or seg_cache[i] is None else (seg_cache[i]["k"], seg_cache[i]["v"])
            gid = layer_ids[i]
            shared_i = kv_store[cfg.kv_producer(gid)] if modes[gid] == "reuse" else None
            x, nc, used = _block(cfg, lp, x, bool(flags[i]), attn, kv, lora_i, layer_lora,
                                 None if ple is None else ple[i], shared_i)
            if modes[gid] == "store":
                kv_store[gid] = used
            new_caches.append(None if nc is None else {"k": nc[0], "v": nc[1]})
        return x, (None if seg_cache is None else tuple(new_caches)), None

    def body(x, xs):
        lp, sliding, kv, layer_lora, ple_i = xs
        x, nc, used = _block(cfg, lp, x, sliding, attn, kv, lora, layer_lora, ple_i, shared)
        return x, (nc, used if want_kv else None)

    kv = None if seg_cache is None else (seg_cache["k"], seg_cache["v"])
    layer_lora = None if lora is None else (lora.a, lora.b)
    x, (nc, used) = jax.lax.scan(body, x, (seg, jnp.asarray(flags), kv, layer_lora, ple))
    return x, (None if nc is None else {"k": nc[0], "v": nc[1]}), used


def init_cache(cfg: ModelConfig, params: Params, batch: int, max_len: int, dtype=jnp.float32, *,
               start_layer: int = 0) -> dict:
    """An empty KV cache whose per-segment layout mirrors ``params["layers"]``.

    Returns {"layers": per segment {"k","v": [L_s, B, S, K, D]} (or a tuple of per-layer dicts
    for unrolled segments), "valid": bool[B, S], "index": int32[] next write slot}. K and D are
    the segment's own (Gemma 4 full-attention layers differ); KV-shared layers hold no cache
    (None: they read another layer's), nor do the segments before ``start_layer`` (for
    ``forward(start_layer=...)``, which skips them).
    """
    def kv_shape(lp):  # per-layer [B, S, K, D], or None for a KV-shared layer
        if "k" not in lp:
            return None
        D = lp["q"]["kernel"].shape[-1] // cfg.num_heads
        return (batch, max_len, lp["k"]["kernel"].shape[-1] // D, D)

    segs, offset = [], 0
    for seg in params["layers"]:
        n = _segment_len(seg)
        offset += n
        if offset <= start_layer:
            segs.append(None)
        elif isinstance(seg, (tuple, list)):
            shapes = [kv_shape(lp) for lp in seg]
            segs.append(tuple(None if sh is None else {"k": jnp.zeros(sh, dtype), "v": jnp.zeros(sh, dtype)}
                              for sh in shapes))
        else:
            shape = kv_shape(seg)
            segs.append(None if shape is None else
                        {"k": jnp.zeros((n, *shape), dtype), "v": jnp.zeros((n, *shape), dtype)})
    return {"layers": tuple(segs), "valid": jnp.zeros((batch, max_len), bool), "index": jnp.zeros((), jnp.int32)}


def per_layer_inputs(params: Params, cfg: ModelConfig, tokens: jax.Array, x: jax.Array) -> jax.Array:
    """Gemma 4 per-layer embeddings: [B, T, L, p] from token ids and the scaled input embeddings x.

    A token-identity part (a second embedding table, scaled by sqrt(p)) plus a context part (a
    projection of x scaled by 1/sqrt(d), RMS-normalised per layer), averaged with 1/sqrt(2).
    """
    B, T = tokens.shape
    L, p, dtype = cfg.num_layers, cfg.per_layer_input_size, x.dtype
    ids = jnp.take(params["ple_embed"], tokens, axis=0).reshape(B, T, L, p) * jnp.asarray(p ** 0.5, dtype)
    proj = jnp.einsum("btd,df->btf", x, params["ple_proj"]) * jnp.asarray(cfg.hidden_size ** -0.5, dtype)
    proj = rms_norm(proj.reshape(B, T, L, p), params["ple_norm"], cfg.rms_norm_eps, cfg.norm_offset)
    return (proj + ids) * jnp.asarray(2 ** -0.5, dtype)


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
    start_layer: int = 0,
    hidden: jax.Array | None = None,
    stop_layer: int | None = None,
):
    """Decoder forward pass.

    Args:
      tokens: int32[B, T].
      positions: int32[B, T] rotary positions; default: count of valid tokens before each one
        (right for left-padded prompts).
      valid: bool[B, T], False at padding. Padding keys are never attended to.
      cache: from :func:`init_cache` (or a previous call). Tokens are written at
        ``cache["index"]``; queries attend to every valid cached key at or before them.
      lora: per-row LoRA deltas for the last ``L_adapt`` layers (:class:`LoraInputs`). A stacked
        segment must lie entirely inside or outside them (:func:`split_segments`).
      logits_mode: "all" -> [B, T, V]; "last" -> [B, V] at the last position; "hidden" -> final
        normed hidden states [B, T, d] (no LM head).
      start_layer, hidden: run layers start_layer.. only, from ``hidden`` [B, T, d], the residual
        stream entering that layer (what ``stop_layer=start_layer`` returns, or the sampler's
        ``prefix_states``). A segment boundary must lie there (:func:`split_segments`); the cache
        entries of the skipped layers are passed through untouched (may be None).
      stop_layer: return the residual stream entering this layer [B, T, d] (no final norm, no
        head) instead of logits.

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
    _check_layer_range(cfg, start_layer, hidden, stop_layer, (B, T))

    x = jnp.take(params["embed"], tokens, axis=0)
    if cfg.embed_scale:
        x = x * jnp.asarray(cfg.hidden_size ** 0.5, dtype)
    ple = None
    if cfg.per_layer_input_size:
        ple = jnp.moveaxis(per_layer_inputs(params, cfg, tokens, x), 2, 0)  # [L, B, T, p]
    if start_layer:
        x = hidden.astype(dtype)

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
    cos_f, sin_f = rope_tables(positions, cfg.rope_full.inv_freq(cfg.full_head_dim), cfg.rope_full.attention_scaling,
                               dtype)
    rs = cfg.rope_sliding or cfg.rope_full
    cos_s, sin_s = rope_tables(positions, rs.inv_freq(cfg.head_dim), rs.attention_scaling, dtype)
    attn = AttnInputs(cos_f, sin_f, cos_s, sin_s, mask_full, mask_slide, write_index)

    offset, modes = 0, cfg.kv_sharing_modes
    stored: dict[int, tuple] = {}  # producer layer -> its attended (k, v), for KV-shared layers
    n_lora = 0 if lora is None else next(iter(lora.a.values())).shape[0]
    if n_lora > cfg.num_layers:
        raise ValueError(f"LoRA covers {n_lora} layers but the model has {cfg.num_layers}")
    first_lora = cfg.num_layers - n_lora
    segs, new_segs = params["layers"], []
    for si, seg in enumerate(segs):
        n = _segment_len(seg)
        idx = range(offset, offset + n)
        unrolled = isinstance(seg, (tuple, list))
        if offset < start_layer or (stop_layer is not None and offset >= stop_layer):
            if offset < start_layer < offset + n or (stop_layer is not None and offset < stop_layer < offset + n):
                raise ValueError(f"layers {offset}..{offset + n - 1} form one stacked segment; start_layer / "
                                 f"stop_layer must lie on a segment boundary (split_segments)")
            new_segs.append(None if cache is None else cache["layers"][si])
            offset += n
            continue
        seg_lora = _segment_lora(lora, offset, n, first_lora, n_lora, unrolled)
        seg_cache = None if cache is None else cache["layers"][si]
        seg_ple = None if ple is None else (ple[offset:offset + n] if not unrolled else [ple[i] for i in idx])
        if unrolled:
            x, nc, _ = _run_segment(cfg, seg, idx, x, attn, seg_cache, seg_lora, seg_ple, kv_store=stored)
        else:
            shared = stored[_shared_producer(cfg, idx)] if any(modes[i] == "reuse" for i in idx) else None
            want_kv = cache is None and any(modes[i] == "store" for i in idx)
            x, nc, used = _run_segment(cfg, seg, idx, x, attn, seg_cache, seg_lora, seg_ple, shared, want_kv)
            for j, i in enumerate(idx):
                if modes[i] == "store":  # with a cache: the producer's whole updated cache
                    stored[i] = (nc["k"][j], nc["v"][j]) if cache is not None else (used[0][j], used[1][j])
        new_segs.append(nc)
        offset += n

    new_cache = None
    if cache is not None:
        new_cache = {"layers": tuple(new_segs), "valid": key_valid, "index": write_index + T}

    if stop_layer is not None:
        return x, new_cache
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


def _check_layer_range(cfg: ModelConfig, start: int, hidden, stop: int | None, bt: tuple[int, int]) -> None:
    if not 0 <= start < cfg.num_layers:
        raise ValueError(f"start_layer={start} outside [0, {cfg.num_layers})")
    if (hidden is not None) != (start > 0):
        raise ValueError("hidden (the residual stream entering start_layer) is needed exactly when start_layer > 0")
    if hidden is not None:
        chex.assert_shape(hidden, (*bt, cfg.hidden_size))
    if stop is not None and not start < stop <= cfg.num_layers:
        raise ValueError(f"stop_layer={stop} must lie in ({start}, {cfg.num_layers}]")
    # a KV-shared layer attends to its producer's keys/values, which a skipped producer never made
    for i in range(start, cfg.num_layers if stop is None else stop):
        if cfg.kv_sharing_modes[i] == "reuse" and cfg.kv_producer(i) < start:
            raise ValueError(f"start_layer={start}: layer {i} reuses the keys/values of layer "
                             f"{cfg.kv_producer(i)}, which would not run")


def _segment_lora(lora, offset, n, first_lora, n_lora, unrolled):
    """The part of ``lora`` (covering layers first_lora..L-1) that applies to layers offset..offset+n-1.

    Stacked segments get LoraInputs over their layers (or None); unrolled ones a list of per-layer
    (a, b, LoraInputs) entries (None outside the adapted layers).
    """
    if lora is None or offset + n <= first_lora:
        return None
    if unrolled:
        out = []
        for i in range(offset, offset + n):
            j = i - first_lora
            out.append(None if j < 0 else ({t: a[j] for t, a in lora.a.items()}, {t: b[j] for t, b in lora.b.items()},
                                           lora))
        return out
    if offset < first_lora:
        raise ValueError(f"LoRA covers the last {n_lora} layers but a stacked segment spans layers {offset}.."
                         f"{offset + n - 1} across that boundary; call split_segments(params, {n_lora})")
    if (offset, n) == (first_lora, n_lora):
        return lora
    j = offset - first_lora
    return LoraInputs(a={t: a[j:j + n] for t, a in lora.a.items()}, b={t: b[j:j + n] for t, b in lora.b.items()},
                      scale=lora.scale)


def _shared_producer(cfg, idx):
    """The (producer) layer whose keys/values the KV-shared layers ``idx`` of a stacked segment
    attend to: one for the whole segment (they run under one scan)."""
    producers = {cfg.kv_producer(i) for i in idx}
    if len(producers) != 1:
        raise ValueError(f"stacked layers {idx[0]}..{idx[-1]} reuse the keys/values of different layers "
                         f"{sorted(producers)}; run them unrolled (unstack_segments)")
    return producers.pop()
