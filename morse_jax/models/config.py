"""Model configuration: one decoder description covering the Llama, Qwen3 and Gemma 3 families.

A :class:`ModelConfig` is a frozen, hashable dataclass so that it can be a static argument of
``jax.jit``. It is built from a transformers config (``from_hf_config``) or from GGUF metadata
(see ``loading.py``); nothing here touches weights.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from typing import Any, Mapping

import numpy as np

FAMILIES = ("llama", "qwen3", "gemma3")
# model_type strings of transformers configs -> our family.
HF_MODEL_TYPES = {
    "llama": "llama",
    "mistral": "llama",
    "qwen3": "qwen3",
    "gemma3_text": "gemma3",
    "gemma3": "gemma3",
}
LAYER_TYPES = ("full_attention", "sliding_attention")


@dataclasses.dataclass(frozen=True)
class RopeSpec:
    """Rotary embedding of one layer type (transformers' ``rope_parameters`` entry).

    ``rope_type`` is one of "default", "linear", "llama3", "proportional". ``inv_freq(head_dim)``
    gives the [head_dim // 2] inverse frequencies; a zero frequency leaves that pair unrotated,
    which is how partial rotary embeddings are expressed.
    """

    theta: float = 10_000.0
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    partial_rotary_factor: float = 1.0
    attention_scaling: float = 1.0

    def inv_freq(self, head_dim: int) -> np.ndarray:
        half = head_dim // 2
        if self.rope_type == "proportional":
            # Frequencies use the full head_dim as denominator; the tail pairs are not rotated.
            n_rot = int(self.partial_rotary_factor * head_dim // 2)
            freq = 1.0 / self.theta ** (np.arange(0, 2 * n_rot, 2, dtype=np.float64) / head_dim)
            freq = np.concatenate([freq, np.zeros(half - n_rot)])
            return (freq / self.factor).astype(np.float32)
        dim = int(head_dim * self.partial_rotary_factor)
        freq = 1.0 / self.theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
        if self.rope_type == "linear":
            freq = freq / self.factor
        elif self.rope_type == "llama3":
            low_wl = self.original_max_position_embeddings / self.low_freq_factor
            high_wl = self.original_max_position_embeddings / self.high_freq_factor
            wavelen = 2 * math.pi / freq
            scaled = np.where(wavelen > low_wl, freq / self.factor, freq)
            smooth = (self.original_max_position_embeddings / wavelen - self.low_freq_factor) / (
                self.high_freq_factor - self.low_freq_factor
            )
            smoothed = (1 - smooth) * scaled / self.factor + smooth * scaled
            medium = (wavelen >= high_wl) & (wavelen <= low_wl)
            freq = np.where(medium, smoothed, scaled)
        elif self.rope_type != "default":
            raise ValueError(f"rope_type {self.rope_type!r} is not supported (default, linear, llama3, proportional)")
        if len(freq) < half:  # partial rotary: unrotated tail
            freq = np.concatenate([freq, np.zeros(half - len(freq))])
        return freq.astype(np.float32)

    @staticmethod
    def from_hf(params: Mapping[str, Any] | None, default_theta: float = 10_000.0) -> "RopeSpec":
        params = dict(params or {})
        rope_type = params.get("rope_type", params.get("type", "default")) or "default"
        known = {"rope_type", "type", "rope_theta", "factor", "low_freq_factor", "high_freq_factor",
                 "original_max_position_embeddings", "partial_rotary_factor", "attention_factor"}
        unknown = set(params) - known
        if unknown and rope_type not in ("default", "linear", "llama3", "proportional"):
            raise ValueError(f"rope_parameters: unsupported rope_type {rope_type!r} (fields {sorted(params)})")
        return RopeSpec(
            theta=float(params.get("rope_theta", default_theta)),
            rope_type=str(rope_type),
            factor=float(params.get("factor", 1.0) or 1.0),
            low_freq_factor=float(params.get("low_freq_factor", 1.0)),
            high_freq_factor=float(params.get("high_freq_factor", 4.0)),
            original_max_position_embeddings=int(params.get("original_max_position_embeddings", 8192)),
            partial_rotary_factor=float(params.get("partial_rotary_factor", 1.0)),
            attention_scaling=float(params.get("attention_factor", 1.0) or 1.0),
        )


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Architecture of a decoder-only transformer.

    Attributes mirror transformers' names where they exist. Family-specific switches:
      qk_norm: RMSNorm on each head's q and k (Qwen3, Gemma 3).
      norm_offset: RMSNorm scale is (norm_offset + w): 0 for Llama/Qwen, 1 for Gemma.
      embed_scale: multiply input embeddings by sqrt(hidden_size) (Gemma).
      post_norms: extra RMSNorm after attention and after the MLP, before the residual (Gemma 3).
      query_scale: multiplier on q·k (head_dim**-0.5 unless the family says otherwise).
      layer_types: per-layer "full_attention" or "sliding_attention".
    """

    family: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    tie_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    activation: str = "silu"
    qk_norm: bool = False
    norm_offset: float = 0.0
    embed_scale: bool = False
    post_norms: bool = False
    query_scale: float | None = None
    layer_types: tuple[str, ...] = ()
    sliding_window: int | None = None
    rope_full: RopeSpec = RopeSpec()
    rope_sliding: RopeSpec | None = None
    attn_logit_softcap: float | None = None
    final_logit_softcap: float | None = None
    max_position_embeddings: int = 8192
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int | None = None

    def __post_init__(self):
        if self.family not in FAMILIES:
            raise ValueError(f"ModelConfig.family: unknown architecture {self.family!r}; supported: {FAMILIES}")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim"):
            if int(getattr(self, name)) <= 0:
                raise ValueError(f"ModelConfig.{name} must be positive, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"ModelConfig.num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
        if not self.layer_types:
            object.__setattr__(self, "layer_types", ("full_attention",) * self.num_layers)
        if len(self.layer_types) != self.num_layers:
            raise ValueError(f"ModelConfig.layer_types has {len(self.layer_types)} entries, expected {self.num_layers}")
        bad = set(self.layer_types) - set(LAYER_TYPES)
        if bad:
            raise ValueError(f"ModelConfig.layer_types: unknown layer types {sorted(bad)}")
        if "sliding_attention" in self.layer_types and not self.sliding_window:
            raise ValueError("ModelConfig.sliding_window must be set when a layer uses sliding attention")
        if self.activation not in ("silu", "gelu_tanh", "gelu"):
            raise ValueError(f"ModelConfig.activation {self.activation!r} not supported (silu, gelu_tanh, gelu)")

    @property
    def scale(self) -> float:
        return self.query_scale if self.query_scale is not None else self.head_dim ** -0.5

    @property
    def sliding_flags(self) -> np.ndarray:
        """bool[num_layers]: which layers use sliding-window attention."""
        return np.array([t == "sliding_attention" for t in self.layer_types])

    def num_params(self) -> int:
        """Parameter count implied by the config (matches ``init_params`` leaves)."""
        from morse_jax.models.transformer import param_shapes  # local: avoid import cycle

        return int(sum(math.prod(s) for s in _leaves(param_shapes(self))))


def _leaves(tree):
    """Shape tuples of a ``param_shapes`` tree (dicts and tuples of segments, down to int tuples)."""
    if isinstance(tree, dict):
        for v in tree.values():
            yield from _leaves(v)
    elif isinstance(tree, (tuple, list)) and not all(isinstance(i, int) for i in tree):
        for v in tree:
            yield from _leaves(v)
    else:
        yield tree


def _get(cfg, name, default=None):
    value = getattr(cfg, name, default)
    return default if value is None else value


def from_hf_config(hf_config: Any) -> ModelConfig:
    """Build a :class:`ModelConfig` from a ``transformers.PretrainedConfig``.

    Multimodal wrappers (Gemma 3 ``Gemma3Config``) are unwrapped to their text config.
    Raises ValueError naming the model_type when the architecture is not supported.
    """
    if hasattr(hf_config, "text_config") and getattr(hf_config, "model_type", "") in ("gemma3",):
        hf_config = hf_config.text_config
    model_type = getattr(hf_config, "model_type", None)
    if model_type not in HF_MODEL_TYPES:
        raise ValueError(
            f"config.json: model_type {model_type!r} is not supported; supported: {sorted(HF_MODEL_TYPES)}")
    family = HF_MODEL_TYPES[model_type]
    num_heads = int(hf_config.num_attention_heads)
    head_dim = int(_get(hf_config, "head_dim", hf_config.hidden_size // num_heads))
    rope = getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None) or {}
    layer_types = tuple(_get(hf_config, "layer_types", ()) or ())
    eos = _get(hf_config, "eos_token_id", ())
    eos = tuple(eos) if isinstance(eos, (list, tuple)) else (int(eos),)
    common = dict(
        family=family,
        vocab_size=int(hf_config.vocab_size),
        hidden_size=int(hf_config.hidden_size),
        intermediate_size=int(hf_config.intermediate_size),
        num_layers=int(hf_config.num_hidden_layers),
        num_heads=num_heads,
        num_kv_heads=int(_get(hf_config, "num_key_value_heads", num_heads)),
        head_dim=head_dim,
        rms_norm_eps=float(_get(hf_config, "rms_norm_eps", 1e-6)),
        tie_embeddings=bool(_get(hf_config, "tie_word_embeddings", False)),
        attention_bias=bool(_get(hf_config, "attention_bias", False)),
        mlp_bias=bool(_get(hf_config, "mlp_bias", False)),
        max_position_embeddings=int(_get(hf_config, "max_position_embeddings", 8192)),
        bos_token_id=_get(hf_config, "bos_token_id"),
        eos_token_ids=eos,
        pad_token_id=_get(hf_config, "pad_token_id"),
    )
    if family in ("llama", "qwen3"):
        act = _get(hf_config, "hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"config.json: hidden_act {act!r} not supported for {model_type}")
        rope_params = rope.get("full_attention", rope) if isinstance(rope, dict) else {}
        default_theta = float(_get(hf_config, "rope_theta", 10_000.0))
        sliding = family == "qwen3" and bool(_get(hf_config, "use_sliding_window", False))
        if sliding:
            raise ValueError("config.json: Qwen3 use_sliding_window=True is not supported")
        return ModelConfig(
            **common,
            qk_norm=family == "qwen3",
            rope_full=RopeSpec.from_hf(rope_params, default_theta),
        )
    # gemma3
    act = _get(hf_config, "hidden_activation", _get(hf_config, "hidden_act", "gelu_pytorch_tanh"))
    if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise ValueError(f"config.json: hidden_activation {act!r} not supported for gemma3")
    if getattr(hf_config, "use_bidirectional_attention", False):
        raise ValueError("config.json: Gemma 3 use_bidirectional_attention is not supported")
    if _get(hf_config, "attn_logit_softcapping") is not None:
        warnings.warn("config.json: Gemma 3 attn_logit_softcapping is ignored, as in transformers' Gemma 3")
    return ModelConfig(
        **common,
        activation="gelu_tanh",
        qk_norm=True,
        norm_offset=1.0,
        embed_scale=True,
        post_norms=True,
        query_scale=float(hf_config.query_pre_attn_scalar) ** -0.5,
        layer_types=layer_types,
        sliding_window=int(_get(hf_config, "sliding_window", 4096)),
        rope_full=RopeSpec.from_hf(rope.get("full_attention"), 1_000_000.0),
        rope_sliding=RopeSpec.from_hf(rope.get("sliding_attention"), 10_000.0),
        # transformers' Gemma 3 stores attn_logit_softcapping but never applies it (released
        # checkpoints set it to null); follow the reference implementation, and say so.
        attn_logit_softcap=None,
        final_logit_softcap=_get(hf_config, "final_logit_softcapping"),
    )
