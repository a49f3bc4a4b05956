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

Each layer is ``morse_jax.models.block.decoder_layer`` (the one block the sampler's prefill and
decode step run too) in :class:`ModelLayout`, with LoRA through ``morse_jax.models.adapters``.
:func:`forward` reads top-down: inputs (:func:`_embed`, :func:`_attention_inputs`), the layers
(:func:`_run_layers`), the head (:func:`_head`).

Shapes: B batch, T new tokens, S cache length, d hidden, H heads, K kv heads, D head dim.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import chex
import jax
import jax.numpy as jnp

from morse_jax.models.adapters import GROUPS, LoraInputs, StackedAdapter  # noqa: F401 - LoraInputs re-exported
from morse_jax.models.block import REMAT, LayerDims, RowsLayout, decoder_layer, remat_layer
from morse_jax.models.config import ModelConfig
from morse_jax.models.layers import (Rope, attend, attention_masks, embed, final_logits, per_layer_inputs,
                                     positions_from_valid, rms_norm, rope_for)
from morse_jax.models.params import init_params, layer_shapes, param_shapes, segment_sizes  # noqa: F401 - re-exported
from morse_jax.models.segments import segment_len as _segment_len
from morse_jax.models.segments import split_segments, unstack_segments  # noqa: F401 - re-exported

Params = dict[str, Any]


class ModelLayout(RowsLayout):
    """The backbone's own weights: per target {"kernel": [d_in, d_out], "bias"?}, x @ W."""

    @staticmethod
    def linear(x, lp, group, out_dims):
        out = {}
        for t in GROUPS[group]:
            if t in lp:
                y = jnp.einsum("btd,df->btf", x, lp[t]["kernel"])
                out[t] = y + lp[t]["bias"] if "bias" in lp[t] else y
        return out


def model_dims(lp: dict, num_heads: int) -> LayerDims:
    """A layer's widths read off its (per-layer, unstacked) weights."""
    D = lp["q"]["kernel"].shape[-1] // num_heads
    K = lp["k"]["kernel"].shape[-1] // D if "k" in lp else 0
    return LayerDims(num_heads, K, D, "k" in lp, "v" in lp, lp["gate"]["kernel"].shape[-1])


class AttnInputs(NamedTuple):
    """Per-call attention inputs shared by every layer: rotary tables and masks."""

    rope_full: Rope  # (cos, sin) [B, T, D_full]
    rope_slide: Rope  # [B, T, D_sliding]
    mask_full: jax.Array  # bool [B, T, S]
    mask_slide: jax.Array  # bool [B, T, S]
    write_index: jax.Array | None  # int32 [] when a cache is used


def _rotary(attn: AttnInputs, sliding, D: int) -> Rope:
    """(cos, sin) for a layer of head dim D. Where full and sliding tables differ in width (Gemma
    4) the width says which one; otherwise ``sliding`` (possibly traced, under scan) selects."""
    (cos_f, sin_f), (cos_s, sin_s) = attn.rope_full, attn.rope_slide
    if cos_f.shape[-1] == cos_s.shape[-1]:
        return jnp.where(sliding, cos_s, cos_f), jnp.where(sliding, sin_s, sin_f)
    return attn.rope_full if D == cos_f.shape[-1] else attn.rope_slide


def _block(cfg: ModelConfig, lp, x, sliding, attn: AttnInputs, cache_kv, adapter, ple=None, shared=None):
    """One decoder layer (``block.decoder_layer``) with the model's cache layout: keys/values
    [B, S, K, D] written at ``attn.write_index``.

    ``cache_kv``: this layer's (k_cache, v_cache) or None; ``shared``: (k, v) of the layer whose
    keys/values a KV-shared layer (no k weights) attends to.
    Returns (x, (k_cache, v_cache) or None, (k, v) attended to, the adapter's aux {name: array}).
    """
    dims = model_dims(lp, cfg.num_heads)

    def attention(q, k, v):
        new_cache = None
        if k is None:  # KV-shared layer
            k, v = (t.astype(x.dtype) for t in shared)
        elif cache_kv is not None:
            ck, cv = cache_kv
            ck = jax.lax.dynamic_update_slice(ck, k.astype(ck.dtype), (0, attn.write_index, 0, 0))
            cv = jax.lax.dynamic_update_slice(cv, v.astype(cv.dtype), (0, attn.write_index, 0, 0))
            new_cache = (ck, cv)
            k, v = ck.astype(x.dtype), cv.astype(x.dtype)
        mask = jnp.where(sliding, attn.mask_slide, attn.mask_full)  # [B, T, S]
        return attend(q, k, v, mask, cfg), (new_cache, (k, v))

    x, (new_cache, used), aux = decoder_layer(cfg, ModelLayout, lp, x, dims, _rotary(attn, sliding, dims.head_dim),
                                              attention, adapter, ple)
    return x, new_cache, used, aux


