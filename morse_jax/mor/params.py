"""MoR's trainable parameters: one pytree, stacked over the adapted layers and the LoRAs.

Tree (every leaf float, leading axis L = adapted layers, the last ``cfg.adapted_layers(...)``)::

    {"a":      {target: [L, N, d_in, r]},     N = Σ_r (1 + E_r): per role its shared LoRA, then
     "b":      {target: [L, N, r, d_out]},        its E_r routed LoRAs (MoRConfig.lora_offset)
     "router": {target: [L, d_in, ΣE_r]},     bias-free token routers, role r's columns at
                                                  MoRConfig.router_offset(r) (routing="router")
     "gate":   {target: [L, d_in, roles]}}    shared-LoRA sigmoid gates (shared_gate="sigmoid")

Plain LoRA (``kind="lora"``): N = 1, no router, no gate.

Initialisation (the released layer, reference §2.3): A ~ U(±1/√(r·d_in)) (torch's fan-in of the
stacked 3-D tensor, 4x narrower than PEFT's), B = 0 (an untrained adapter is a no-op), routers and
gates U(±1/√d_in). Plain LoRA uses PEFT's A ~ U(±1/√d_in).

d_in / d_out are ``ModelConfig.target_dims`` (the widest layer; narrower Gemma 4 layers use the
leading rows / columns, as MoLE's banks do).
"""

from __future__ import annotations

import dataclasses
import math
import types

import jax
import jax.numpy as jnp

from morse_jax.models.config import ModelConfig
from morse_jax.models.hf_config import from_hf_config
from morse_jax.mor.config import MoRConfig


def init_mor_params(key: jax.Array, model_cfg: ModelConfig, cfg: MoRConfig, dtype=jnp.float32) -> dict:
    """Fresh trainable params (module docstring); B = 0, so the adapted model equals the backbone."""
    L, N, r = cfg.adapted_layers(model_cfg.num_layers), cfg.num_loras, cfg.rank
    params: dict = {"a": {}, "b": {}}
    if cfg.has_router:
        params["router"] = {}
    if cfg.has_gate:
        params["gate"] = {}
    for t, k in zip(cfg.targets, jax.random.split(key, len(cfg.targets))):
        d_in, d_out = model_cfg.target_dims(t)
        ka, kr, kg = jax.random.split(k, 3)
        bound = 1.0 / math.sqrt(d_in if cfg.kind == "lora" else r * d_in)
        params["a"][t] = jax.random.uniform(ka, (L, N, d_in, r), dtype, -bound, bound)
        params["b"][t] = jnp.zeros((L, N, r, d_out), dtype)
        b_in = 1.0 / math.sqrt(d_in)
        if cfg.has_router:
            params["router"][t] = jax.random.uniform(kr, (L, d_in, sum(cfg.routed)), dtype, -b_in, b_in)
        if cfg.has_gate:
            params["gate"][t] = jax.random.uniform(kg, (L, d_in, cfg.num_roles), dtype, -b_in, b_in)
    return params


def param_count(model_cfg: ModelConfig, cfg: MoRConfig) -> int:
    """Trainable parameters, from ``jax.eval_shape`` of the init (no memory allocated)."""
    shapes = jax.eval_shape(lambda k: init_mor_params(k, model_cfg, cfg), jax.random.PRNGKey(0))
    return sum(math.prod(x.shape) for x in jax.tree.leaves(shapes))


def plain_lora_config(model_cfg: ModelConfig, cfg: MoRConfig) -> MoRConfig:
    """The plain-LoRA ablation with (the nearest rank to) ``cfg``'s trainable-parameter budget:
    same targets and layers, one LoRA on every token, rank = round(MoR's count / a rank-1 LoRA's)."""
    one = param_count(model_cfg, dataclasses.replace(cfg, kind="lora", rank=1))
    return dataclasses.replace(cfg, kind="lora", rank=max(1, round(param_count(model_cfg, cfg) / one)))


def routed_factors(params: dict, cfg: MoRConfig, role: int) -> dict[str, tuple[jax.Array, jax.Array]]:
    """Role ``role``'s routed LoRAs per target: {t: (a [L, E_r, d_in, r], b [L, E_r, r, d_out])}
    (what the orthogonality loss compares)."""
    start = cfg.lora_offset(role) + 1
    stop = start + cfg.routed[role]
    return {t: (params["a"][t][:, start:stop], params["b"][t][:, start:stop]) for t in params["a"]}


# --------------------------------------------------------------------------- presets

# Llama-3.2-1B-Instruct's config.json (the fields the decoder reads), so the paper's setting can be
# sized without the checkpoint.
LLAMA_3_2_1B_INSTRUCT = {
    "model_type": "llama", "vocab_size": 128256, "hidden_size": 2048, "intermediate_size": 8192,
    "num_hidden_layers": 16, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 64,
    "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "tie_word_embeddings": True, "hidden_act": "silu",
    "attention_bias": False, "mlp_bias": False, "max_position_embeddings": 131072,
    "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009],
}

PAPER = MoRConfig()  # the paper's setting: 1+4 / 1+4 / 1+3 LoRAs, top 3 / 3 / 2, rank 16, 7 targets, all layers


def llama_3_2_1b_instruct() -> ModelConfig:
    """The ModelConfig of Llama-3.2-1B-Instruct (no weights)."""
    return from_hf_config(types.SimpleNamespace(**LLAMA_3_2_1B_INSTRUCT))
