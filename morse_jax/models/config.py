"""Model configuration: one decoder description covering the Llama, Qwen3, Gemma 3 and Gemma 4 families.

A :class:`ModelConfig` is a frozen, hashable dataclass so that it can be a static argument of
``jax.jit``. It is built from a transformers config (``hf_config.from_hf_config``) or from GGUF metadata
(see ``loading.py``); nothing here touches weights.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping

import numpy as np

FAMILIES = ("llama", "qwen3", "gemma3", "gemma4")
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
    Gemma 4 switches (all off for the other families; layers may then differ in shape):
      global_head_dim / num_global_kv_heads: head dim and kv heads of full-attention layers
        (None: head_dim / num_kv_heads).
      attention_k_eq_v: full-attention layers have no v projection; v is the k projection's output.
      v_norm: scale-free RMSNorm on each value head.
      per_layer_input_size / per_layer_vocab_size: per-layer embeddings (PLE); 0 = none.
      layer_scalar: a per-layer scalar multiplies each block's output.
      num_kv_shared_layers: the last n layers reuse the keys/values of the last earlier layer of
        their type (no k/v weights of their own).
      double_wide_mlp: KV-shared layers have a 2x wide MLP.
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
    global_head_dim: int | None = None
    num_global_kv_heads: int | None = None
    attention_k_eq_v: bool = False
    v_norm: bool = False
    per_layer_input_size: int = 0
    per_layer_vocab_size: int = 0
    layer_scalar: bool = False
    num_kv_shared_layers: int = 0
    double_wide_mlp: bool = False

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
        for name in ("global_head_dim", "num_global_kv_heads"):
            if getattr(self, name) is not None and int(getattr(self, name)) <= 0:
                raise ValueError(f"ModelConfig.{name} must be positive or None, got {getattr(self, name)}")
        for i in range(self.num_layers):
            if self.num_heads % self.layer_kv_heads(i):
                raise ValueError(f"ModelConfig.num_heads ({self.num_heads}) must be a multiple of layer {i}'s "
                                 f"kv heads ({self.layer_kv_heads(i)})")
        if self.per_layer_input_size < 0:
            raise ValueError(f"ModelConfig.per_layer_input_size must be >= 0, got {self.per_layer_input_size}")
        if self.per_layer_input_size and self.per_layer_vocab_size <= 0:
            raise ValueError("ModelConfig.per_layer_vocab_size must be positive when per_layer_input_size is set")
        if not 0 <= self.num_kv_shared_layers < self.num_layers:
            raise ValueError(f"ModelConfig.num_kv_shared_layers must be in [0, {self.num_layers}), "
                             f"got {self.num_kv_shared_layers}")
        _ = self.kv_sharing_modes  # validates that every shared layer type has a producer

    @property
    def scale(self) -> float:
        return self.query_scale if self.query_scale is not None else self.head_dim ** -0.5

    @property
    def sliding_flags(self) -> np.ndarray:
        """bool[num_layers]: which layers use sliding-window attention."""
        return np.array([t == "sliding_attention" for t in self.layer_types])

    # Per-layer shapes. Every family but Gemma 4 has identical layers; these then return the
    # global values.

    def _full(self, i: int) -> bool:
        return self.layer_types[i] == "full_attention"

    def layer_head_dim(self, i: int) -> int:
        return int(self.global_head_dim) if self._full(i) and self.global_head_dim else self.head_dim

    def layer_kv_heads(self, i: int) -> int:
        return int(self.num_global_kv_heads) if self._full(i) and self.num_global_kv_heads else self.num_kv_heads

    def layer_has_v(self, i: int) -> bool:
        """False where v is the k projection's output (Gemma 4 ``attention_k_eq_v``, full layers)."""
        return not (self.attention_k_eq_v and self._full(i))

    def layer_intermediate_size(self, i: int) -> int:
        wide = self.double_wide_mlp and self.kv_sharing_modes[i] == "reuse"
        return self.intermediate_size * (2 if wide else 1)

    @property
    def full_head_dim(self) -> int:
        """Head dim of full-attention layers (what the full-attention rotary tables are built for)."""
        return int(self.global_head_dim or self.head_dim)

    @property
    def kv_sharing_modes(self) -> tuple[str | None, ...]:
        """Per layer: None, "store" (its keys/values are reused later) or "reuse" (no k/v of its own).

        As transformers' Gemma 4: the last ``num_kv_shared_layers`` layers reuse the keys and
        values of the last earlier layer of the same type.
        """
        n = self.num_kv_shared_layers
        if not n:
            return (None,) * self.num_layers
        first = self.num_layers - n
        modes: list[str | None] = [None] * first + ["reuse"] * n
        for t in set(self.layer_types[first:]):
            producers = [i for i in range(first) if self.layer_types[i] == t]
            if not producers:
                raise ValueError(f"ModelConfig.num_kv_shared_layers={n}: no earlier {t} layer produces the keys and "
                                 "values the shared layers of that type reuse")
            modes[producers[-1]] = "store"
        return tuple(modes)

    def kv_producer(self, i: int) -> int:
        """The layer whose keys/values a "reuse" layer ``i`` attends to."""
        modes = self.kv_sharing_modes
        return max(j for j in range(i) if modes[j] == "store" and self.layer_types[j] == self.layer_types[i])

    def target_dims(self, target: str) -> tuple[int, int]:
        """(d_in, d_out) of a LoRA target projection, the largest over all layers.

        Layers with smaller projections (Gemma 4's sliding layers next to wider full-attention
        ones) use the leading rows/columns of such factors; see ``adapters.fit_lora``.
        """
        d = self.hidden_size
        dims = []
        for i in range(self.num_layers):
            qd = self.num_heads * self.layer_head_dim(i)
            kvd = self.layer_kv_heads(i) * self.layer_head_dim(i)
            f = self.layer_intermediate_size(i)
            dims.append({"q": (d, qd), "k": (d, kvd), "v": (d, kvd), "o": (qd, d), "gate": (d, f), "up": (d, f),
                         "down": (f, d)}[target])
        return max(a for a, _ in dims), max(b for _, b in dims)
