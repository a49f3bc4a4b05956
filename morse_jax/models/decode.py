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
* Caches are per layer, keys ``[B*K, D, S]`` and values ``[B*K, S, D]``: both attention dots
  are plain batched matmuls over (b, k) contracting a minor axis; with the model's
  ``[B, S, K, D]`` XLA transposed each layer's whole cache on every step.
* LoRA factors are rearranged once per device call (:func:`prepare_lora`), not per step.

Shapes: B batch, T new tokens, S cache length, d hidden, H heads, K kv heads, G = H / K, D head
dim, V vocab, f MLP width.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from morse_jax import kernels
from morse_jax.models.config import ModelConfig
from morse_jax.models.transformer import (NEG_INF, LoraInputs, apply_rope, per_layer_inputs, rms_norm, rms_norm_unscaled,
                                          rope_tables)

FUSED = {"qkv": ("q", "k", "v"), "gu": ("gate", "up")}
LINEAR = ("q", "k", "v", "o", "gate", "up", "down")
GROUPS = {"qkv": ("q", "k", "v"), "o": ("o",), "gu": ("gate", "up"), "down": ("down",)}  # targets by input


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
    """{"k": tuple over layers of [B*K, D, S] (keys transposed), "v": tuple of [B*K, S, D],
    "valid": bool[B, S], "index": int32[] next slot}. K, D per layer (Gemma 4); None for a
    KV-shared layer.

    Batch and kv heads share one axis: at batch 1 a separate, degenerate batch axis made XLA
    copy every layer's cache on every decode step (its in-place update did not survive the
    simplifier dropping the axis).
    """
    S, modes = max_len, cfg.kv_sharing_modes
    dims = [None if modes[i] == "reuse" else (batch * cfg.layer_kv_heads(i), cfg.layer_head_dim(i))
            for i in range(cfg.num_layers)]  # KV-shared layers (Gemma 4) read another layer's cache
    return {"k": tuple(None if x is None else jnp.zeros((x[0], x[1], S), dtype) for x in dims),
            "v": tuple(None if x is None else jnp.zeros((x[0], S, x[1]), dtype) for x in dims),
            "valid": jnp.zeros((batch, max_len), bool), "index": jnp.zeros((), jnp.int32)}


def positions_from_valid(valid: jax.Array, start: jax.Array | None = None) -> jax.Array:
    """Rotary positions of new tokens: valid tokens before each one in the row (+ ``start[B]``)."""
    pos = jnp.maximum(jnp.cumsum(valid, axis=1) - 1, 0)
    return pos if start is None else pos + start[:, None]


# --------------------------------------------------------------------------- LoRA


def prepare_lora(lora: LoraInputs) -> tuple[dict, ...]:
    """Rearrange ``gather_lora`` output once per device call, outside the decode loop.

    Per adapted layer and input group (targets that read the same activation): one A for all the
    group's targets, so a step does one A product per group and one B product per target:

    * all experts (``compose="onehot"``): A [n, d_in] (n = targets * E * r, shared by every row),
      per-row scales s [B, n] applied after A; B[t] [d_out, E*r].
    * gathered per row: A [B, n, d_in] with each row's scales folded in; B[t] [B, d_out, Ka*r].

    Returns a tuple over adapted layers of {"A": {group}, "s": {group} (all experts only), "B": {target}}.
    """
    first = next(iter(lora.a.values()))
    shared = first.ndim == 4  # [L, E, d_in, r]
    out = []
    for j in range(first.shape[0]):
        layer = {"A": {}, "s": {}, "B": {}}
        for group, parts in GROUPS.items():
            present = [t for t in parts if t in lora.a]
            if not present:
                continue
            As, Ss = [], []
            for t in present:
                a, b = lora.a[t][j], lora.b[t][j]
                if shared:  # a [E, d_in, r], b [E, r, d_out]
                    E, d_in, r = a.shape
                    As.append(jnp.transpose(a, (0, 2, 1)).reshape(E * r, d_in))
                    Ss.append(jnp.repeat(lora.scale, r, axis=1))
                    layer["B"][t] = b.reshape(E * r, -1).T
                else:  # a [B, Ka, d_in, r], b [B, Ka, r, d_out]
                    Bsz, Ka, d_in, r = a.shape
                    a = a * lora.scale[:, :, None, None].astype(a.dtype)
                    As.append(jnp.transpose(a, (0, 1, 3, 2)).reshape(Bsz, Ka * r, d_in))
                    layer["B"][t] = jnp.swapaxes(b.reshape(Bsz, Ka * r, -1), 1, 2)
            layer["A"][group] = jnp.concatenate(As, axis=-2)
            if shared:
                layer["s"][group] = jnp.concatenate(Ss, axis=-1)
        out.append(layer)
    return tuple(out)


