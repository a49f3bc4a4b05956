"""A cached forward specialised for generation: fused projections, a decode-friendly KV layout.

Same maths as ``morse_jax.models.transformer.forward`` with a cache (the tests compare the two on
Llama and Gemma 3 models); what differs is only how the work is laid out, for speed on CPU:

* q/k/v and gate/up projections are one matmul each (weights concatenated once, at sampler
  construction): at decode time every XLA op carries a fixed cost, and 7 matmuls per layer
  become 4.
* The KV cache is ``[B, K, S, D]`` per layer (the model keeps ``[B, S, K, D]``), so the attention
  dots contract over the minor dimension without a transpose; with the model's layout XLA copied
  every layer's whole cache into the other order on every step.
* The LM head is stored transposed (``[d, V]``) once instead of transposing the tied embedding
  inside the step.

Shapes: B batch, T new tokens, S cache length, d hidden, H heads, K kv heads, G = H / K, D head
dim, V vocab.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from morse_jax.models.config import ModelConfig
from morse_jax.models.transformer import NEG_INF, LoraInputs, apply_rope, rms_norm, rope_tables

FUSED = {"qkv": ("q", "k", "v"), "gu": ("gate", "up")}


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
def decode_params(params: dict, cfg: ModelConfig) -> dict:
    """Regroup backbone params for :func:`forward_cached`.

    Returns {"embed": [V, d], "head": [d, V], "final_norm": [d], "layers": tuple over layers of
    {"qkv": {"kernel": [d, H*D + 2*K*D], "bias"?}, "o", "gu": {"kernel": [d, 2f], "bias"?},
    "down", norms}}. Jitted: one program instead of hundreds of eager slices.
    """
    layers = []
    for lp in _layers(params):
        new = {k: v for k, v in lp.items() if k not in ("q", "k", "v", "gate", "up")}
        for name, parts in FUSED.items():
            new[name] = {"kernel": jnp.concatenate([lp[p]["kernel"] for p in parts], axis=-1)}
            if "bias" in lp[parts[0]]:
                new[name]["bias"] = jnp.concatenate([lp[p]["bias"] for p in parts], axis=-1)
        layers.append(new)
    head = params["embed"].T if cfg.tie_embeddings else params["lm_head"]
    return {"embed": params["embed"], "head": head,  # a jit output: materialised [d, V]
            "final_norm": params["final_norm"], "layers": tuple(layers)}


def init_decode_cache(cfg: ModelConfig, batch: int, max_len: int, dtype=jnp.float32) -> dict:
    """{"k": tuple over layers of [B, K, D, S] (keys transposed), "v": tuple of [B, K, S, D],
    "valid": bool[B, S], "index": int32[] next slot}."""
    B, K, S, D = batch, cfg.num_kv_heads, max_len, cfg.head_dim
    return {"k": tuple(jnp.zeros((B, K, D, S), dtype) for _ in range(cfg.num_layers)),
            "v": tuple(jnp.zeros((B, K, S, D), dtype) for _ in range(cfg.num_layers)),
            "valid": jnp.zeros((batch, max_len), bool), "index": jnp.zeros((), jnp.int32)}


GROUPS = {"qkv": ("q", "k", "v"), "o": ("o",), "gu": ("gate", "up"), "down": ("down",)}  # targets by input


def prepare_lora(lora: LoraInputs) -> tuple[dict, ...]:
    """Rearrange ``gather_lora`` output once per call, outside the decode loop.

    Per adapted layer and input group (targets that read the same activation): one A matrix
    for all the group's targets, so a step does one ``x @ A`` per group and one ``@ B`` per
    target, with no per-step transposes (XLA re-laid out the gathered factors on every step):

    * all experts (``compose="onehot"``): A [d_in, n] (n = targets * E * r, shared by every row)
      with per-row scales s [B, n] applied to x A; B[t] [E*r, d_out].
    * gathered per row: A [B, d_in, n] with the row's scales folded in; B[t] [B, Ka*r, d_out].

    Returns a tuple over adapted layers of {"A": {group}, "s": {group} (all-experts only), "B": {target}}.
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
                if shared:
                    E, d_in, r = a.shape
                    As.append(jnp.transpose(a, (1, 0, 2)).reshape(d_in, E * r))
                    Ss.append(jnp.repeat(lora.scale, r, axis=1))
                    layer["B"][t] = b.reshape(E * r, b.shape[-1])
                else:
                    Bsz, Ka, d_in, r = a.shape
                    a = a * lora.scale[:, :, None, None].astype(a.dtype)
                    As.append(jnp.transpose(a, (0, 2, 1, 3)).reshape(Bsz, d_in, Ka * r))
                    layer["B"][t] = b.reshape(Bsz, Ka * r, b.shape[-1])
            layer["A"][group] = jnp.concatenate(As, axis=-1)
            if shared:
                layer["s"][group] = jnp.concatenate(Ss, axis=-1)
        out.append(layer)
    return tuple(out)


