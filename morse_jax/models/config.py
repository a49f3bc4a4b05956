"""Model configuration: one decoder description covering the Llama, Qwen3, Gemma 3 and Gemma 4 families.

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

FAMILIES = ("llama", "qwen3", "gemma3", "gemma4")
# model_type strings of transformers configs -> our family.
HF_MODEL_TYPES = {
    "llama": "llama",
    "mistral": "llama",
    "qwen3": "qwen3",
    "gemma3_text": "gemma3",
    "gemma3": "gemma3",
    "gemma4_text": "gemma4",
    "gemma4": "gemma4",
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


def _get(cfg, name, default=None):
    value = getattr(cfg, name, default)
    return default if value is None else value


def from_hf_config(hf_config: Any) -> ModelConfig:
    """Build a :class:`ModelConfig` from a ``transformers.PretrainedConfig``.

    Multimodal wrappers (Gemma 3 ``Gemma3Config``, Gemma 4 ``Gemma4Config``) are unwrapped to
    their text config. Raises ValueError naming the model_type when the architecture is not
    supported, NotImplementedError naming the option when a supported family uses a variant we do
    not implement (e.g. Gemma 4 mixture-of-experts).
    """
    if hasattr(hf_config, "text_config") and getattr(hf_config, "model_type", "") in ("gemma3", "gemma4"):
        hf_config = hf_config.text_config
    model_type = getattr(hf_config, "model_type", None)
    if model_type not in HF_MODEL_TYPES:
        raise ValueError(
            f"config.json: model_type {model_type!r} is not supported; supported: {sorted(HF_MODEL_TYPES)}")
    family = HF_MODEL_TYPES[model_type]
    if family == "gemma4":
        return _from_gemma4_config(hf_config)
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


# Per-layer attributes transformers' Gemma 4 config may vary (its ``per_layer_config``) that we map.
_GEMMA4_PER_LAYER = {"head_dim", "num_key_value_heads"}


def _from_gemma4_config(hf) -> ModelConfig:
    """Gemma 4 text backbone (``Gemma4TextConfig``), as transformers' ``Gemma4TextModel`` computes it.

    Covered: sliding / full-attention layers with their own head dim, kv heads and rotary
    embedding (proportional partial rotary on full layers), k = v full-attention layers, q/k/v
    norms, per-layer embeddings, layer scalars, KV-shared layers, double-wide MLPs, final logit
    softcap. Not covered (NotImplementedError): mixture-of-experts blocks, bidirectional attention
    over all tokens, per-layer overrides other than head_dim / num_key_value_heads.
    """
    def unsupported(option: str, why: str):
        raise NotImplementedError(f"config.json: Gemma 4 {option} is not supported ({why})")

    if getattr(hf, "enable_moe_block", False):
        unsupported(f"enable_moe_block=True (num_experts={getattr(hf, 'num_experts', None)})",
                    "mixture-of-experts feed-forward blocks, e.g. gemma-4-26B-A4B")
    if getattr(hf, "use_bidirectional_attention", None) == "all":
        unsupported("use_bidirectional_attention='all'", "non-causal attention over text tokens")
    act = getattr(hf, "hidden_activation", None) or "gelu_pytorch_tanh"
    if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
        unsupported(f"hidden_activation={act!r}", "only gelu_pytorch_tanh")
    per_layer_attrs = set(getattr(hf, "per_layer_attributes", None) or ())
    if per_layer_attrs - _GEMMA4_PER_LAYER:
        unsupported(f"per_layer_config overriding {sorted(per_layer_attrs - _GEMMA4_PER_LAYER)}",
                    f"only {sorted(_GEMMA4_PER_LAYER)} may vary by layer")

    L = int(hf.num_hidden_layers)
    layer_types = tuple(hf.layer_types)
    # head_dim / kv heads may be per-layer attributes that the global config refuses to read.
    layers = [hf.per_layer_config[i] for i in range(L)]
    dims = {}
    for t in set(layer_types):
        got = {(int(layers[i].head_dim), int(layers[i].num_key_value_heads)) for i in range(L) if layer_types[i] == t}
        if len(got) > 1:
            unsupported(f"per-layer head_dim / num_key_value_heads varying among {t} layers ({sorted(got)})",
                        "they must be uniform per layer type")
        dims[t] = got.pop()
    slide = dims.get("sliding_attention", dims["full_attention"])
    full = dims.get("full_attention", slide)
    rope = dict(getattr(hf, "rope_parameters", None) or {})
    rope_specs = {}
    for t in ("full_attention", "sliding_attention"):
        params = dict(rope.get(t) or {})
        if params.get("rope_type", "default") == "default" and params.get("partial_rotary_factor", 1.0) != 1.0:
            # transformers' Gemma 4 builds default rotary tables over the whole head dim.
            warnings.warn(f"config.json: Gemma 4 {t} rope partial_rotary_factor is ignored for rope_type "
                          "'default', as in transformers' Gemma 4")
            params.pop("partial_rotary_factor")
        rope_specs[t] = RopeSpec.from_hf(params, 1_000_000.0 if t == "full_attention" else 10_000.0)
    eos = _get(hf, "eos_token_id", ())
    eos = tuple(eos) if isinstance(eos, (list, tuple)) else (int(eos),)
    ple = int(_get(hf, "hidden_size_per_layer_input", 0) or 0)
    return ModelConfig(
        family="gemma4",
        vocab_size=int(hf.vocab_size),
        hidden_size=int(hf.hidden_size),
        intermediate_size=int(hf.intermediate_size),
        num_layers=L,
        num_heads=int(hf.num_attention_heads),
        num_kv_heads=slide[1],
        head_dim=slide[0],
        global_head_dim=full[0],
        num_global_kv_heads=full[1],
        rms_norm_eps=float(_get(hf, "rms_norm_eps", 1e-6)),
        tie_embeddings=bool(_get(hf, "tie_word_embeddings", True)),
        attention_bias=bool(_get(hf, "attention_bias", False)),
        activation="gelu_tanh",
        qk_norm=True,
        norm_offset=0.0,  # Gemma 4 norms scale by w, not (1 + w)
        embed_scale=True,
        post_norms=True,
        query_scale=1.0,  # q and k are RMS-normalised; transformers' Gemma 4 uses scaling 1
        layer_types=layer_types,
        sliding_window=int(_get(hf, "sliding_window", 512)),
        rope_full=rope_specs["full_attention"],
        rope_sliding=rope_specs["sliding_attention"],
        final_logit_softcap=_get(hf, "final_logit_softcapping"),
        max_position_embeddings=int(_get(hf, "max_position_embeddings", 131072)),
        bos_token_id=_get(hf, "bos_token_id"),
        eos_token_ids=eos,
        pad_token_id=_get(hf, "pad_token_id"),
        attention_k_eq_v=bool(_get(hf, "attention_k_eq_v", False)),
        v_norm=True,
        per_layer_input_size=ple,
        per_layer_vocab_size=int(_get(hf, "vocab_size_per_layer_input", hf.vocab_size)) if ple else 0,
        layer_scalar=True,
        num_kv_shared_layers=int(_get(hf, "num_kv_shared_layers", 0) or 0),
        double_wide_mlp=bool(_get(hf, "use_double_wide_mlp", False)),
    )