def _split_lora(xa, layer, group, contract, sizes=None):
    """Apply each target's B to its slice of ``xa``; ``contract(piece, B)`` does the product.

    ``sizes`` ({target: d_out}, None: as stored) cuts B to a narrower layer's outputs and skips
    targets the layer does not have (``transformer._fit_lora`` explains the widths)."""
    deltas, start = {}, 0
    for t in GROUPS[group]:
        if t in layer["B"]:
            Bt = layer["B"][t]
            n = Bt.shape[-1]
            if sizes is None or t in sizes:
                if sizes is not None and Bt.shape[-2] != sizes[t]:
                    Bt = _cut(Bt, sizes[t], -2, t)
                deltas[t] = contract(xa, start, n, Bt.astype(xa.dtype))
            start += n
    return deltas


def _cut(w, size, axis, target):
    if w.shape[axis] < size:
        raise ValueError(f"LoRA factors for {target!r} are narrower ({w.shape[axis]}) than a layer's projection "
                         f"({size}); size expert banks with ModelConfig.target_dims")
    return jax.lax.slice_in_dim(w, 0, size, axis=axis % w.ndim)


def _fit_a(A, d_in, group):
    return A if A.shape[-1] == d_in else _cut(A, d_in, -1, group)


def _lora_rows(x, layer, group, sizes=None) -> dict:
    """Row-major activations x [B, T, d_in] -> {target: [B, T, d_out]}."""
    if layer is None or group not in layer["A"]:
        return {}
    A = _fit_a(layer["A"][group], x.shape[-1], group).astype(x.dtype)
    if A.ndim == 2:
        xa = jnp.einsum("btd,nd->btn", x, A) * layer["s"][group][:, None, :].astype(x.dtype)
        return _split_lora(xa, layer, group, lambda v, s, n, Bt: jnp.einsum("btn,on->bto", v[..., s:s + n], Bt),
                           sizes)
    xa = jnp.einsum("btd,bnd->btn", x, A)
    return _split_lora(xa, layer, group, lambda v, s, n, Bt: jnp.einsum("btn,bon->bto", v[..., s:s + n], Bt), sizes)


def _lora_cols(xT, layer, group, sizes=None) -> dict:
    """Transposed activations xT [d_in, B] -> {target: [d_out, B]}."""
    if layer is None or group not in layer["A"]:
        return {}
    A = _fit_a(layer["A"][group], xT.shape[0], group).astype(xT.dtype)
    if A.ndim == 2:
        xa = (A @ xT) * layer["s"][group].T.astype(xT.dtype)
        return _split_lora(xa, layer, group, lambda v, s, n, Bt: Bt @ v[s:s + n], sizes)
    xa = jnp.einsum("db,bnd->nb", xT, A)
    return _split_lora(xa, layer, group, lambda v, s, n, Bt: jnp.einsum("nb,bon->ob", v[s:s + n], Bt), sizes)


# --------------------------------------------------------------------------- shared pieces