def _run_segment(cfg, seg, layer_ids, x, attn, seg_cache, lora, ple=None, shared=None, want_kv=False,
                 kv_store=None, remat: str = "none"):
    """Run one segment. ``lora``: a StackedAdapter over every layer of a stacked segment; for an
    unrolled one, per layer an adapter value or None (see ``_segment_lora``).
    remat: see :func:`forward`; applies to the layers that carry an adapter.

    layer_ids: the segment's (global) layer indices. KV sharing (Gemma 4): a stacked segment of
    KV-shared layers attends to ``shared`` (k, v); with ``want_kv`` it also returns every layer's
    attended (k, v) [n, ...]. An unrolled segment reads and records producers' (k, v) in
    ``kv_store`` (by layer index) as it goes. ple: [n, B, T, p] per-layer inputs (a list when
    unrolled) or None.
    Returns (x, new segment cache or None, per-layer (k, v) or None, the adapters' aux stacked
    over the segment's layers: {name: [n, ...]}, {} without).
    """
    flags = cfg.sliding_flags[list(layer_ids)]
    if isinstance(seg, (tuple, list)):  # unrolled
        modes = cfg.kv_sharing_modes
        new_caches, auxes = [], []
        for i, lp in enumerate(seg):
            kv = None if seg_cache is None or seg_cache[i] is None else (seg_cache[i]["k"], seg_cache[i]["v"])
            gid = layer_ids[i]
            shared_i = kv_store[cfg.kv_producer(gid)] if modes[gid] == "reuse" else None
            adapter, ple_i = (None if lora is None else lora[i]), (None if ple is None else ple[i])

            def layer(x, lp=lp, sliding=bool(flags[i]), kv=kv, adapter=adapter, ple_i=ple_i, shared_i=shared_i):
                return _block(cfg, lp, x, sliding, attn, kv, adapter, ple_i, shared_i)

            x, nc, used, aux = (layer if adapter is None else remat_layer(layer, remat))(x)
            if modes[gid] == "store":
                kv_store[gid] = used
            new_caches.append(None if nc is None else {"k": nc[0], "v": nc[1]})
            if aux:  # only the adapted layers report any
                auxes.append(aux)
        aux = jax.tree.map(lambda *a: jnp.stack(a), *auxes) if auxes else {}
        return x, (None if seg_cache is None else tuple(new_caches)), None, aux

    layer_lora, rebuild = (None, None) if lora is None else lora.scan_parts()

    def body(x, xs):
        lp, sliding, kv, layer_lora, ple_i = xs
        adapter = None if layer_lora is None else rebuild(layer_lora)
        x, nc, used, aux = _block(cfg, lp, x, sliding, attn, kv, adapter, ple_i, shared)
        return x, (nc, used if want_kv else None, aux)

    if lora is not None:
        body = remat_layer(body, remat)
    kv = None if seg_cache is None else (seg_cache["k"], seg_cache["v"])
    x, (nc, used, aux) = jax.lax.scan(body, x, (seg, jnp.asarray(flags), kv, layer_lora, ple))
    return x, (None if nc is None else {"k": nc[0], "v": nc[1]}), used, aux


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


