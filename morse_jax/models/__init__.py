"""Frozen backbones: config, decoder, weight loading (HF safetensors, GGUF), tokenizer."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from morse_jax.models.config import ModelConfig, RopeSpec
from morse_jax.models.hf_config import from_hf_config
from morse_jax.models.loading import (
    Backbone,
    WeightLoadError,
    embedded_model_path,
    load_backbone,
    load_tokenizer,
)
from morse_jax.models.adapters import LoraInputs
from morse_jax.models.params import init_params, num_params, param_shapes
from morse_jax.models.segments import split_segments, unstack_segments
from morse_jax.models.transformer import forward, init_cache


@functools.partial(jax.jit, static_argnames=("cfg",))
def _logits(params, cfg, tokens, valid):
    return forward(params, cfg, tokens, valid=valid)[0]


def logits(backbone: Backbone, tokens, valid=None) -> jax.Array:
    """float32 [batch, seq, vocab] logits of the no-adapter path.

    ``valid`` (bool [batch, seq]) marks real tokens; padding (left or right) is never attended to
    and positions count valid tokens only.
    """
    tokens = jnp.asarray(tokens, jnp.int32)
    if tokens.ndim == 1:
        tokens = tokens[None]
    if valid is None:
        valid = jnp.ones(tokens.shape, bool)
    return _logits(backbone.params, backbone.config, tokens, jnp.asarray(valid, bool))


__all__ = [
    "Backbone", "LoraInputs", "ModelConfig", "RopeSpec", "WeightLoadError", "embedded_model_path",
    "forward", "from_hf_config", "init_cache", "init_params", "load_backbone", "load_tokenizer",
    "logits", "num_params", "param_shapes", "split_segments", "unstack_segments",
]
