"""Logit parity with transformers for tiny random Llama / Qwen3 / Gemma 3 checkpoints.

Each case saves a random transformers model as safetensors (no tokenizer files), loads it with
``morse_jax.models.load_backbone`` and compares logits on a left-padded batch (transformers gets
the attention mask and the same position ids we derive: cumsum(mask) - 1, clipped at 0).
"""

from __future__ import annotations

import json
import math
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from conftest import torch_logits
from transformers import AutoModelForCausalLM

from morse_jax.models import forward, load_backbone, num_params
from morse_jax.models.config import RopeSpec

_forward = jax.jit(forward, static_argnames=("cfg", "logits_mode"))

# (batch 3, length 12): row 0 full, rows 1-2 left padded to 8 and 3 valid tokens.
LENGTHS = (12, 8, 3)
T = 12


def padded_batch(vocab: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, vocab, (len(LENGTHS), T))
    valid = np.arange(T)[None, :] >= (T - np.asarray(LENGTHS))[:, None]
    tokens = np.where(valid, tokens, 0)
    return tokens, valid


def assert_parity(ours, ref, valid, rtol=1e-4):
    ours, ref = np.asarray(ours)[valid], np.asarray(ref)[valid]
    err = np.abs(ours - ref).max()
    bound = rtol * np.abs(ref).max()
    assert err <= bound, f"max |ours - transformers| = {err:.3g} > {bound:.3g} ({err / np.abs(ref).max():.3g} rel)"
    # A meaningful comparison: the reference is far from constant across the vocabulary.
    assert np.abs(ref).max() > 1e-2


def check_parity(path, model, *, seed=0, vocab=None):
    with pytest.warns(UserWarning, match="no tokenizer files"):
        bb = load_backbone(path)
    assert bb.tokenizer is None
    tokens, valid = padded_batch(vocab or bb.config.vocab_size, seed)
    ours, _ = _forward(bb.params, bb.config, jnp.asarray(tokens, jnp.int32), valid=jnp.asarray(valid))
    assert_parity(ours, torch_logits(model, tokens, valid), valid)
    return bb


LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               # small enough that positions < 12 see every branch (kept, smoothed, scaled bands)
               "original_max_position_embeddings": 64, "rope_theta": 500.0}

