"""A cached forward specialised for generation: fused, transposed weights and a decode-friendly cache.

Same maths as ``morse_jax.models.transformer.forward`` with a cache (the sampler tests compare
greedy paths and log-probs against uncached full forwards on Llama, Gemma 3 and SmolLM2); what
differs is only how the work is laid out, for speed on CPU (measurements: ``bench/sampler.py``):

* Weights are stored ``[d_out, d_in]`` and a decode step keeps activations transposed
  (``[features, B]``), so every projection is ``W @ x`` with the weight streamed row-major and
  the tiny activation as the packed operand. With ``x @ W`` XLA's CPU dot packed the weight on
  every call: 10-25 % slower at batch 1-16. The tied LM head is then the embedding itself.
* q/k/v and gate/up are one matmul each (concatenated once): a decode step is hundreds of small
  ops, each with a fixed cost.
* Caches are per layer, keys in tiles of ``KEY_TILE`` slots ``[B*K, S/T, D, T]`` and values
  ``[B*K, S, D]``: both attention dots contract a minor axis (the key tile's d rows are slot
  vectors; with the model's ``[B, S, K, D]`` XLA transposed each layer's whole cache on every
  step), and the keys of the filled slots are one contiguous stream: with ``[B*K, D, S]`` the
  native kernel read D interleaved rows of stride S (30 layers' decode attention at batch 16 on
  an AVX2 host: 16-17 -> 13.5-14.5 ms).
* LoRA factors are rearranged once per device call (:func:`prepare_lora`), not per step.
* A native step of 1-4 rows reads a GGUF's blocks where attached (``gguf_blocks.with_blocks``).

The layer maths is ``morse_jax.models.block.decoder_layer``, the same block the training forward
runs; this module supplies only the layouts (:class:`FusedRows` for the prefill, :class:`FusedColumns`
for the step, both over :func:`decode_params`) and the cache layout (:func:`_write_cache`, :func:`_attend`).
Shapes: B batch, T new tokens, S cache length, d hidden, H heads, K kv heads, G = H / K, D head
dim, V vocab, f MLP width.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from morse_jax import kernels
from morse_jax.kernels import block_matmul
from morse_jax.models.adapters import LoraInputs, PreparedLora, prepare_lora  # noqa: F401 - prepare_lora re-exported
from morse_jax.models.block import ColumnsLayout, LayerDims, RowsLayout, decoder_layer
from morse_jax.models.config import ModelConfig
from morse_jax.models.key_tiles import KEY_TILE, key_tiles, read_key_slots, write_key_slots
from morse_jax.models.layers import (NEG_INF, attention_masks, attention_probs, embed, final_logits,
                                     per_layer_inputs, positions_from_valid, rope_for, soft_cap)  # noqa: F401 - positions_from_valid re-exported

FUSED = {"qkv": ("q", "k", "v"), "gu": ("gate", "up")}
LINEAR = ("q", "k", "v", "o", "gate", "up", "down")


# --------------------------------------------------------------------------- parameters and cache


def _layers(params) -> list[dict]:
    """Per-layer param dicts from any segment layout (stacked or unrolled segments)."""
    out = []
    for seg in params["layers"]:
        if isinstance(seg, (tuple, list)):
            out.extend(seg)
        else:
            n = int(seg["attn_norm"].shape[0])
            out.extend(jax.tree.map(lambda a, i=i: a[i], seg) for i in range(n))
    return out


@functools.partial(jax.jit, static_argnums=(1,))
def _fuse(params: dict, cfg: ModelConfig) -> dict:
    layers = []
    for lp in _layers(params):
        new = {k: v for k, v in lp.items() if k not in (*LINEAR, "ple_gate", "ple_out")}
        for name, parts in (*FUSED.items(), ("o", ("o",)), ("down", ("down",))):
            parts = [p for p in parts if p in lp]  # Gemma 4: no v (k = v) or no k, v (KV-shared) in some layers
            new[name] = {"w": jnp.concatenate([lp[p]["kernel"].T for p in parts], axis=0)}
            if "bias" in lp[parts[0]]:
                new[name]["bias"] = jnp.concatenate([lp[p]["bias"] for p in parts], axis=-1)
        for name in ("ple_gate", "ple_out"):
            if name in lp:
                new[name] = {"w": lp[name]["kernel"].T}
        layers.append(new)
    out = {"final_norm": params["final_norm"], "layers": tuple(layers)}
    if not cfg.tie_embeddings:
        out["head"] = params["lm_head"].T
    for name in ("ple_embed", "ple_proj", "ple_norm"):
        if name in params:
            out[name] = params[name]
    return out


def decode_params(params: dict, cfg: ModelConfig) -> dict:
    """Regroup backbone params for :func:`forward_cached` / :func:`decode_step`.

    Returns {"embed": [V, d] (the backbone's own array), "head": [V, d] (the embedding when
    tied, else lm_head transposed), "final_norm": [d], "layers": tuple over layers of
    {"qkv": {"w": [H*D + 2*K*D, d], "bias"?}, "o": {"w": [d, H*D]}, "gu": {"w": [2f, d]},
    "down": {"w": [d, f]}, norms}}. The regrouping is one jitted program.
    Gemma 4 layers have their own H*D / K*D (qkv holds only q, k where v = k, only q in KV-shared
    layers), plus {"ple_gate", "ple_out": {"w"}}, "layer_scalar"; and per-layer-input tables
    "ple_embed", "ple_proj", "ple_norm" at the top.
    """
    out = dict(_fuse(params, cfg))
    out["embed"] = params["embed"]
    out.setdefault("head", params["embed"])
    return out


def init_decode_cache(cfg: ModelConfig, batch: int, max_len: int, dtype=jnp.float32) -> dict:
    """{"k": tuple over layers of [B*K, ceil(S/T), D, T] (keys in tiles of ``KEY_TILE`` slots),
    "v": tuple of [B*K, S, D], "valid": bool[B, S], "index": int32[] next slot}. K, D per layer
    (Gemma 4); None for a KV-shared layer. Key slots past S (the last tile's padding) are never
    valid.

    Batch and kv heads share one axis: at batch 1 a separate, degenerate batch axis made XLA
    copy every layer's cache on every decode step (its in-place update did not survive the
    simplifier dropping the axis).
    """
    S, modes = max_len, cfg.kv_sharing_modes
    dims = [None if modes[i] == "reuse" else (batch * cfg.layer_kv_heads(i), cfg.layer_head_dim(i))
            for i in range(cfg.num_layers)]  # KV-shared layers (Gemma 4) read another layer's cache
    return {"k": tuple(None if x is None else jnp.zeros((x[0], key_tiles(S), x[1], KEY_TILE), dtype) for x in dims),
            "v": tuple(None if x is None else jnp.zeros((x[0], S, x[1]), dtype) for x in dims),
            "valid": jnp.zeros((batch, max_len), bool), "index": jnp.zeros((), jnp.int32)}


def rope_tables_for(cfg: ModelConfig, max_len: int, dtype) -> tuple:
    """((cos, sin) full, (cos, sin) sliding): [max_len, D] rotary tables for positions 0..max_len-1
    (D of full-attention layers for the first: Gemma 4's are wider).

    Compute once per device call (outside the decode loop) and pass to :func:`decode_step`.
    """
    full, slide = rope_for(cfg, jnp.arange(max_len)[None], dtype)
    return tuple(tuple(t[0] for t in pair) for pair in (full, slide))


def _rope_rows(cfg, rope, positions, max_len, dtype):
    """(cos, sin) [B, T, D] for full and sliding layers: rows of precomputed tables.

    Computing cos/sin from the positions inside a step let XLA fuse them into every layer's
    rotary multiply and evaluate them once per element (2 ms per decode step at batch 16).
    """
    if rope is None:
        rope = rope_tables_for(cfg, max_len, dtype)
    return [tuple(jnp.take(t, positions, axis=0) for t in pair) for pair in rope]


# --------------------------------------------------------------------------- layouts


def _split(y, out_dims, axis):
    """A fused projection's output cut into its parts ({part: d_out}, stored order) along ``axis``."""
    if out_dims is None:
        return y
    outs, start = {}, 0
    for part, size in out_dims.items():
        outs[part] = y[..., start:start + size] if axis == -1 else y[start:start + size]
        start += size
    return outs


class FusedRows(RowsLayout):
    """The prefill: :func:`decode_params` weights [d_out, d_in], activations [B, T, d]."""

    @staticmethod
    def linear(x, lp, group, out_dims):
        y = jnp.einsum("btd,fd->btf", x, lp[group]["w"])
        if "bias" in lp[group]:
            y = y + lp[group]["bias"]
        return _split(y, out_dims, -1) if out_dims is not None else {group: y}


class FusedColumns(ColumnsLayout):
    """The decode step: :func:`decode_params` weights, activations [d, B], ``W @ x`` by ``matmul``
    (jnp.matmul or ``kernels.matmul_cols``), or by ``block_matmul_cols`` from a projection's
    "blocks" where attached (``gguf_blocks.with_blocks``) and B is small enough."""

    def __init__(self, matmul=jnp.matmul, block_matmul_cols=None):
        self.matmul, self.block_matmul_cols = matmul, block_matmul_cols

    def weight_matmul(self, p: dict, x):  # p: one projection's {"w", "blocks"?}
        if self.block_matmul_cols is not None and "blocks" in p and x.shape[1] <= block_matmul.MAX_COLUMNS:
            return self.block_matmul_cols(p["blocks"], x)
        return self.matmul(p["w"], x)

    def linear(self, x, lp, group, out_dims):
        y = self.weight_matmul(lp[group], x)
        if "bias" in lp[group]:
            y = y + lp[group]["bias"][:, None]
        return _split(y, out_dims, 0) if out_dims is not None else {group: y}


# --------------------------------------------------------------------------- the cache layout


def _attend(q, ck, cv, mask, cfg, native=False):
    """q [B, T, H, D]; keys [B*K, S/T', D, T'] (tiles); values [B*K, S, D]; mask bool[B, T, S]
    -> [B, T, H*D].

    Query rows are (t, g) pairs folded into one axis so both dots are plain batched matmuls over
    (b, k) with no degenerate axes: with a T axis between g and s, XLA swapped the P.V operands
    and fell back to a slow transposed-operand dot (1.4 ms per layer at batch 16).
    A decode step (T = 1) on CPU computes both products as float32 multiply-reduce fusions: its dots
    are [G, D] x [D, S] per (b, k), so small that per-dot overhead dominated (30 layers at batch
    16: 23 -> 16 ms in isolation; the whole step 81-87 -> 77-81 ms, bench/sampler.py A/B).
    With ``native`` (T = 1, no logit soft-cap) the native kernel does it all in one call per layer,
    reading each cache only up to its last valid slot.
    """
    B, T, H, D = q.shape
    N, S = cv.shape[:2]
    K = N // B
    G = H // K
    qx = jnp.swapaxes(q.reshape(B, T, K, G, D), 1, 2).reshape(B * K, T * G, D)
    if native and T == 1 and not cfg.attn_logit_softcap:
        out = kernels.decode_attention(qx, ck, cv, mask[:, 0], cfg.scale).reshape(B, K, T, G, D)
        return jnp.swapaxes(out, 1, 2).reshape(B, T, H * D)
    f32 = jnp.float32
    reduce = T == 1 and jax.default_backend() == "cpu"  # GPUs/TPUs: matmul units, keep the dots
    if reduce:  # [N, X, 1, D, 1] * [N, 1, S/T', D, T'] summed over D
        scores = jnp.sum(qx[:, :, None, :, None].astype(f32) * ck[:, None].astype(f32), axis=3)
    else:
        scores = jnp.einsum("nxd,ntdj->nxtj", qx, ck).astype(f32)
    scores = scores.reshape(N, T * G, -1)[:, :, :S] * cfg.scale
    probs = attention_probs(scores.reshape(B, K, T, G, -1), mask[:, None, :, None, :], cfg, q.dtype)
    probs = probs.reshape(B * K, T * G, -1)
    if reduce:
        out = jnp.sum(probs[:, :, :, None].astype(f32) * cv[:, None].astype(f32), axis=2)
        out = out.astype(q.dtype).reshape(B, K, T, G, D)
    else:
        out = jnp.einsum("nxs,nsd->nxd", probs, cv).reshape(B, K, T, G, D)
    return jnp.swapaxes(out, 1, 2).reshape(B, T, H * D)


def _attend_prefix(q, ck, cv, key_valid, q_slots, cfg, sliding, block):
    """Attention over the filled prefix only (the prefill): q [B, T, H, D] at cache slots
    ``q_slots`` int[T] (consecutive), keys [B*K, S/T', D, T'] (tiles), values [B*K, S, D], key_valid bool[B, S]
    -> [B, T, H*D].

    Reads the cache in blocks of ``block`` slots up to the last query's slot (later slots are
    causally masked anyway), combining them with an online softmax (running max and normaliser,
    as flash attention): a prefill chunk at slot ``idx`` does ``idx + T`` slots of work instead of
    the whole cache (at batch 16, 7 chunks of 32 into a 384-slot cache: 2.6x less attention work
    than :func:`_attend` over the cache). Same maths as :func:`_attend` up to float rounding, for
    every query that has a valid key; a query with none (a padding token: its output is never
    attended to or returned) averages the values it read instead of all of them.
    """
    B, T, H, D = q.shape
    S = cv.shape[1]
    K = cv.shape[0] // B
    G = H // K
    block = min(block, S)
    f32 = jnp.float32
    qx = jnp.swapaxes(q.reshape(B, T, K, G, D), 1, 2).reshape(B * K, T * G, D)
    n_blocks = (q_slots[-1] + block) // block  # blocks holding slots 0 .. q_slots[-1]

    def body(j, carry):
        m, norm, acc = carry
        start = jnp.minimum(j * block, S - block)  # a last block past the cache end is moved back ...
        k_slots = start + jnp.arange(block)
        fresh = k_slots >= j * block  # ... and the slots the previous block covered masked out
        masks = attention_masks(cfg, jax.lax.dynamic_slice_in_dim(key_valid, start, block, 1), q_slots, start)
        mask = (masks[1] if sliding else masks[0]) & fresh  # [B, T, block]
        kb = read_key_slots(ck, start, block)
        vb = jax.lax.dynamic_slice_in_dim(cv, start, block, axis=1)
        scores = soft_cap(jnp.einsum("nxd,nds->nxs", qx, kb).astype(f32) * cfg.scale, cfg.attn_logit_softcap)
        scores = scores.reshape(B, K, T, G, block)
        scores = jnp.where(mask[:, None, :, None, :], scores, NEG_INF).reshape(B * K, T * G, block)
        m_new = jnp.maximum(m, jnp.max(scores, axis=-1))
        p = jnp.exp(scores - m_new[..., None])
        fade = jnp.exp(m - m_new)  # 0 once a valid key lifts the max above NEG_INF: masked-only blocks drop out
        norm = norm * fade + jnp.sum(p, axis=-1)
        acc = acc * fade[..., None] + jnp.einsum("nxs,nsd->nxd", p.astype(q.dtype), vb).astype(f32)
        return m_new, norm, acc

    carry = (jnp.full((B * K, T * G), NEG_INF, f32), jnp.zeros((B * K, T * G), f32),
             jnp.zeros((B * K, T * G, D), f32))
    _, norm, acc = jax.lax.fori_loop(0, n_blocks, body, carry)
    out = (acc / norm[..., None]).astype(q.dtype).reshape(B, K, T, G, D)
    return jnp.swapaxes(out, 1, 2).reshape(B, T, H * D)


def _write_cache(cache, i, k, v, idx):
    """k, v [B, T, K, D] -> caches with slots idx..idx+T-1 written."""
    ck, cv = cache["k"][i], cache["v"][i]
    B, T, K, D = k.shape
    kn = jnp.transpose(k, (0, 2, 3, 1)).reshape(B * K, D, T)
    vn = jnp.swapaxes(v, 1, 2).reshape(B * K, T, D)
    ck = write_key_slots(ck, kn, idx)
    cv = jax.lax.dynamic_update_slice(cv, vn.astype(cv.dtype), (0, idx, 0))
    return ck, cv


def _run_layers(dp, cfg: ModelConfig, layout, x, ple_of, rope, attend, cache, lora, capture_layer):
    """Every layer on x (layout activations), reading and writing the cache at ``cache["index"]``.

    ple_of(i): layer i's per-layer input in the layout (Gemma 4) or None. rope: ((cos, sin)
    full, (cos, sin) sliding) [B, T, D]; attend(q, keys, values, sliding) -> [B, T, H*D]: the
    attention over the layer's updated cache (:func:`_attend_prefix` or :func:`_attend`).
    Returns (x, new keys, new values (tuples over layers, None for KV-shared layers), the
    residual entering ``capture_layer`` in rows [B, (T,) d] or None).
    """
    idx, dtype = cache["index"], dp["embed"].dtype
    first_adapted = cfg.num_layers - (len(lora) if lora is not None else 0)
    new_k, new_v, captured = [], [], None
    for i, lp in enumerate(dp["layers"]):
        if i == capture_layer:
            captured = layout.rows(x)
        sliding = bool(cfg.sliding_flags[i])
        dims = LayerDims.of_layer(cfg, i)
        producer = None if dims.has_kv else cfg.kv_producer(i)

        def attention(q, k, v, i=i, producer=producer, sliding=sliding):
            if k is None:  # KV-shared layer: the producer's cache, already written this call
                ck, cv = new_k[producer], new_v[producer]
            else:
                ck, cv = _write_cache(cache, i, k, v, idx)
            return attend(q, ck.astype(dtype), cv.astype(dtype), sliding), (ck, cv)

        adapter = lora[i - first_adapted] if lora is not None and i >= first_adapted else None
        x, (ck, cv), _ = decoder_layer(cfg, layout, lp, x, dims, rope[1] if sliding else rope[0], attention,
                                    adapter, ple_of(i))
        new_k.append(ck if producer is None else None)
        new_v.append(cv if producer is None else None)
    return x, tuple(new_k), tuple(new_v), captured


def forward_cached(dp: dict, cfg: ModelConfig, tokens: jax.Array, valid: jax.Array, positions: jax.Array,
                   cache: dict, lora: tuple | None, rope: tuple | None = None, *,
                   last_only: bool = True, capture_layer: int | None = None):
    """Forward ``T`` new tokens per row through the cache (the prefill); written at ``cache["index"]``.

    Args:
      dp: from :func:`decode_params`. tokens: int32[B, T]. valid: bool[B, T] (False = padding:
        never attended to). positions: int32[B, T] rotary positions.
      cache: from :func:`init_decode_cache` or a previous call. lora: per adapted layer (the last
        ``len(lora)``) an adapter value: :func:`prepare_lora` of ``gather_lora``'s output, or any
        other adapter type (``adapters`` docstring; e.g. ``morse_jax.mor.adapter.layer_values``), or None.
      rope: :func:`rope_tables_for` the cache length, or None (computed here).
      last_only: logits at the last position only ([B, V]) instead of [B, T, V].
      capture_layer: also return the residual stream entering this layer, [B, T, d] (the
        trainer restarts there: ``forward(start_layer=..., hidden=...)``).
    Returns:
      (float32 logits, new cache), plus the captured residual with ``capture_layer``.
    """
    T = tokens.shape[1]
    x = embed(dp["embed"], tokens, cfg)
    ple = per_layer_inputs(dp, cfg, tokens, x) if cfg.per_layer_input_size else None  # [B, T, L, p]
    idx = cache["index"]
    key_valid = jax.lax.dynamic_update_slice(cache["valid"], valid, (0, idx))
    q_slots = idx + jnp.arange(T)

    def attend(q, ck, cv, sliding):
        return _attend_prefix(q, ck, cv, key_valid, q_slots, cfg, sliding, block=T)

    rope = _rope_rows(cfg, rope, positions, cache["valid"].shape[1], dp["embed"].dtype)
    x, new_k, new_v, captured = _run_layers(dp, cfg, FusedRows, x, lambda i: None if ple is None else ple[:, :, i],
                                            rope, attend, cache, lora, capture_layer)
    if last_only:
        x = x[:, -1]
    x = FusedRows.norm(x, dp["final_norm"], cfg.rms_norm_eps, cfg.norm_offset)
    logits = final_logits(jnp.einsum("...d,vd->...v", x, dp["head"]), cfg)
    new_cache = {"k": new_k, "v": new_v, "valid": key_valid, "index": idx + T}
    return (logits, new_cache) if capture_layer is None else (logits, new_cache, captured)


def decode_step(dp: dict, cfg: ModelConfig, tokens: jax.Array, active: jax.Array, positions: jax.Array,
                cache: dict, lora: tuple | None, rope: tuple | None = None, *,
                capture_layer: int | None = None, native: bool = False):
    """One new token per row (the decode step), activations kept as [features, B].

    Args:
      tokens: int32[B]. active: bool[B] (False: a finished or padding row; its token is written
        as invalid and never attended to). positions: int32[B]. cache, lora: as
        :func:`forward_cached`. rope: :func:`rope_tables_for` the cache length (computed here
        when None; pass it from outside a decode loop). capture_layer: as :func:`forward_cached`
        (the captured residual is [B, d]). native: run the weight projections, the LM head and
        the attention on the native CPU kernels (``morse_jax.kernels``; float32 weights and
        caches, CPU, unsharded, kernels registered: the sampler checks, ``SamplerConfig.cpu_kernels``).
    Returns:
      (float32 logits [B, V], new cache), plus the captured residual with ``capture_layer``.
    """
    if native:
        kernels.ensure_registered()  # once per process (cached); raises KernelBuildError
    layout = FusedColumns(kernels.matmul_cols, block_matmul.block_matmul_cols) if native else FusedColumns()
    x0 = embed(dp["embed"], tokens, cfg)  # [B, d]
    ple = per_layer_inputs(dp, cfg, tokens[:, None], x0[:, None])[:, 0] if cfg.per_layer_input_size else None
    idx = cache["index"]
    key_valid = jax.lax.dynamic_update_slice(cache["valid"], active[:, None], (0, idx))
    masks = attention_masks(cfg, key_valid, idx + jnp.arange(1))

    def attend(q, ck, cv, sliding):
        return _attend(q, ck, cv, masks[1] if sliding else masks[0], cfg, native)

    rope = _rope_rows(cfg, rope, positions[:, None], cache["valid"].shape[1], dp["embed"].dtype)
    xT, new_k, new_v, captured = _run_layers(dp, cfg, layout, x0.T, lambda i: None if ple is None else ple[:, i].T,
                                             rope, attend, cache, lora, capture_layer)
    hT = layout.norm(xT, dp["final_norm"], cfg.rms_norm_eps, cfg.norm_offset)
    if native:
        head = {"w": dp["head"], **({"blocks": dp["head_blocks"]} if "head_blocks" in dp else {})}
        logits = final_logits(layout.weight_matmul(head, hT).T, cfg)
    else:  # the barrier keeps XLA from folding the transpose into the dot ("h @ E^T"), which it
        # then ran as a naive loop: 95 ms at batch 4 instead of ~6 ms
        logits = final_logits(jax.lax.optimization_barrier(dp["head"] @ hT).T, cfg)
    new_cache = {"k": new_k, "v": new_v, "valid": key_valid, "index": idx + 1}
    return (logits, new_cache) if capture_layer is None else (logits, new_cache, captured)
