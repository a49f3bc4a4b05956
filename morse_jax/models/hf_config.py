"""A :class:`~morse_jax.models.config.ModelConfig` from a transformers config (``config.json``).

Reads the family from ``model_type`` and maps transformers' field names onto ours; a field this
project does not support is an error or a warning that names it, never silently dropped.
"""

from __future__ import annotations

import warnings
from typing import Any


from morse_jax.models.config import ModelConfig, RopeSpec

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
