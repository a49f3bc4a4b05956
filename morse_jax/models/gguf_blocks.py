"""A GGUF file's block-quantised weights, kept in block form for the decode step.

The loader (``loading._load_gguf``) dequantises every tensor to the params' float dtype: training
and prefill use those arrays. A decode step of one to four rows is bound by the bytes of weight it
streams instead, and reads fewer of them in the file's own Q4_1 / Q8_0 blocks
(``kernels.block_matmul``: 0.75 / 1.125 bytes a weight against 4, the same weight values). This
module reads those blocks, arranged as the params are: rows in our order (llama.cpp's rotary row
permutation of q and k undone, as the loader does), one entry per projection and layer.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from morse_jax.kernels.block_matmul import concat_rows, from_gguf_blocks, take_rows
from morse_jax.kernels.block_matmul import shape as block_shape
from morse_jax.models.config import ModelConfig
from morse_jax.models.decode import FUSED

# our projection name -> the GGUF tensor of layer i (llama layout, as loading._GGUF_LAYER_NAMES)
PROJECTIONS = {"q": "blk.{i}.attn_q.weight", "k": "blk.{i}.attn_k.weight", "v": "blk.{i}.attn_v.weight",
               "o": "blk.{i}.attn_output.weight", "gate": "blk.{i}.ffn_gate.weight",
               "up": "blk.{i}.ffn_up.weight", "down": "blk.{i}.ffn_down.weight"}
BLOCK_TYPES = ("Q4_1", "Q8_0")


def _qk_row_order(rows: int, n_head: int) -> np.ndarray:
    """The row index that undoes llama.cpp's rotary permutation (``loading._unpermute_qk`` on [out, ...])."""
    return np.arange(rows).reshape(n_head, rows // n_head // 2, 2).swapaxes(1, 2).reshape(rows)


def load_blocks(path: str | Path, cfg: ModelConfig) -> dict[str, Any] | None:
    """{"embed": block matrix or None, "head": block matrix or None (untied output.weight),
    "layers": tuple over layers of {projection: block matrix}} for the tensors of ``path`` stored
    as Q4_1 / Q8_0 (numpy arrays, rows = output features in our order); None when none is.

    A projection stored in another type (float, K-quants) is left out: the decode step reads its
    float32 weights.
    """
    import gguf

    reader = gguf.GGUFReader(str(path))
    tensors = {t.name: t for t in reader.tensors}

    def blocks(name: str):
        t = tensors.get(name)
        if t is None or t.tensor_type.name not in BLOCK_TYPES:
            return None
        return from_gguf_blocks(np.asarray(t.data), t.tensor_type.name)

    layers = []
    for i in range(cfg.num_layers):
        layer = {}
        for ours, template in PROJECTIONS.items():
            w = blocks(template.format(i=i))
            if w is None:
                continue
            if ours in ("q", "k"):
                heads = cfg.num_heads if ours == "q" else cfg.num_kv_heads
                w = take_rows(w, _qk_row_order(w.scale.shape[0], heads))
            layer[ours] = w
        layers.append(layer)
    out = {"embed": blocks("token_embd.weight"),
           "head": None if cfg.tie_embeddings else blocks("output.weight"), "layers": tuple(layers)}
    if out["embed"] is None and out["head"] is None and not any(layers):
        return None
    return out


def with_blocks(dp: dict, blocks: dict, cfg: ModelConfig) -> dict:
    """:func:`models.decode.decode_params` with a GGUF's block-quantised weights attached (``Backbone.blocks``,
    ``models.gguf_blocks``): each fused projection whose parts are all in blocks of one kind gets
    ``{"blocks": matrix}`` (its parts' rows stacked in the fused order) next to its "w", and the
    LM head ``"head_blocks"``. A native decode step of at most ``block_matmul.MAX_COLUMNS`` rows
    reads them (``decode.FusedColumns``); everything else keeps reading "w"."""
    layers = []
    for lp, lb in zip(dp["layers"], blocks["layers"]):
        new = dict(lp)
        for name, parts in (*FUSED.items(), ("o", ("o",)), ("down", ("down",))):
            mats = [lb[p] for p in parts if p in lb]
            if name not in lp or not mats or len({type(m) for m in mats}) != 1:
                continue
            fused = concat_rows(mats) if len(mats) > 1 else mats[0]
            if block_shape(fused) == tuple(lp[name]["w"].shape):  # every part of "w" is in blocks
                new[name] = {**lp[name], "blocks": fused}
        layers.append(new)
    out = {**dp, "layers": tuple(layers)}
    head = blocks["embed"] if cfg.tie_embeddings else blocks["head"]
    if head is not None and block_shape(head) == tuple(dp["head"].shape):
        out["head_blocks"] = head
    return out
