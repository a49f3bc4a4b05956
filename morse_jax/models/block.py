"""THE decoder block: one implementation for the training forward, the prefill and the decode step.

:func:`decoder_layer` is the maths of one layer (norms, q/k/v, rotary, attention, MLP, Gemma's
post-norms, Gemma 4's per-layer input and layer scalar), written once. What differs between its
three callers is only *layout*, supplied as arguments:

* a :class:`~morse_jax.models.adapters.Layout` — how weights are stored and activations held:
  ``transformer.ModelLayout`` (the backbone's ``[d_in, d_out]`` kernels per target, activations
  [B, T, d]), ``decode.FusedRows`` (the prefill: fused ``[d_out, d_in]`` q/k/v and gate/up) and
  ``decode.FusedColumns`` (the decode step: fused weights, activations transposed [d, B] so every
  projection is ``W @ x``, optionally on the native CPU kernels);
* an ``attention(q, k, v)`` callable — the cache layout: where new keys/values are written, which
  cache a KV-shared layer reads, the mask, and the attention kernel;
* the layer's adapter value (``morse_jax.models.adapters``; every projection goes through
  :func:`~morse_jax.models.adapters.project`, and the adapter's optional auxiliary outputs, e.g.
  router logits, are collected per projection by :func:`~morse_jax.models.adapters.project_aux`
  and returned, opaque to the block).

Shapes: B batch, T new tokens, d hidden, H heads, K kv heads, D head dim, f MLP width, p per-layer
input width. "Layout" activations are [B, T, d] for row layouts and [d, B] (T = 1) for columns.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax

from morse_jax.models.adapters import project, project_aux
from morse_jax.models.config import ModelConfig
from morse_jax.models.layers import Rope, activation, apply_rope, rms_norm, rms_norm_unscaled

# attention(q [B, T, H, D], k, v [B, T, K, D] or None for a KV-shared layer) -> (out [B, T, H*D], record)
Attention = Callable[[jax.Array, Any, Any], tuple[jax.Array, Any]]


class LayerDims(NamedTuple):
    """Static widths of one layer (Gemma 4's layers differ)."""

    heads: int
    kv_heads: int
    head_dim: int
    has_kv: bool  # False: a KV-shared layer (attends to another layer's keys/values)
    has_v: bool  # False: values are the keys (Gemma 4 full-attention layers)
    mlp: int

    @staticmethod
    def of_layer(cfg: ModelConfig, i: int) -> "LayerDims":
        reuse = cfg.kv_sharing_modes[i] == "reuse"
        return LayerDims(cfg.num_heads, cfg.layer_kv_heads(i), cfg.layer_head_dim(i), not reuse,
                         not reuse and cfg.layer_has_v(i), cfg.layer_intermediate_size(i))

    def qkv_sizes(self) -> dict[str, int]:
        """{part: d_out} of the fused q/k/v projection, the parts this layer has, in order."""
        sizes = {"q": self.heads * self.head_dim}
        if self.has_kv:
            sizes["k"] = self.kv_heads * self.head_dim
            if self.has_v:
                sizes["v"] = self.kv_heads * self.head_dim
        return sizes


class RowsLayout:
    """Activations [B, T, features]; subclasses say how weights are stored (``linear``)."""

    columns = False

    @staticmethod
    def norm(x, w, eps, offset):
        return rms_norm(x, w, eps, offset)

    @staticmethod
    def heads(y, n, D):
        """[B, T, n*D] -> [B, T, n, D]."""
        return y.reshape(*y.shape[:2], n, D)

    @staticmethod
    def merge_heads(out):
        return out

    @staticmethod
    def rows(x):
        return x


class ColumnsLayout:
    """Activations transposed, [features, B] (one token per row); subclasses say ``linear``."""

    columns = True

    @staticmethod
    def norm(x, w, eps, offset):
        return rms_norm(x, w, eps, offset, axis=0)

    @staticmethod
    def heads(y, n, D):
        """[n*D, B] -> [B, 1, n, D]."""
        return y.T.reshape(y.shape[1], 1, n, D)

    @staticmethod
    def merge_heads(out):
        """[B, 1, H*D] -> [H*D, B]."""
        return out.reshape(out.shape[0], -1).T

    @staticmethod
    def rows(x):
        return x.T


def decoder_layer(cfg: ModelConfig, layout, lp: dict, x: jax.Array, dims: LayerDims, rope: Rope,
                  attention: Attention, adapter: Any = None, ple: jax.Array | None = None):
    """One decoder layer on the residual stream ``x`` (layout activations).

    Args:
      lp: the layer's params in the layout's form. dims: its widths. rope: (cos, sin) [B, T, D]
        for this layer's attention type. attention: see the module docstring; it receives q and
        the new k, v after the q/k norms, the value norm and rotary (keys only).
      adapter: the layer's adapter value or None. ple: Gemma 4's per-layer input for this layer
        (layout activations of width p) or None.
    Returns:
      (x, whatever ``attention`` recorded, e.g. the updated cache, the adapter's auxiliary
      outputs {name: array} from ``project_aux``: {} without an adapter or one with no ``aux``).
    """
    eps, off = cfg.rms_norm_eps, cfg.norm_offset
    H, K, D = dims.heads, dims.kv_heads, dims.head_dim
    cos, sin = rope

    h = layout.norm(x, lp["attn_norm"], eps, off)
    qkv = project(layout, h, lp, "qkv", dims.qkv_sizes(), adapter)
    aux = project_aux(adapter, h, "qkv", layout.columns)
    q = layout.heads(qkv[0], H, D)
    if cfg.qk_norm:
        q = rms_norm(q, lp["q_norm"], eps, off)
    q = apply_rope(q, cos, sin)
    k = v = None
    if dims.has_kv:
        k = layout.heads(qkv[1], K, D)
        v = layout.heads(qkv[2], K, D) if dims.has_v else k  # Gemma 4 k = v layers: raw keys as values
        if cfg.qk_norm:
            k = rms_norm(k, lp["k_norm"], eps, off)
        if cfg.v_norm:
            v = rms_norm_unscaled(v, eps)
        k = apply_rope(k, cos, sin)
    out, record = attention(q, k, v)
    out = layout.merge_heads(out)
    aux |= project_aux(adapter, out, "o", layout.columns)
    out = project(layout, out, lp, "o", None, adapter)[0]
    if cfg.post_norms:
        out = layout.norm(out, lp["post_attn_norm"], eps, off)
    x = x + out

    h = layout.norm(x, lp["mlp_norm"], eps, off)
    act = activation(cfg.activation)
    gate, up = project(layout, h, lp, "gu", {"gate": dims.mlp, "up": dims.mlp}, adapter)
    aux |= project_aux(adapter, h, "gu", layout.columns)
    h = act(gate) * up
    out = project(layout, h, lp, "down", None, adapter)[0]
    aux |= project_aux(adapter, h, "down", layout.columns)
    if cfg.post_norms:
        out = layout.norm(out, lp["post_mlp_norm"], eps, off)
    x = x + out
    if ple is not None:  # Gemma 4 per-layer input: a gated residual branch after the MLP
        g = act(project(layout, x, lp, "ple_gate", None, None)[0]) * ple
        x = x + layout.norm(project(layout, g, lp, "ple_out", None, None)[0], lp["ple_post_norm"], eps, off)
    if "layer_scalar" in lp:
        x = x * lp["layer_scalar"].astype(x.dtype)
    return x, record, aux


REMAT = ("none", "layer")  # what a backward pass keeps of an adapted layer (train.remat)


def remat_layer(fn: Callable, remat: str) -> Callable:
    """``fn`` (one adapted layer) as differentiated: "none" as is (the backward pass keeps all its
    residuals, the [B, H, T, S] attention scores and probabilities included); "layer" under
    ``jax.checkpoint`` saving only matmul outputs without batch dims (the projections', O(T)), so
    the backward pass re-runs attention (batched matmuls, O(T^2)) and the elementwise ops, one
    layer at a time. Saving nothing would re-run the projections too, most of a layer's FLOPs,
    to save O(T) memory (README "Layer rematerialisation"). ``prevent_cse=False``: under
    ``lax.scan`` the loop already keeps XLA from merging the recompute into the forward (jax docs)."""
    if remat == "none":
        return fn
    if remat != "layer":
        raise ValueError(f"remat must be one of {REMAT}, got {remat!r}")
    return jax.checkpoint(fn, prevent_cse=False, policy=jax.checkpoint_policies.dots_with_no_batch_dims_saveable)