def _attend(q, ck, cv, mask, cfg, native=False):
    """q [B, T, H, D]; keys [B*K, D, S]; values [B*K, S, D]; mask bool[B, T, S] -> [B, T, H*D].

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
    K = cv.shape[0] // B
    G = H // K
    qx = jnp.swapaxes(q.reshape(B, T, K, G, D), 1, 2).reshape(B * K, T * G, D)
    if native and T == 1 and not cfg.attn_logit_softcap:
        out = kernels.decode_attention(qx, ck, cv, mask[:, 0], cfg.scale).reshape(B, K, T, G, D)
        return jnp.swapaxes(out, 1, 2).reshape(B, T, H * D)
    f32 = jnp.float32
    reduce = T == 1 and jax.default_backend() == "cpu"  # GPUs/TPUs: matmul units, keep the dots
    if reduce:
        scores = jnp.sum(qx[:, :, :, None].astype(f32) * ck[:, None].astype(f32), axis=2) * cfg.scale
    else:
        scores = jnp.einsum("nxd,nds->nxs", qx, ck).astype(jnp.float32) * cfg.scale
    if cfg.attn_logit_softcap:
        scores = jnp.tanh(scores / cfg.attn_logit_softcap) * cfg.attn_logit_softcap
    scores = scores.reshape(B, K, T, G, -1)
    scores = jnp.where(mask[:, None, :, None, :], scores, NEG_INF)
    probs = jax.nn.softmax(scores, axis=-1).astype(q.dtype).reshape(B * K, T * G, -1)
    if reduce:
        out = jnp.sum(probs[:, :, :, None].astype(f32) * cv[:, None].astype(f32), axis=2)
        out = out.astype(q.dtype).reshape(B, K, T, G, D)
    else:
        out = jnp.einsum("nxs,nsd->nxd", probs, cv).reshape(B, K, T, G, D)
    return jnp.swapaxes(out, 1, 2).reshape(B, T, H * D)


def _masks(cfg, key_valid, idx, T):
    """Full and sliding-window masks bool[B, T, S] for T queries written at slots idx..idx+T-1."""
    S = key_valid.shape[1]
    q_slot = idx + jnp.arange(T)
    k_slot = jnp.arange(S)
    causal = k_slot[None, :] <= q_slot[:, None]  # slots advance with positions within a row
    full = key_valid[:, None, :] & causal[None]
    if not cfg.sliding_window:
        return full, full
    return full, full & ((q_slot[:, None] - k_slot[None, :]) < cfg.sliding_window)[None]


def _rope(cfg, positions, dtype):
    D = cfg.head_dim
    cos_f, sin_f = rope_tables(positions, cfg.rope_full.inv_freq(cfg.full_head_dim), cfg.rope_full.attention_scaling,
                               dtype)
    rs = cfg.rope_sliding or cfg.rope_full
    cos_s, sin_s = rope_tables(positions, rs.inv_freq(D), rs.attention_scaling, dtype)
    return (cos_f, sin_f), (cos_s, sin_s)


def rope_tables_for(cfg: ModelConfig, max_len: int, dtype) -> tuple:
    """((cos, sin) full, (cos, sin) sliding): [max_len, D] rotary tables for positions 0..max_len-1
    (D of full-attention layers for the first: Gemma 4's are wider).

    Compute once per device call (outside the decode loop) and pass to :func:`decode_step`.
    """
    pos = jnp.arange(max_len)[None]
    full, slide = _rope(cfg, pos, dtype)
    return tuple(tuple(t[0] for t in pair) for pair in (full, slide))


def _rope_rows(cfg, rope, positions, max_len, dtype):
    """(cos, sin) [B, T, D] for full and sliding layers: rows of precomputed tables.

    Computing cos/sin from the positions inside a step let XLA fuse them into every layer's
    rotary multiply and evaluate them once per element (2 ms per decode step at batch 16).
    """
    if rope is None:
        rope = rope_tables_for(cfg, max_len, dtype)
    return [tuple(jnp.take(t, positions, axis=0) for t in pair) for pair in rope]


def _activation(name: str):
    if name == "silu":
        return jax.nn.silu
    if name == "gelu_tanh":
        return lambda x: jax.nn.gelu(x, approximate=True)
    return lambda x: jax.nn.gelu(x, approximate=False)


def _normed_kv(k, v, lp, cfg, cos, sin, eps, off):
    """New keys and values [B, T, K, D] as the cache stores them: k/v norms, rotary on keys."""
    if cfg.qk_norm:
        k = rms_norm(k, lp["k_norm"], eps, off)
    if cfg.v_norm:
        v = rms_norm_unscaled(v, eps)
    return apply_rope(k, cos, sin), v


def _write_cache(cache, i, k, v, idx):
    """k, v [B, T, K, D] -> caches with slots idx..idx+T-1 written."""
    ck, cv = cache["k"][i], cache["v"][i]
    B, T, K, D = k.shape
    kn = jnp.transpose(k, (0, 2, 3, 1)).reshape(B * K, D, T)
    vn = jnp.swapaxes(v, 1, 2).reshape(B * K, T, D)
    ck = jax.lax.dynamic_update_slice(ck, kn.astype(ck.dtype), (0, 0, idx))
    cv = jax.lax.dynamic_update_slice(cv, vn.astype(cv.dtype), (0, idx, 0))
    return ck, cv


def _logits(cfg, logits):
    logits = logits.astype(jnp.float32)
    if cfg.final_logit_softcap:
        logits = jnp.tanh(logits / cfg.final_logit_softcap) * cfg.final_logit_softcap
    return logits


# --------------------------------------------------------------------------- T tokens (prefill)


def _proj_rows(x, lp, name, layer_lora, sizes=None):
    """x [B, T, d_in] @ W^T (+ bias, + LoRA of its parts); fused outputs split by ``sizes``
    ({part: d_out} in fused order: the parts the layer has)."""
    y = jnp.einsum("btd,fd->btf", x, lp[name]["w"])
    if "bias" in lp[name]:
        y = y + lp[name]["bias"]
    deltas = _lora_rows(x, layer_lora, name, sizes)
    if sizes is None:
        return y + deltas[name] if name in deltas else y
    outs, start = [], 0
    for part, size in sizes.items():
        piece = y[..., start:start + size]
        outs.append(piece + deltas[part] if part in deltas else piece)
        start += size
    return outs


def forward_cached(dp: dict, cfg: ModelConfig, tokens: jax.Array, valid: jax.Array, positions: jax.Array,
                   cache: dict, lora: tuple[dict, ...] | None, rope: tuple | None = None, *,
                   last_only: bool = True, capture_layer: int | None = None):
    """Forward ``T`` new tokens per row through the cache (the prefill); written at ``cache["index"]``.

    Args:
      dp: from :func:`decode_params`. tokens: int32[B, T]. valid: bool[B, T] (False = padding:
        never attended to). positions: int32[B, T] rotary positions.
      cache: from :func:`init_decode_cache` or a previous call. lora: :func:`prepare_lora` of
        ``gather_lora``'s output (the last ``len(lora)`` layers are adapted), or None.
      rope: :func:`rope_tables_for` the cache length, or None (computed here).
      last_only: logits at the last position only ([B, V]) instead of [B, T, V].
      capture_layer: also return the residual stream entering this layer, [B, T, d] (the
        trainer restarts there: ``forward(start_layer=..., hidden=...)``).
    Returns:
      (float32 logits, new cache), plus the captured residual with ``capture_layer``.
    """
    B, T = tokens.shape
    eps, off = cfg.rms_norm_eps, cfg.norm_offset
    dtype = dp["embed"].dtype
    x = jnp.take(dp["embed"], tokens, axis=0)
    if cfg.embed_scale:
        x = x * jnp.asarray(cfg.hidden_size ** 0.5, dtype)
    ple = per_layer_inputs(dp, cfg, tokens, x) if cfg.per_layer_input_size else None  # [B, T, L, p]
    idx = cache["index"]
    key_valid = jax.lax.dynamic_update_slice(cache["valid"], valid, (0, idx))
    mask_full, mask_slide = _masks(cfg, key_valid, idx, T)
    rope_full, rope_slide = _rope_rows(cfg, rope, positions, cache["valid"].shape[1], dtype)
    first_adapted = cfg.num_layers - (len(lora) if lora is not None else 0)
    act = _activation(cfg.activation)
    new_k, new_v, captured = [], [], None
    for i, lp in enumerate(dp["layers"]):
        if i == capture_layer:
            captured = x
        sliding = bool(cfg.sliding_flags[i])
        H, K, D, sizes, producer = _layer_dims(cfg, i)
        layer_lora = lora[i - first_adapted] if lora is not None and i >= first_adapted else None
        h = rms_norm(x, lp["attn_norm"], eps, off)
        qkv = _proj_rows(h, lp, "qkv", layer_lora, sizes)
        q = qkv[0].reshape(B, T, H, D)
        if cfg.qk_norm:
            q = rms_norm(q, lp["q_norm"], eps, off)
        cos, sin = rope_slide if sliding else rope_full
        q = apply_rope(q, cos, sin)
        if producer is None:
            k = qkv[1].reshape(B, T, K, D)
            v = qkv[2].reshape(B, T, K, D) if len(qkv) == 3 else k  # Gemma 4 k = v layers
            ck, cv = _write_cache(cache, i, *_normed_kv(k, v, lp, cfg, cos, sin, eps, off), idx)
        else:  # KV-shared layer: the producer's cache, already written this call
            ck, cv = new_k[producer], new_v[producer]
        new_k.append(None if producer is not None else ck)
        new_v.append(None if producer is not None else cv)
        out = _attend(q, ck.astype(dtype), cv.astype(dtype), mask_slide if sliding else mask_full, cfg)
        out = _proj_rows(out, lp, "o", layer_lora)
        if cfg.post_norms:
            out = rms_norm(out, lp["post_attn_norm"], eps, off)
        x = x + out
        h = rms_norm(x, lp["mlp_norm"], eps, off)
        f = cfg.layer_intermediate_size(i)
        gate, up = _proj_rows(h, lp, "gu", layer_lora, {"gate": f, "up": f})
        out = _proj_rows(act(gate) * up, lp, "down", layer_lora)
        if cfg.post_norms:
            out = rms_norm(out, lp["post_mlp_norm"], eps, off)
        x = x + out
        if ple is not None:
            g = act(jnp.einsum("btd,pd->btp", x, lp["ple_gate"]["w"])) * ple[:, :, i]
            x = x + rms_norm(jnp.einsum("btp,dp->btd", g, lp["ple_out"]["w"]), lp["ple_post_norm"], eps, off)
        if "layer_scalar" in lp:
            x = x * lp["layer_scalar"].astype(x.dtype)
    if last_only:
        x = x[:, -1]
    x = rms_norm(x, dp["final_norm"], eps, off)
    logits = _logits(cfg, jnp.einsum("...d,vd->...v", x, dp["head"]))
    new_cache = {"k": tuple(new_k), "v": tuple(new_v), "valid": key_valid, "index": idx + T}
    return (logits, new_cache) if capture_layer is None else (logits, new_cache, captured)


def _layer_dims(cfg: ModelConfig, i: int):
    """(H, K, D, {part: d_out} of the fused qkv, producer layer of a KV-shared layer or None)."""
    H, K, D = cfg.num_heads, cfg.layer_kv_heads(i), cfg.layer_head_dim(i)
    if cfg.kv_sharing_modes[i] == "reuse":
        return H, K, D, {"q": H * D}, cfg.kv_producer(i)
    sizes = {"q": H * D, "k": K * D}
    if cfg.layer_has_v(i):
        sizes["v"] = K * D
    return H, K, D, sizes, None


# --------------------------------------------------------------------------- one token (decode)


def _norm_cols(xT, w, eps, off):
    """RMSNorm of transposed activations [d, B] (float32 statistics), as ``rms_norm``."""
    x32 = xT.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=0, keepdims=True) + eps)
    return (y * (off + w.astype(jnp.float32))[:, None]).astype(xT.dtype)


def _proj_cols(xT, lp, name, layer_lora, sizes=None, matmul=jnp.matmul):
    """W @ xT [d_in, B] (+ bias, + LoRA); fused outputs split by ``sizes`` along axis 0."""
    y = matmul(lp[name]["w"], xT)
    if "bias" in lp[name]:
        y = y + lp[name]["bias"][:, None]
    deltas = _lora_cols(xT, layer_lora, name, sizes)
    if sizes is None:
        return y + deltas[name] if name in deltas else y
    outs, start = [], 0
    for part, size in sizes.items():
        piece = y[start:start + size]
        outs.append(piece + deltas[part] if part in deltas else piece)
        start += size
    return outs


def decode_step(dp: dict, cfg: ModelConfig, tokens: jax.Array, active: jax.Array, positions: jax.Array,
                cache: dict, lora: tuple[dict, ...] | None, rope: tuple | None = None, *,
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
    B = tokens.shape[0]
    eps, off = cfg.rms_norm_eps, cfg.norm_offset
    dtype = dp["embed"].dtype
    if native:
        kernels.ensure_registered()  # once per process (cached); raises KernelBuildError
    matmul = kernels.matmul_cols if native else jnp.matmul
    x0 = jnp.take(dp["embed"], tokens, axis=0)  # [B, d]
    if cfg.embed_scale:
        x0 = x0 * jnp.asarray(cfg.hidden_size ** 0.5, dtype)
    xT = x0.T
    ple = per_layer_inputs(dp, cfg, tokens[:, None], x0[:, None])[:, 0] if cfg.per_layer_input_size else None
    idx = cache["index"]
    key_valid = jax.lax.dynamic_update_slice(cache["valid"], active[:, None], (0, idx))
    mask_full, mask_slide = _masks(cfg, key_valid, idx, 1)
    rope_full, rope_slide = _rope_rows(cfg, rope, positions[:, None], cache["valid"].shape[1], dtype)
    first_adapted = cfg.num_layers - (len(lora) if lora is not None else 0)
    act = _activation(cfg.activation)
    new_k, new_v, captured = [], [], None
    for i, lp in enumerate(dp["layers"]):
        if i == capture_layer:
            captured = xT.T
        sliding = bool(cfg.sliding_flags[i])
        H, K, D, sizes, producer = _layer_dims(cfg, i)
        layer_lora = lora[i - first_adapted] if lora is not None and i >= first_adapted else None
        hT = _norm_cols(xT, lp["attn_norm"], eps, off)
        qkvT = _proj_cols(hT, lp, "qkv", layer_lora, sizes, matmul)
        q = qkvT[0].T.reshape(B, 1, H, D)
        if cfg.qk_norm:
            q = rms_norm(q, lp["q_norm"], eps, off)
        cos, sin = rope_slide if sliding else rope_full
        q = apply_rope(q, cos, sin)
        if producer is None:
            k = qkvT[1].T.reshape(B, 1, K, D)
            v = qkvT[2].T.reshape(B, 1, K, D) if len(qkvT) == 3 else k  # Gemma 4 k = v layers
            ck, cv = _write_cache(cache, i, *_normed_kv(k, v, lp, cfg, cos, sin, eps, off), idx)
        else:  # KV-shared layer: the producer's cache, already written this step
            ck, cv = new_k[producer], new_v[producer]
        new_k.append(None if producer is not None else ck)
        new_v.append(None if producer is not None else cv)
        out = _attend(q, ck.astype(dtype), cv.astype(dtype), mask_slide if sliding else mask_full, cfg, native)
        outT = _proj_cols(out.reshape(B, H * D).T, lp, "o", layer_lora, matmul=matmul)
        if cfg.post_norms:
            outT = _norm_cols(outT, lp["post_attn_norm"], eps, off)
        xT = xT + outT
        hT = _norm_cols(xT, lp["mlp_norm"], eps, off)
        f = cfg.layer_intermediate_size(i)
        gate, up = _proj_cols(hT, lp, "gu", layer_lora, {"gate": f, "up": f}, matmul)
        outT = _proj_cols(act(gate) * up, lp, "down", layer_lora, matmul=matmul)
        if cfg.post_norms:
            outT = _norm_cols(outT, lp["post_mlp_norm"], eps, off)
        xT = xT + outT
        if ple is not None:
            gT = act(matmul(lp["ple_gate"]["w"], xT)) * ple[:, i].T
            xT = xT + _norm_cols(matmul(lp["ple_out"]["w"], gT), lp["ple_post_norm"], eps, off)
        if "layer_scalar" in lp:
            xT = xT * lp["layer_scalar"].astype(xT.dtype)[:, None]
    hT = _norm_cols(xT, dp["final_norm"], eps, off)
    if native:
        logits = _logits(cfg, matmul(dp["head"], hT).T)
    else:  # the barrier keeps XLA from folding the transpose into the dot ("h @ E^T"), which it
        # then ran as a naive loop: 95 ms at batch 4 instead of ~6 ms
        logits = _logits(cfg, jax.lax.optimization_barrier(dp["head"] @ hT).T)
    new_cache = {"k": tuple(new_k), "v": tuple(new_v), "valid": key_valid, "index": idx + 1}
    return (logits, new_cache) if capture_layer is None else (logits, new_cache, captured)