def forward(
    params: Params,
    cfg: ModelConfig,
    tokens: jax.Array,
    *,
    positions: jax.Array | None = None,
    valid: jax.Array | None = None,
    cache: dict | None = None,
    lora: StackedAdapter | None = None,
    logits_mode: str = "all",
    start_layer: int = 0,
    hidden: jax.Array | None = None,
    stop_layer: int | None = None,
    segment_ids: jax.Array | None = None,
    with_aux: bool = False,
    remat: str = "none",
):
    """Decoder forward pass.

    Args:
      tokens: int32[B, T].
      positions: int32[B, T] rotary positions; default: count of valid tokens before each one
        (right for left-padded prompts).
      valid: bool[B, T], False at padding. Padding keys are never attended to.
      cache: from :func:`init_cache` (or a previous call). Tokens are written at
        ``cache["index"]``; queries attend to every valid cached key at or before them.
      lora: an adapter over the last ``L_adapt`` layers: per-row LoRA deltas (:class:`LoraInputs`)
        or any ``adapters.StackedAdapter`` (e.g. ``morse_jax.mor``'s role groups). A stacked
        segment must lie entirely inside or outside them (:func:`split_segments`).
      logits_mode: "all" -> [B, T, V]; "last" -> [B, V] at the last position; "hidden" -> final
        normed hidden states [B, T, d] (no LM head).
      start_layer, hidden: run layers start_layer.. only, from ``hidden`` [B, T, d], the residual
        stream entering that layer (what ``stop_layer=start_layer`` returns, or the sampler's
        ``prefix_states``). A segment boundary must lie there (:func:`split_segments`); the cache
        entries of the skipped layers are passed through untouched (may be None).
      stop_layer: return the residual stream entering this layer [B, T, d] (no final norm, no
        head) instead of logits.
      segment_ids: int[B, T] packed segments (tokens attend only within their own); no cache.
      with_aux: also return the adapter's auxiliary outputs (``adapters.project_aux``) stacked
        over the adapted layers that ran, {name: [L, ...]} ({} without any).
      remat: one of ``REMAT`` (static): "none", or "layer": the backward pass recomputes each
        adapted layer's attention instead of keeping it (``block.remat_layer``). Same values.

    Returns:
      (logits float32, new_cache or None), plus the aux with ``with_aux``.
    """
    chex.assert_rank(tokens, 2)
    B, T = tokens.shape
    valid = jnp.ones((B, T), bool) if valid is None else valid.astype(bool)
    if positions is None:  # after the tokens already cached, if any
        positions = positions_from_valid(valid, None if cache is None else jnp.sum(cache["valid"], axis=1))
    _check_layer_range(cfg, start_layer, hidden, stop_layer, (B, T))
    if stop_layer is None and logits_mode not in ("all", "last", "hidden"):
        raise ValueError(f"logits_mode must be 'all', 'last' or 'hidden', got {logits_mode!r}")
    if remat not in REMAT:
        raise ValueError(f"remat must be one of {REMAT}, got {remat!r}")

    x, ple = _embed(params, cfg, tokens, start_layer, hidden)
    attn, key_valid = _attention_inputs(cfg, valid, positions, cache, params["embed"].dtype)
    if segment_ids is not None:
        if cache is not None:
            raise ValueError("segment_ids (packed rows) are for cache-free forwards")
        same = segment_ids[:, :, None] == segment_ids[:, None, :]
        attn = attn._replace(mask_full=attn.mask_full & same, mask_slide=attn.mask_slide & same)
    x, new_segs, aux = _run_layers(params, cfg, x, attn, cache, lora, ple, start_layer, stop_layer, remat)
    new_cache = None if cache is None else {"layers": new_segs, "valid": key_valid, "index": attn.write_index + T}
    out = (x, new_cache) if stop_layer is not None else (_head(params, cfg, x, logits_mode), new_cache)
    return (*out, aux) if with_aux else out


def _embed(params: Params, cfg: ModelConfig, tokens, start_layer: int, hidden):
    """The residual stream entering ``start_layer`` [B, T, d] and Gemma 4's per-layer inputs
    [L, B, T, p] (None for other families)."""
    x = embed(params["embed"], tokens, cfg)
    ple = None
    if cfg.per_layer_input_size:  # from the token embeddings, also when starting later
        ple = jnp.moveaxis(per_layer_inputs(params, cfg, tokens, x), 2, 0)
    if start_layer:
        x = hidden.astype(params["embed"].dtype)
    return x, ple


def _attention_inputs(cfg: ModelConfig, valid, positions, cache, dtype) -> tuple[AttnInputs, jax.Array]:
    """Rotary tables and masks for T new tokens (written at ``cache["index"]`` with a cache), and
    the keys' validity bool[B, S] after this call."""
    T = valid.shape[1]
    q_idx = jnp.arange(T)
    if cache is None:
        key_valid, write_index = valid, None
    else:
        write_index = cache["index"]
        q_idx = q_idx + write_index
        key_valid = jax.lax.dynamic_update_slice(cache["valid"], valid, (0, write_index))
    mask_full, mask_slide = attention_masks(cfg, key_valid, q_idx)
    rope_full, rope_slide = rope_for(cfg, positions, dtype)
    return AttnInputs(rope_full, rope_slide, mask_full, mask_slide, write_index), key_valid


