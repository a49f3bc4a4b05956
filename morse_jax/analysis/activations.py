"""Backbone activations for the App. L.1 diagnostic: what the LoRA modules see, at the last token.

App. L.1 runs one no-grad forward per prompt and captures "the input activation to each target
layer at the last token position -- exactly what the LoRA module sees". For the q and v
projections of block l that is the block's attention-normed hidden state
``rms_norm(x_l, attn_norm_l)``, where x_l is the residual stream entering block l.

``models.forward`` has no hook for intermediate layers, so the capture uses only its public
contract: running the first l blocks and applying block l's ``attn_norm`` weights as the final
norm (same eps and offset as in the block) returns exactly that normed input at every position.
That costs one truncated forward per captured layer; the tests check it against transformers'
``hidden_states`` followed by ``input_layernorm``.

Prompts for the role and subtask diagnostics: App. L.1 renders each execute-node subtask
description with a role marker (ROLE=execute / ROLE=merge) and a short role-specific instruction
tail, so that only the role differs between the two prompts of a description. The paper does not
print its tails; ours are :data:`ROLE_TAILS`.
"""

from __future__ import annotations

import functools
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from morse_jax.models.config import ModelConfig
from morse_jax.models.transformer import forward, split_segments

ROLE_TAILS = {
    "execute": "Complete this subtask: write the code it asks for.",
    "merge": "Merge the upstream artifacts of this subtask into one consistent result.",
}


def role_prompt(description: str, role: str) -> str:
    """The diagnostic prompt of App. L.1: role marker, the subtask description, a role tail."""
    if role not in ROLE_TAILS:
        raise ValueError(f"role must be one of {sorted(ROLE_TAILS)}, got {role!r}")
    if not isinstance(description, str) or not description.strip():
        raise ValueError("description must be a non-empty string")
    return f"ROLE={role}\nSubtask: {description.strip()}\n{ROLE_TAILS[role]}"


def adapted_layers(cfg: ModelConfig, n_adapt: int) -> list[int]:
    """Absolute indices of the last ``n_adapt`` blocks (where MoLE attaches its experts)."""
    if not 0 < n_adapt <= cfg.num_layers:
        raise ValueError(f"n_adapt must be in [1, {cfg.num_layers}], got {n_adapt}")
    return list(range(cfg.num_layers - n_adapt, cfg.num_layers))


def _stacked_layers(params: dict) -> dict:
    """All blocks as one dict of arrays stacked on a leading [num_layers] axis."""
    segs = split_segments(params, 0)["layers"]
    if len(segs) != 1:
        # Layers of different shapes (Gemma 4) cannot be stacked and truncated this way.
        raise NotImplementedError("activation capture needs a model whose layers share one shape "
                                  f"(one stacked segment); this one has {len(segs)}")
    seg = segs[0]
    if isinstance(seg, (tuple, list)):  # an unrolled segment: stack its per-layer dicts
        seg = jax.tree.map(lambda *xs: jnp.stack(xs), *seg)
    return seg


@functools.partial(jax.jit, static_argnames=("cfg", "layer"))
def _normed_input_last(params: dict, stacked: dict, tokens, valid, *, cfg: ModelConfig, layer: int):
    """float32[B, d]: rms_norm(x_layer, attn_norm_layer) at each row's last position."""
    trunc = {**params, "layers": (jax.tree.map(lambda a: a[:layer], stacked),),
             "final_norm": stacked["attn_norm"][layer]}
    hidden, _ = forward(trunc, cfg, tokens, valid=valid, logits_mode="hidden")
    return hidden[:, -1].astype(jnp.float32)


def lora_input_activations(params: dict, cfg: ModelConfig, token_lists: Sequence[Sequence[int]],
                           layers: Sequence[int], *, batch_size: int = 16, bucket: int = 32) -> np.ndarray:
    """Capture the q/v LoRA input at the last token of each prompt, at each given block.

    Args:
      params: frozen backbone params (``models.loading.load_backbone(...).params``).
      cfg: its ModelConfig.
      token_lists: N prompts as token id lists (chat-templated or raw, as the caller wants).
      layers: absolute block indices in [0, num_layers).
      batch_size: prompts per forward (the last batch is padded with copies, so shapes repeat).
      bucket: prompts are left-padded to a multiple of this length (bounded compiles).
    Returns:
      float32[N, len(layers), hidden_size].
    """
    if not token_lists:
        raise ValueError("token_lists: need at least one prompt")
    for i, t in enumerate(token_lists):
        if len(t) == 0:
            raise ValueError(f"token_lists[{i}] is empty")
    bad = [l for l in layers if not 0 <= int(l) < cfg.num_layers]
    if bad or not layers:
        raise ValueError(f"layers must be non-empty indices in [0, {cfg.num_layers}), got {list(layers)}")
    if batch_size < 1 or bucket < 1:
        raise ValueError(f"batch_size and bucket must be positive, got {batch_size}, {bucket}")
    if getattr(cfg, "per_layer_input_size", 0):
        # Per-layer inputs are sliced by layer index from a table built for all layers.
        raise NotImplementedError("activation capture does not support per-layer-input models (Gemma 4)")
    stacked = _stacked_layers(params)
    rest = {k: v for k, v in params.items() if k != "layers"}
    out = np.zeros((len(token_lists), len(layers), cfg.hidden_size), np.float32)
    for start in range(0, len(token_lists), batch_size):
        chunk = [list(map(int, t)) for t in token_lists[start:start + batch_size]]
        n_real = len(chunk)
        chunk += [chunk[-1]] * (batch_size - n_real)
        longest = max(len(t) for t in chunk)
        t_len = -(-longest // bucket) * bucket
        tokens = np.zeros((batch_size, t_len), np.int32)
        valid = np.zeros((batch_size, t_len), bool)
        for r, t in enumerate(chunk):  # left padding: every row's last position is a real token
            tokens[r, t_len - len(t):] = t
            valid[r, t_len - len(t):] = True
        for j, layer in enumerate(layers):
            h = _normed_input_last(rest, stacked, jnp.asarray(tokens), jnp.asarray(valid), cfg=cfg, layer=int(layer))
            out[start:start + n_real, j] = np.asarray(h)[:n_real]
    return out


def activation_fn_for(params: dict, cfg: ModelConfig, encode: Any, layers: Sequence[int], **kw):
    """texts -> float32[N, len(layers), d], encoding each text as one user message with ``encode``.

    ``encode(messages) -> list[int]`` is e.g. ``Job.encode`` (the backbone's chat template).
    """
    def fn(texts: Sequence[str]) -> np.ndarray:
        ids = [encode([{"role": "user", "content": t}]) for t in texts]
        return lora_input_activations(params, cfg, ids, layers, **kw)

    return fn