def _lora_deltas(x, layer, group) -> dict:
    """{target: delta [B, T, d_out]} for the targets of ``group`` (x [B, T, d_in])."""
    if layer is None or group not in layer["A"]:
        return {}
    A = layer["A"][group].astype(x.dtype)
    if A.ndim == 2:
        xa = jnp.einsum("btd,dn->btn", x, A) * layer["s"][group][:, None, :].astype(x.dtype)
    else:
        xa = jnp.einsum("btd,bdn->btn", x, A)
    deltas, start = {}, 0
    for t in GROUPS[group]:
        if t in layer["B"]:
            Bt = layer["B"][t].astype(x.dtype)
            n = Bt.shape[-2]
            piece = xa[..., start:start + n]
            start += n
            deltas[t] = jnp.einsum("btn,no->bto", piece, Bt) if Bt.ndim == 2 else jnp.einsum("btn,bno->bto", piece, Bt)
    return deltas


def forward_cached(dp: dict, cfg: ModelConfig, tokens: jax.Array, valid: jax.Array, positions: jax.Array,
                   cache: dict, lora: tuple[dict, ...] | None, *, last_only: bool = True):
    """Forward ``T`` new tokens per row through the cache; tokens are written at ``cache["index"]``.

    Args:
      dp: from :func:`decode_params`. tokens: int32[B, T]. valid: bool[B, T] (False = padding or
        a finished row: never attended to). positions: int32[B, T] rotary positions.
      cache: from :func:`init_decode_cache` or a previous call. lora: :func:`prepare_lora` of
        ``gather_lora``'s output (the last ``len(lora)`` layers are adapted), or None.
      last_only: return logits at the last position only ([B, V]) instead of [B, T, V].
    Returns:
      (float32 logits, new cache).
    """
    B, T = tokens.shape
    H, K, D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    eps, off = cfg.rms_norm_eps, cfg.norm_offset
    dtype = dp["embed"].dtype
    x = jnp.take(dp["embed"], tokens, axis=0)
    if cfg.embed_scale:
        x = x * jnp.asarray(cfg.hidden_size ** 0.5, dtype)

    idx = cache["index"]
    key_valid = jax.lax.dynamic_update_slice(cache["valid"], valid, (0, idx))
    S = key_valid.shape[1]
    q_slot = idx + jnp.arange(T)
    k_slot = jnp.arange(S)
    causal = k_slot[None, :] <= q_slot[:, None]  # [T, S]; slots advance with positions within a row
    mask_full = key_valid[:, None, :] & causal[None]
    mask_slide = mask_full
    if cfg.sliding_window:
        mask_slide = mask_full & ((q_slot[:, None] - k_slot[None, :]) < cfg.sliding_window)[None]
    cos_f, sin_f = rope_tables(positions, cfg.rope_full.inv_freq(D), cfg.rope_full.attention_scaling, dtype)
    rs = cfg.rope_sliding or cfg.rope_full
    cos_s, sin_s = rope_tables(positions, rs.inv_freq(D), rs.attention_scaling, dtype)

    q_dim, kv_dim = H * D, K * D
    first_adapted = cfg.num_layers - (len(lora) if lora is not None else 0)
    new_k, new_v = [], []
    for i, lp in enumerate(dp["layers"]):
        sliding = bool(cfg.sliding_flags[i])
        layer_lora = lora[i - first_adapted] if lora is not None and i >= first_adapted else None
        h = rms_norm(x, lp["attn_norm"], eps, off)
        qkv = _proj_split(h, lp, "qkv", layer_lora, (q_dim, kv_dim, kv_dim))
        q = qkv[0].reshape(B, T, H, D)
        k = qkv[1].reshape(B, T, K, D)
        v = qkv[2].reshape(B, T, K, D)
        if cfg.qk_norm:
            q = rms_norm(q, lp["q_norm"], eps, off)
            k = rms_norm(k, lp["k_norm"], eps, off)
        cos, sin = (cos_s, sin_s) if sliding else (cos_f, sin_f)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        ck = jax.lax.dynamic_update_slice(cache["k"][i], jnp.transpose(k, (0, 2, 3, 1)).astype(cache["k"][i].dtype),
                                          (0, 0, 0, idx))
        cv = jax.lax.dynamic_update_slice(cache["v"][i], jnp.swapaxes(v, 1, 2).astype(cache["v"][i].dtype),
                                          (0, 0, idx, 0))
        new_k.append(ck)
        new_v.append(cv)

        out = _attend(q, ck.astype(dtype), cv.astype(dtype), mask_slide if sliding else mask_full, cfg)
        out = _proj_split(out, lp, "o", layer_lora, None)
        if cfg.post_norms:
            out = rms_norm(out, lp["post_attn_norm"], eps, off)
        x = x + out

        h = rms_norm(x, lp["mlp_norm"], eps, off)
        gate, up = _proj_split(h, lp, "gu", layer_lora, (cfg.intermediate_size,) * 2)
        out = _proj_split(_activation(cfg.activation)(gate) * up, lp, "down", layer_lora, None)
        if cfg.post_norms:
            out = rms_norm(out, lp["post_mlp_norm"], eps, off)
        x = x + out

    if last_only:
        x = x[:, -1]
    x = rms_norm(x, dp["final_norm"], eps, off)
    logits = jnp.einsum("...d,dv->...v", x, dp["head"]).astype(jnp.float32)
    if cfg.final_logit_softcap:
        logits = jnp.tanh(logits / cfg.final_logit_softcap) * cfg.final_logit_softcap
    new_cache = {"k": tuple(new_k), "v": tuple(new_v), "valid": key_valid, "index": idx + T}
    return logits, new_cache