def _run_layers(params: Params, cfg: ModelConfig, x, attn: AttnInputs, cache, lora, ple, start_layer: int,
                stop_layer: int | None, remat: str = "none"):
    """Run the segments covering layers start_layer..stop_layer-1 on x [B, T, d].

    Returns (x, per-segment new caches: skipped segments' entries passed through, None without a
    cache, the adapters' aux concatenated over the layers that ran, {name: [L, ...]})."""
    offset, modes = 0, cfg.kv_sharing_modes
    stored: dict[int, tuple] = {}  # producer layer -> its attended (k, v), for KV-shared layers
    n_lora = 0 if lora is None else lora.num_layers
    if n_lora > cfg.num_layers:
        raise ValueError(f"LoRA covers {n_lora} layers but the model has {cfg.num_layers}")
    first_lora = cfg.num_layers - n_lora
    new_segs, auxes = [], []
    for si, seg in enumerate(params["layers"]):
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
            x, nc, _, aux = _run_segment(cfg, seg, idx, x, attn, seg_cache, seg_lora, seg_ple, kv_store=stored,
                                         remat=remat)
        else:
            shared = stored[_shared_producer(cfg, idx)] if any(modes[i] == "reuse" for i in idx) else None
            want_kv = cache is None and any(modes[i] == "store" for i in idx)
            x, nc, used, aux = _run_segment(cfg, seg, idx, x, attn, seg_cache, seg_lora, seg_ple, shared, want_kv,
                                            remat=remat)
            for j, i in enumerate(idx):
                if modes[i] == "store":  # with a cache: the producer's whole updated cache
                    stored[i] = (nc["k"][j], nc["v"][j]) if cache is not None else (used[0][j], used[1][j])
        new_segs.append(nc)
        if aux:
            auxes.append(aux)
        offset += n
    aux = jax.tree.map(lambda *a: jnp.concatenate(a), *auxes) if auxes else {}
    return x, tuple(new_segs), aux


def _head(params: Params, cfg: ModelConfig, x, logits_mode: str):
    """Final norm, then the LM head (float32 logits [B, T, V], or [B, V] for "last") unless
    ``logits_mode`` is "hidden"."""
    x = rms_norm(x, params["final_norm"], cfg.rms_norm_eps, cfg.norm_offset)
    if logits_mode == "hidden":
        return x
    if logits_mode == "last":
        x = x[:, -1]
    return lm_head(params, cfg, x)


def lm_head(params: Params, cfg: ModelConfig, hidden: jax.Array) -> jax.Array:
    """Final-normed hidden [..., d] -> float32 logits [..., V], soft-capped where the family does."""
    head = params["embed"].T if cfg.tie_embeddings else params["lm_head"]
    return final_logits(jnp.einsum("...d,dv->...v", hidden, head), cfg)


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

    Stacked segments get the stacked adapter over their layers (or None); unrolled ones a list of
    per-layer adapter values (None outside the adapted layers).
    """
    if lora is None or offset + n <= first_lora:
        return None
    if unrolled:
        xs, rebuild = lora.scan_parts()
        return [None if i < first_lora else rebuild(jax.tree.map(lambda a, j=i - first_lora: a[j], xs))
                for i in range(offset, offset + n)]
    if offset < first_lora:
        raise ValueError(f"LoRA covers the last {n_lora} layers but a stacked segment spans layers {offset}.."
                         f"{offset + n - 1} across that boundary; call split_segments(params, {n_lora})")
    if (offset, n) == (first_lora, n_lora):
        return lora
    j = offset - first_lora
    return lora.layers(j, j + n)


def _shared_producer(cfg, idx):
    """The (producer) layer whose keys/values the KV-shared layers ``idx`` of a stacked segment
    attend to: one for the whole segment (they run under one scan)."""
    producers = {cfg.kv_producer(i) for i in idx}
    if len(producers) != 1:
        raise ValueError(f"stacked layers {idx[0]}..{idx[-1]} reuse the keys/values of different layers "
                         f"{sorted(producers)}; run them unrolled (unstack_segments)")
    return producers.pop()