CASES = {
    # GQA ratio 1, untied head, head_dim = hidden / heads.
    "llama-mha-untied": ("llama", dict(num_key_value_heads=4, tie_word_embeddings=False)),
    # GQA ratio 2, q/k/v/o biases, tied embeddings, head_dim 16 != 32 / 4.
    "llama-gqa2-bias-tied-hd16": ("llama", dict(attention_bias=True, tie_word_embeddings=True, head_dim=16)),
    # GQA ratio 4 with llama3 rope scaling.
    "llama3-rope-gqa4": ("llama", dict(num_key_value_heads=1, rope_parameters=LLAMA3_ROPE)),
    # Qwen3: per-head q/k norm, head_dim 16 != 32 / 4, untied, GQA ratio 1.
    "qwen3-hd16-mha-untied": ("qwen3", dict(head_dim=16, num_key_value_heads=4, tie_word_embeddings=False)),
    # Qwen3: head_dim 12, GQA ratio 4, tied.
    "qwen3-hd12-gqa4-tied": ("qwen3", dict(head_dim=12, num_key_value_heads=1, tie_word_embeddings=True,
                                           rope_parameters={"rope_type": "default", "rope_theta": 1000.0})),
    # Gemma 3: sliding window 4 < 12 tokens, local rope base 10 vs global 1e6, query_pre_attn_scalar
    # 20 != head_dim, (1+w) norms, pre/post norms, embed scale, GQA 2, head_dim 16 != 32 / 4.
    "gemma3-sliding": ("gemma3", dict(
        head_dim=16, sliding_window=4, query_pre_attn_scalar=20,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10.0},
                         "full_attention": {"rope_type": "default", "rope_theta": 1e6}})),
    # Gemma 3: linear-scaled global rope (as gemma-3-4b), untied, softcaps, GQA 4, 4 layers.
    "gemma3-linear-rope-softcap-untied": ("gemma3", dict(
        head_dim=8, num_key_value_heads=1, num_hidden_layers=4, sliding_window=3, query_pre_attn_scalar=8,
        tie_word_embeddings=False, final_logit_softcapping=2.0, attn_logit_softcapping=3.0,
        layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
                         "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e4}})),
}


@pytest.mark.parametrize("case", list(CASES))
def test_tiny_model_parity(case, tiny_hf_model):
    family, overrides = CASES[case]
    path, model = tiny_hf_model(family, **overrides)
    if overrides.get("attn_logit_softcapping"):  # transformers' Gemma 3 ignores it; so do we, loudly
        with pytest.warns(UserWarning, match="attn_logit_softcapping is ignored"):
            bb = check_parity(path, model)
    else:
        bb = check_parity(path, model)
    cfg, hf = bb.config, model.config
    assert cfg.family == family
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (
        hf.num_attention_heads, hf.num_key_value_heads, getattr(hf, "head_dim", None) or 32 // 4)
    assert cfg.tie_embeddings == bool(hf.tie_word_embeddings)
    assert ("lm_head" in bb.params) == (not hf.tie_word_embeddings)
    n_torch = sum(p.numel() for p in model.parameters())  # tied weights are counted once by torch
    assert sum(x.size for x in jax.tree.leaves(bb.params)) == n_torch == num_params(cfg)


def test_sharded_checkpoint_loads(tiny_hf_model):
    path, model = tiny_hf_model("llama", seed=3, num_key_value_heads=1, save_kwargs={"max_shard_size": "20KB"})
    index = json.loads((path / "model.safetensors.index.json").read_text())
    shards = set(index["weight_map"].values())
    assert len(shards) > 2 and all((path / s).exists() for s in shards)
    check_parity(path, model, seed=1)


@pytest.mark.parametrize("spec", [
    {"rope_type": "default", "rope_theta": 1e4},
    {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 8192, "rope_theta": 500000.0},
    {**LLAMA3_ROPE},
])
@pytest.mark.parametrize("head_dim", [8, 64, 128])
def test_rope_inv_freq_matches_transformers(spec, head_dim):
    """Inverse frequencies exactly as transformers computes them (tiny-model parity at short range
    cannot resolve the low-frequency bands that rope scaling changes)."""
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf = LlamaConfig(hidden_size=4 * head_dim, num_attention_heads=4, rope_parameters=dict(spec),
                     max_position_embeddings=131072)
    rope_type = spec["rope_type"]
    if rope_type == "default":
        ref = 1.0 / spec["rope_theta"] ** (np.arange(0, head_dim, 2) / head_dim)
        ref_scaling = 1.0
    else:
        ref, ref_scaling = ROPE_INIT_FUNCTIONS[rope_type](hf, "cpu")
        ref = ref.numpy()
    ours = RopeSpec.from_hf(hf.rope_parameters)
    np.testing.assert_allclose(ours.inv_freq(head_dim), ref, rtol=1e-6)
    assert math.isclose(ours.attention_scaling, ref_scaling)


@pytest.mark.parametrize("quant,kv_heads", [("F32", 2), ("Q8_0", 1)])
def test_tiny_gguf_parity(tiny_gguf, quant, kv_heads):
    """A GGUF written like llama.cpp's converter (Q/K rows permuted) loads to the same logits as
    transformers' own GGUF load; unquantised, also as the original model."""
    path, model = tiny_gguf(seed=5, num_key_value_heads=kv_heads, hidden_size=64, intermediate_size=64,
                            tie_word_embeddings=False, gguf_kwargs={"quant": quant})
    bb = load_backbone(path, tokenizer=False)
    tokens, valid = padded_batch(bb.config.vocab_size, seed=2)
    ours, _ = _forward(bb.params, bb.config, jnp.asarray(tokens, jnp.int32), valid=jnp.asarray(valid))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                      dtype=torch.float32).eval()
    assert_parity(ours, torch_logits(theirs, tokens, valid), valid)
    if quant == "F32":
        assert_parity(ours, torch_logits(model, tokens, valid), valid)


def test_bfloat16_checkpoint_loads(tiny_hf_model):
    """Real checkpoints are stored in bfloat16; loading upcasts them exactly."""
    path, model = tiny_hf_model("qwen3", head_dim=16)
    model = model.to(torch.bfloat16)
    model.save_pretrained(path)
    bb = load_backbone(path, jnp.float32, tokenizer=False)
    embed = model.model.embed_tokens.weight.detach().float().numpy()
    np.testing.assert_array_equal(np.asarray(bb.params["embed"]), embed)
    q = model.model.layers[2].self_attn.q_proj.weight.detach().float().numpy()
    np.testing.assert_array_equal(np.asarray(bb.params["layers"][0]["q"]["kernel"][2]), q.T)
    bb16 = load_backbone(path, jnp.bfloat16, tokenizer=False)
    assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(bb16.params))
    tokens, valid = padded_batch(bb.config.vocab_size)
    ours, _ = _forward(bb.params, bb.config, jnp.asarray(tokens, jnp.int32), valid=jnp.asarray(valid))
    # A fresh float32 load: model.float() would keep the bfloat16-rounded rotary inv_freq buffer.
    reloaded = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    assert_parity(ours, torch_logits(reloaded, tokens, valid), valid)


def test_gemma3_multimodal_checkpoint_loads_text_backbone(tmp_path):
    """Released Gemma 3 checkpoints (4B and up) are Gemma3ForConditionalGeneration: the text
    backbone sits under a language-model prefix next to a vision tower we do not load."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    text = dict(vocab_size=300, hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, sliding_window=4, query_pre_attn_scalar=20,
                initializer_range=0.15, layer_types=["sliding_attention", "full_attention", "sliding_attention"])
    vision = dict(hidden_size=16, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2, image_size=28,
                  patch_size=14)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cfg = Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4, boi_token_index=297,
                           eoi_token_index=298, image_token_index=299)
        torch.manual_seed(0)
        model = Gemma3ForConditionalGeneration(cfg).eval()
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "norm" in name:
                    p.add_(0.3 * torch.randn_like(p))
        model.save_pretrained(tmp_path)
    bb = check_parity(tmp_path, model, vocab=297)  # text tokens only (297-299: image markers)
    assert bb.config.family == "gemma3" and bb.config.vocab_size == 300