def _attend(q, ck, cv, mask, cfg):
    """q [B, T, H, D]; keys [B, K, D, S]; values [B, K, S, D]; mask bool[B, T, S] -> [B, T, H*D].

    Query rows are (t, g) pairs folded into one axis so both dots are plain batched matmuls over
    (b, k) with no degenerate axes: with a T axis between g and s, XLA swapped the P.V operands
    and fell back to a slow transposed-operand dot (1.4 ms per layer at batch 16).
    """
    B, T, H, D = q.shape
    K = cv.shape[1]
    G = H // K
    qx = jnp.swapaxes(q.reshape(B, T, K, G, D), 1, 2).reshape(B, K, T * G, D)
    scores = jnp.einsum("bkxd,bkds->bkxs", qx, ck).astype(jnp.float32) * cfg.scale
    if cfg.attn_logit_softcap:
        scores = jnp.tanh(scores / cfg.attn_logit_softcap) * cfg.attn_logit_softcap
    scores = scores.reshape(B, K, T, G, -1)
    scores = jnp.where(mask[:, None, :, None, :], scores, NEG_INF)
    probs = jax.nn.softmax(scores, axis=-1).astype(q.dtype).reshape(B, K, T * G, -1)
    out = jnp.einsum("bkxs,bksd->bkxd", probs, cv).reshape(B, K, T, G, D)
    return jnp.swapaxes(out, 1, 2).reshape(B, T, H * D)


def _proj_split(x, lp, name, layer_lora, sizes):
    """Projection ``name`` (fused when ``sizes`` is given) + LoRA of its parts; split outputs."""
    y = jnp.einsum("btd,df->btf", x, lp[name]["kernel"])
    if "bias" in lp[name]:
        y = y + lp[name]["bias"]
    deltas = _lora_deltas(x, layer_lora, name)
    if sizes is None:
        return y + deltas[name] if name in deltas else y
    outs, start = [], 0
    for part, size in zip(FUSED[name], sizes):
        piece = y[..., start:start + size]
        outs.append(piece + deltas[part] if part in deltas else piece)
        start += size
    return outs


def _activation(name: str):
    if name == "silu":
        return jax.nn.silu
    if name == "gelu_tanh":
        return lambda x: jax.nn.gelu(x, approximate=True)
    return lambda x: jax.nn.gelu(x, approximate=False)


def positions_from_valid(valid: jax.Array, start: jax.Array | None = None) -> jax.Array:
    """Rotary positions of new tokens: valid tokens before each one in the row (+ ``start[B]``)."""
    pos = jnp.maximum(jnp.cumsum(valid, axis=1) - 1, 0)
    return pos if start is None else pos + start[:, None]


