"""Gemma 4 text backbone (transformers' ``gemma4_text``): parity, KV cache, shapes, LoRA, sampler.

Gemma 4 layers are not all alike: full-attention layers have their own (wider) head dim, their
own kv-head count and, with ``attention_k_eq_v``, no v projection (values are the k projection);
a per-layer-input (PLE) branch follows each MLP; the last layers may reuse earlier layers' keys
and values (KV sharing) with double-wide MLPs. The tiny cases below switch each of these on.

* Parity: tiny random transformers models saved as safetensors, loaded with ``load_backbone``,
  logits compared on a left-padded batch (as ``test_models_parity``).
* Cache: prefill + one-token steps equal the full forward at every position, for stacked,
  unrolled, split and mixed layouts.
* Shapes: Gemma-4-31B and transformers' default config, our parameter count vs the meta-device
  transformers model.
* LoRA on the last L_adapt blocks (factors sized for the widest layer) equals a dense forward
  through merged weights; the sampler's greedy tokens equal step-by-step full forwards.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from conftest import perturb_, torch_logits
from safetensors.numpy import save_file

from morse_jax.models import (Backbone, ModelConfig, RopeSpec, forward, from_hf_config, init_cache, init_params,
                              load_backbone, num_params, param_shapes, split_segments, unstack_segments)
from morse_jax.mole.experts import ExpertBankSpec, gather_lora, pad_active
from morse_jax.sampling.sampler import Request, Sampler, SamplerConfig

_forward = jax.jit(forward, static_argnames=("cfg", "logits_mode"))
S, F = "sliding_attention", "full_attention"

# --------------------------------------------------------------------------- transformers models

TINY = dict(vocab_size=97, hidden_size=32, intermediate_size=48, num_attention_heads=4, max_position_embeddings=256,
            initializer_range=0.15, sliding_window=4,
            # small rope bases: the 12-token batch sees the rotations (the full-attention one partial)
            rope_parameters={S: {"rope_type": "default", "rope_theta": 10.0},
                             F: {"rope_type": "proportional", "partial_rotary_factor": 0.5, "rope_theta": 100.0}})

CASES = {
    # Gemma-4-31B's dense layout: full-attention heads twice as wide (16 vs 8), k = v there with
    # one kv head (GQA 4) next to sliding layers with two (GQA 2); no PLE; tied; final softcap.
    "dense-31b-like": dict(num_hidden_layers=4, head_dim=8, global_head_dim=16, num_key_value_heads=2,
                           num_global_key_value_heads=1, attention_k_eq_v=True, hidden_size_per_layer_input=0,
                           layer_types=[S, F, S, F], final_logit_softcapping=5.0, tie_word_embeddings=True),
    # E2B/E4B's extras: per-layer inputs, the last 3 layers KV-shared with double-wide MLPs,
    # untied head, MHA (4 kv heads) in every layer, window 3.
    "ple-kvshared-untied": dict(num_hidden_layers=6, head_dim=8, global_head_dim=16, num_key_value_heads=4,
                                hidden_size_per_layer_input=8, vocab_size_per_layer_input=97,
                                num_kv_shared_layers=3, use_double_wide_mlp=True, tie_word_embeddings=False,
                                layer_types=[S, F, S, S, F, F], sliding_window=3),
    # All layers alike (one scanned segment, sliding/full chosen per layer under the scan), with
    # q/k/v/o biases, GQA 4 and head_dim 16 != 32 / 4.
    "uniform-bias-gqa4": dict(num_hidden_layers=3, head_dim=16, global_head_dim=16, num_key_value_heads=1,
                              attention_bias=True, hidden_size_per_layer_input=4, vocab_size_per_layer_input=97,
                              layer_types=[S, F, F]),
}

LENGTHS, T = (12, 8, 3), 12  # a full row and two left-padded rows


def build_hf(tmp_path, seed=0, **overrides):
    from transformers import AutoModelForCausalLM, Gemma4TextConfig

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cfg = Gemma4TextConfig(**{**TINY, **overrides})
        torch.manual_seed(seed)
        model = perturb_(AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval(), seed)
        model.save_pretrained(tmp_path)
    return model


def padded_batch(vocab, seed=0):
    rng = np.random.default_rng(seed)
    valid = np.arange(T)[None, :] >= (T - np.asarray(LENGTHS))[:, None]
    return np.where(valid, rng.integers(0, vocab, (len(LENGTHS), T)), 0), valid


def assert_close(ours, ref, what="", rtol=1e-4):
    ours, ref = np.asarray(ours), np.asarray(ref)
    err, scale = np.abs(ours - ref).max(), np.abs(ref).max()
    assert err <= rtol * scale, f"{what}: max diff {err:.3g} > {rtol} * max |ref| {scale:.3g}"
    assert scale > 1e-2  # a meaningful comparison


def load(path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # no tokenizer files
        return load_backbone(path, tokenizer=False)


def num_layer_scalars(model) -> int:
    """transformers keeps Gemma 4's layer scalars as (saved) buffers, we as parameters."""
    return sum(b.numel() for n, b in model.named_buffers() if n.endswith("layer_scalar"))


# --------------------------------------------------------------------------- parity


@pytest.mark.parametrize("case", list(CASES))
def test_tiny_model_parity(case, tmp_path):
    model = build_hf(tmp_path, **CASES[case])
    bb = load(tmp_path)
    cfg, hf = bb.config, model.config
    tokens, valid = padded_batch(cfg.vocab_size)
    ours, _ = _forward(bb.params, cfg, jnp.asarray(tokens, jnp.int32), valid=jnp.asarray(valid))
    assert_close(np.asarray(ours)[valid], torch_logits(model, tokens, valid)[valid], case)

    assert cfg.family == "gemma4" and cfg.layer_types == tuple(hf.layer_types)
    for i, layer in enumerate(model.model.layers):
        attn = layer.self_attn
        assert cfg.layer_head_dim(i) == attn.head_dim
        assert cfg.layer_kv_heads(i) == cfg.num_heads // attn.num_key_value_groups
        assert cfg.layer_has_v(i) == (getattr(attn, "v_proj", None) is not None or attn.is_kv_shared_layer)
        assert cfg.layer_intermediate_size(i) == layer.mlp.intermediate_size
        assert (cfg.kv_sharing_modes[i] == "reuse") == attn.is_kv_shared_layer
    assert ("lm_head" in bb.params) == (not hf.tie_word_embeddings)
    n_torch = sum(p.numel() for p in model.parameters()) + num_layer_scalars(model)
    assert sum(x.size for x in jax.tree.leaves(bb.params)) == n_torch == num_params(cfg)


def test_layer_layout_follows_shapes():
    """Differently shaped layers sit in separate stacked segments; alike ones share one."""
    shapes = param_shapes(from_hf_config(_hf_config(**CASES["dense-31b-like"])))
    assert [s["attn_norm"][0] for s in shapes["layers"]] == [1, 1, 1, 1]
    assert [s["q"]["kernel"][-1] for s in shapes["layers"]] == [32, 64, 32, 64]
    assert ["v" in s for s in shapes["layers"]] == [True, False, True, False]  # k = v full layers
    shapes = param_shapes(from_hf_config(_hf_config(**CASES["ple-kvshared-untied"])))
    # layers 0 S | 1 F | 2 S (stores for S) | 3 S shared | 4-5 F shared (double-wide MLP)
    assert [s["attn_norm"][0] for s in shapes["layers"]] == [1, 1, 1, 1, 2]
    assert ["k" in s for s in shapes["layers"]] == [True, True, True, False, False]
    assert shapes["layers"][-1]["gate"]["kernel"] == (2, 32, 96)
    shapes = param_shapes(from_hf_config(_hf_config(**CASES["uniform-bias-gqa4"])))
    assert len(shapes["layers"]) == 1


def test_multimodal_checkpoint_loads_text_backbone(tmp_path):
    """Released Gemma 4 checkpoints are Gemma4ForConditionalGeneration: the text backbone sits
    under model.language_model (here with per-layer inputs, whose tables live there too)."""
    from transformers import Gemma4Config, Gemma4ForConditionalGeneration

    text = {**TINY, **CASES["dense-31b-like"], "hidden_size_per_layer_input": 8, "vocab_size_per_layer_input": 97}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cfg = Gemma4Config(text_config=text, vision_config=None, audio_config=None)
        torch.manual_seed(3)
        model = perturb_(Gemma4ForConditionalGeneration(cfg).eval(), 3)
        model.save_pretrained(tmp_path)
    bb = load(tmp_path)
    assert bb.config.family == "gemma4" and bb.config.per_layer_input_size == 8
    tokens, valid = padded_batch(bb.config.vocab_size, seed=1)
    ours, _ = _forward(bb.params, bb.config, jnp.asarray(tokens, jnp.int32), valid=jnp.asarray(valid))
    assert_close(np.asarray(ours)[valid], torch_logits(model, tokens, valid)[valid], "multimodal")


@pytest.mark.parametrize("head_dim, spec", [
    (512, {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1e6}),
    (16, {"rope_type": "proportional", "partial_rotary_factor": 0.5, "rope_theta": 100.0, "factor": 2.0}),
    (256, {"rope_type": "default", "rope_theta": 1e4}),
])
def test_rope_inv_freq_matches_transformers(head_dim, spec):
    """Full rotary tables exactly as transformers builds them (short tiny batches cannot resolve
    the low frequencies, nor the unrotated tail of partial rotary embeddings)."""
    from transformers.models.gemma4.modeling_gemma4 import Gemma4TextRotaryEmbedding

    layer_type = F if spec["rope_type"] == "proportional" else S
    hf = _hf_config(num_hidden_layers=2, head_dim=head_dim, global_head_dim=head_dim, layer_types=[S, F],
                    rope_parameters={layer_type: spec, (S if layer_type == F else F): {"rope_type": "default",
                                                                                      "rope_theta": 1e4}})
    rotary = Gemma4TextRotaryEmbedding(hf)
    cfg = from_hf_config(hf)
    ours = (cfg.rope_full if layer_type == F else cfg.rope_sliding).inv_freq(head_dim)
    np.testing.assert_allclose(ours, getattr(rotary, f"{layer_type}_inv_freq").numpy(), rtol=1e-6)


# --------------------------------------------------------------------------- unsupported options


def _hf_config(**overrides):
    from transformers import Gemma4TextConfig

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return Gemma4TextConfig(**{**TINY, **overrides})


@pytest.mark.parametrize("overrides, option", [
    (dict(enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=16), "enable_moe_block"),
    (dict(use_bidirectional_attention="all"), "use_bidirectional_attention"),
])
def test_unsupported_options_raise_at_load_time(tmp_path, overrides, option):
    _hf_config(num_hidden_layers=2, head_dim=8, global_head_dim=16, **overrides).save_pretrained(tmp_path)
    save_file({"model.embed_tokens.weight": np.zeros((97, 32), np.float32)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(NotImplementedError, match=f"(?s)config.json.*Gemma 4 {option}"):
        load(tmp_path)


def test_unsupported_per_layer_override_is_named():
    hf = _hf_config(num_hidden_layers=2, head_dim=8, global_head_dim=16,
                    per_layer_config={1: {"head_dim": 16, "intermediate_size": 64}})
    with pytest.raises(NotImplementedError, match="per_layer_config overriding.*intermediate_size"):
        from_hf_config(hf)


def test_lora_factors_too_narrow_for_a_layer_are_rejected():
    """Banks sized by the sliding layers' head dim cannot adapt a wider full-attention layer."""
    cfg = CONFIGS["kvshared-ple"]
    params = jax.eval_shape(lambda: split_segments(init_params(jax.random.PRNGKey(0), cfg), 2))
    spec = ExpertBankSpec(targets=("q",), rank=2, alpha=2.0, n_adapt=2)
    d_out = cfg.num_heads * cfg.head_dim  # the sliding layers' width; layer 5 is twice as wide
    bank = {"a": {"q": jnp.zeros((spec.num_experts, 2, cfg.hidden_size, 2))},
            "b": {"q": jnp.zeros((spec.num_experts, 2, 2, d_out))}}
    ids, w = pad_active([[(0, 1.0)]], 1)
    with pytest.raises(ValueError, match="ModelConfig.target_dims"):
        jax.eval_shape(lambda p: forward(p, cfg, jnp.zeros((1, 3), jnp.int32), lora=gather_lora(bank, spec, ids, w)),
                       params)


@pytest.mark.parametrize("case,n_adapt", [("dense-31b-like", 2), ("ple-kvshared-untied", 4)])
def test_exported_expert_applied_by_peft_gives_our_logits(case, n_adapt, tmp_path):
    """export_peft cuts each layer's factors to its own projection and leaves out the ones the
    layer lacks (v on k = v layers, k / v on KV-shared layers); PEFT then reproduces our logits."""
    from peft import PeftModel

    from morse_jax.mole.experts import export_peft, init_expert_bank

    model = build_hf(tmp_path / "base", **CASES[case])
    bb = load(tmp_path / "base")
    cfg = bb.config
    spec = ExpertBankSpec(num_subtask=2, rank=4, alpha=8.0, n_adapt=n_adapt, targets=("q", "k", "v", "o", "down"))
    bank = init_expert_bank(jax.random.PRNGKey(1), cfg, spec)
    rng = np.random.default_rng(2)
    bank["b"] = {t: jnp.asarray(0.5 * rng.standard_normal(b.shape), jnp.float32) for t, b in bank["b"].items()}
    expert = spec.subtask_id(1)
    out = export_peft(bank, spec, cfg, expert, tmp_path / "adapter")

    tokens, valid = padded_batch(cfg.vocab_size)
    ids, weights = pad_active([[(expert, 1.0)]] * len(tokens), 1)
    params = split_segments(bb.params, n_adapt)
    ours, _ = _forward(params, cfg, jnp.asarray(tokens, jnp.int32), valid=jnp.asarray(valid),
                       lora=gather_lora(bank, spec, ids, weights))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hf_base = torch_logits(model, tokens, valid)
        hf_lora = torch_logits(PeftModel.from_pretrained(model, str(out)).eval(), tokens, valid)
    assert_close(np.asarray(ours)[valid], hf_lora[valid], case)
    assert np.abs(hf_lora - hf_base)[valid].max() > 1e-2 * np.abs(hf_base).max()  # the adapter does work


# --------------------------------------------------------------------------- full-size shapes

# google/gemma-4-31B-it text_config (config.json values).
GEMMA4_31B = dict(
    vocab_size=262144, hidden_size=5376, intermediate_size=21504, num_hidden_layers=60, num_attention_heads=32,
    num_key_value_heads=16, num_global_key_value_heads=4, head_dim=256, global_head_dim=512, attention_k_eq_v=True,
    hidden_activation="gelu_pytorch_tanh", max_position_embeddings=262144, rms_norm_eps=1e-6, sliding_window=1024,
    final_logit_softcapping=30.0, hidden_size_per_layer_input=0, num_kv_shared_layers=0, use_double_wide_mlp=False,
    enable_moe_block=False, tie_word_embeddings=True, layer_types=([S] * 5 + [F]) * 10,
    rope_parameters={F: {"partial_rotary_factor": 0.25, "rope_theta": 1000000.0, "rope_type": "proportional"},
                     S: {"rope_theta": 10000.0, "rope_type": "default"}})


@pytest.mark.parametrize("name", ["gemma-4-31B", "transformers-default"])
def test_param_count_matches_transformers(name):
    from transformers import AutoModelForCausalLM, Gemma4TextConfig

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hf = Gemma4TextConfig(**GEMMA4_31B) if name == "gemma-4-31B" else Gemma4TextConfig()
    cfg = from_hf_config(hf)
    shapes = jax.eval_shape(functools.partial(init_params, cfg=cfg), jax.random.PRNGKey(0))
    ours = sum(math.prod(x.shape) for x in jax.tree.leaves(shapes))
    with torch.device("meta"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = AutoModelForCausalLM.from_config(hf)
    theirs = sum(p.numel() for p in model.parameters()) + num_layer_scalars(model)
    assert ours == theirs == num_params(cfg)
    if name == "gemma-4-31B":
        assert 30.0e9 < ours < 31.5e9  # "31B" (text backbone; the vision tower is not counted)
        assert (cfg.layer_head_dim(0), cfg.layer_kv_heads(0), cfg.layer_has_v(0)) == (256, 16, True)
        assert (cfg.layer_head_dim(5), cfg.layer_kv_heads(5), cfg.layer_has_v(5)) == (512, 4, False)
        assert cfg.layer_types.count(F) == 10 and cfg.sliding_window == 1024 and cfg.final_logit_softcap == 30.0
        assert (cfg.rope_full.rope_type, cfg.rope_full.partial_rotary_factor, cfg.rope_full.theta) == (
            "proportional", 0.25, 1e6)
        assert cfg.scale == 1.0 and cfg.norm_offset == 0.0 and cfg.per_layer_input_size == 0
        # LoRA factors are sized for the widest layer: q of the 512-wide full-attention heads
        assert cfg.target_dims("q") == (5376, 32 * 512) and cfg.target_dims("v") == (5376, 16 * 256)
    else:
        assert cfg.per_layer_input_size == 256 and cfg.per_layer_vocab_size == 262144


# --------------------------------------------------------------------------- KV cache

CONFIGS = {
    # k = v full layers with wider heads, PLE, and the last two layers KV-shared (one sliding, one
    # full with a double-wide MLP). Stacked segments: [0 1] S | 2 F (stores) | 3 S (stores) |
    # 4 S shared | 5 F shared.
    "kvshared-ple": ModelConfig(
        family="gemma4", vocab_size=61, hidden_size=32, intermediate_size=48, num_layers=6, num_heads=4,
        num_kv_heads=2, head_dim=8, global_head_dim=16, num_global_kv_heads=1, attention_k_eq_v=True, v_norm=True,
        activation="gelu_tanh", qk_norm=True, embed_scale=True, post_norms=True, query_scale=1.0, sliding_window=3,
        layer_types=(S, S, F, S, S, F), rope_full=RopeSpec(theta=100.0, rope_type="proportional",
                                                          partial_rotary_factor=0.5),
        rope_sliding=RopeSpec(theta=10.0), final_logit_softcap=5.0, per_layer_input_size=8, per_layer_vocab_size=61,
        layer_scalar=True, num_kv_shared_layers=2, double_wide_mlp=True),
}
CONFIGS["dense"] = dataclasses.replace(CONFIGS["kvshared-ple"], per_layer_input_size=0, per_layer_vocab_size=0,
                                       num_kv_shared_layers=0, double_wide_mlp=False, tie_embeddings=True)

P, N, MAX_LEN = 6, 5, 14
CACHE_LENGTHS = (6, 4, 1)


def random_params(cfg, seed):
    """init_params with larger weights (peaked attention) and noisy norms / scalars."""
    params = jax.jit(init_params, static_argnums=1)(jax.random.PRNGKey(seed), cfg)
    rng = np.random.default_rng(seed)

    def perturb(path, x):
        x, name = np.asarray(x), jax.tree_util.keystr(path)
        if "norm" in name or "scalar" in name:
            return jnp.asarray(x + 0.3 * rng.normal(size=x.shape).astype(x.dtype))
        return jnp.asarray(8.0 * x)

    return jax.tree_util.tree_map_with_path(perturb, params)


@functools.partial(jax.jit, static_argnames=("cfg",))
def prefill_then_decode(params, cfg, tokens, valid):
    cache = init_cache(cfg, params, tokens.shape[0], MAX_LEN)
    prefill, cache = forward(params, cfg, tokens[:, :P], valid=valid[:, :P], cache=cache)

    def step(cache, tok):
        logits, cache = forward(params, cfg, tok[:, None], valid=jnp.ones_like(tok[:, None], bool), cache=cache)
        return cache, logits[:, 0]

    cache, steps = jax.lax.scan(step, cache, tokens[:, P:].T)
    return prefill, steps, cache


def layouts(params):
    split = split_segments(params, 5)  # cuts the leading run of two sliding layers
    return {
        "stacked": params,
        "unstacked": unstack_segments(params),
        "split5": split,
        # what the sampler's model path runs: every layer unrolled
        "split5-unrolled": unstack_segments(split),
        # the first segment scanned, the others unrolled
        "split5-mixed": {**split, "layers": (split["layers"][0], *unstack_segments(
            {"layers": split["layers"][1:]})["layers"])},
    }


@functools.lru_cache(maxsize=None)
def cached_model(name):
    cfg = CONFIGS[name]
    params = random_params(cfg, seed=len(name))
    rng = np.random.default_rng(0)
    tokens = rng.integers(1, cfg.vocab_size, (len(CACHE_LENGTHS), P + N))
    prompt_valid = np.arange(P)[None, :] >= (P - np.asarray(CACHE_LENGTHS))[:, None]
    tokens[:, :P] = np.where(prompt_valid, tokens[:, :P], 0)
    valid = np.concatenate([prompt_valid, np.ones((len(CACHE_LENGTHS), N), bool)], axis=1)
    full, _ = _forward(params, cfg, jnp.asarray(tokens, jnp.int32), valid=jnp.asarray(valid))
    return cfg, params, tokens, valid, np.asarray(full)


@pytest.mark.parametrize("name, layout", [
    *(("kvshared-ple", layout) for layout in ("stacked", "unstacked", "split5", "split5-unrolled", "split5-mixed")),
    ("dense", "stacked"), ("dense", "split5-mixed")])
def test_cached_decode_matches_full_forward(name, layout):
    cfg, params, tokens, valid, full = cached_model(name)
    params = layouts(params)[layout]
    prefill, steps, cache = prefill_then_decode(params, cfg, jnp.asarray(tokens, jnp.int32), jnp.asarray(valid))
    pv = valid[:, :P]
    assert_close(np.asarray(prefill)[pv], full[:, :P][pv], f"{layout} prefill")
    for i in range(N):
        assert_close(steps[i], full[:, P + i], f"{layout} decode step {i}")
    assert int(cache["index"]) == P + N
    # KV-shared layers hold no cache of their own
    cached_layers = sum(x.shape[0] if x.ndim == 5 else 1 for x in jax.tree.leaves(cache["layers"])) // 2
    assert cached_layers == sum(m != "reuse" for m in cfg.kv_sharing_modes)


def test_split_segments_regroups_heterogeneous_layers():
    """split_segments keeps differently shaped layers apart, cuts at L_adapt and is idempotent;
    unrolled input regroups into the same stacked segments."""
    cfg = CONFIGS["kvshared-ple"]
    params = jax.tree.map(np.asarray, jax.jit(init_params, static_argnums=1)(jax.random.PRNGKey(0), cfg))
    assert [int(s["attn_norm"].shape[0]) for s in params["layers"]][0] == 2
    for n_adapt in (3, 5):
        split = split_segments(params, n_adapt)
        sizes = [int(s["attn_norm"].shape[0]) for s in split["layers"]]
        assert sum(sizes) == cfg.num_layers and _tail(sizes, n_adapt)
        assert _same(split_segments(split, n_adapt), split)
        assert _same(split_segments(unstack_segments(params), n_adapt), split)
    back = split_segments(split, 0)
    assert [int(s["attn_norm"].shape[0]) for s in back["layers"]] == [
        int(s["attn_norm"].shape[0]) for s in params["layers"]]


def _tail(sizes, n):
    """How many trailing segments cover exactly the last n layers."""
    total = 0
    for k, s in enumerate(reversed(sizes), 1):
        total += s
        if total == n:
            return k
    raise AssertionError(f"no segment boundary {n} layers from the end: {sizes}")


def _same(a, b) -> bool:
    la, lb = jax.tree_util.tree_flatten(a), jax.tree_util.tree_flatten(b)
    return la[1] == lb[1] and all(np.array_equal(x, y) for x, y in zip(la[0], lb[0]))


# --------------------------------------------------------------------------- LoRA experts

ROWS = [[(0, 0.5), (3, 0.5)], [(1, 1.0)], [], [(4, 0.0)], [(5, 1.0)]]
ROWS_BASE = (2, 3)


def trained_bank(cfg, spec, seed=1, b_std=0.3):
    """Random A and B (B != 0) sized by ``cfg.target_dims`` (the widest layer of each target)."""
    rng = np.random.default_rng(seed)
    bank = {"a": {}, "b": {}}
    for t in spec.targets:
        d_in, d_out = cfg.target_dims(t)
        bank["a"][t] = jnp.asarray(rng.uniform(-1, 1, (spec.num_experts, spec.n_adapt, d_in, spec.rank)).astype(
            np.float32) / np.sqrt(d_in))
        bank["b"][t] = jnp.asarray(b_std * rng.normal(size=(spec.num_experts, spec.n_adapt, spec.rank, d_out)).astype(
            np.float32))
    return bank


@functools.partial(jax.jit, static_argnames=("cfg", "spec"))
def lora_logits(params, bank, ids, weights, tokens, valid, cfg, spec):
    return forward(params, cfg, tokens, valid=valid, lora=gather_lora(bank, spec, ids, weights))[0]


def merged_layers(params, bank, spec, cfg, row):
    """Per-layer dicts with W + sum_k w_k * scaling * A_k B_k in the last n_adapt layers' kernels
    (each cut to its layer's width); a target a layer lacks (v of k = v layers) is skipped."""
    layers = [dict(lp) for seg in unstack_segments(params)["layers"] for lp in seg]
    first = cfg.num_layers - spec.n_adapt
    for j in range(spec.n_adapt):
        lp = layers[first + j]
        for t in spec.targets:
            if t not in lp:
                continue
            kernel = np.asarray(lp[t]["kernel"], np.float64)
            d_in, d_out = kernel.shape
            for e, w in row:
                a = np.asarray(bank["a"][t][e, j], np.float64)[:d_in]
                b = np.asarray(bank["b"][t][e, j], np.float64)[:, :d_out]
                kernel = kernel + w * spec.scaling * a @ b
            lp[t] = {**lp[t], "kernel": kernel.astype(np.float32)}
    return {**params, "layers": (tuple(layers),)}


@pytest.mark.parametrize("targets", [("q", "v", "o"), ("k", "gate", "up", "down")])
def test_lora_on_last_blocks_matches_merged_dense_forward(targets):
    """Experts attach to the last L_adapt = 4 blocks (a full layer with wider heads and no v, a
    sliding one, a KV-shared sliding one and a KV-shared double-wide full one): each row equals a
    dense forward through its merged weights; empty / zero-weight rows are the base model."""
    cfg = CONFIGS["kvshared-ple"]
    spec = ExpertBankSpec(targets=targets, rank=4, alpha=6.0, n_adapt=4)
    params = split_segments(random_params(cfg, seed=2), spec.n_adapt)
    bank = trained_bank(cfg, spec)
    ids, weights = pad_active(ROWS, 2)
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, cfg.vocab_size, (len(ROWS), 7)).astype(np.int32)
    valid = np.ones(tokens.shape, bool)
    valid[1, :2] = False
    got = np.asarray(lora_logits(params, bank, ids, weights, tokens, valid, cfg=cfg, spec=spec))
    base = np.asarray(_forward(params, cfg, tokens, valid=valid)[0])
    for i, row in enumerate(ROWS):
        ref = np.asarray(_forward(merged_layers(params, bank, spec, cfg, row), cfg, tokens, valid=valid)[0])[i]
        # the reference runs unrolled in float32 through other kernels: ~1e-5 apart; a lost or
        # misrouted expert moves the logits by > 1e-2 (checked below)
        assert_close(got[i][valid[i]], ref[valid[i]], f"row {i}", rtol=1e-4)
        if i in ROWS_BASE:  # a zero delta; another XLA program than the base forward, so ulp-close
            assert_close(got[i], base[i], f"row {i}", rtol=1e-6)
        else:
            assert np.abs(got[i] - base[i]).max() > 1e-2 * np.abs(base[i]).max(), f"row {i}: no LoRA effect"


# --------------------------------------------------------------------------- sampler

SMALL = SamplerConfig(batch_buckets=(4,), prompt_buckets=(32,), new_token_buckets=(16,), max_batch=4, chunk=4,
                      max_active=2, prefill_rows=16)
PROMPT_LENS = (3, 11, 1, 7, 16)
SAMPLER_SETS = [[], [(0, 1.0)], [(1, 0.5), (3, 0.5)], [(2, 0.0)], [(4, 0.5), (0, 0.5)]]


def greedy_reference(params, cfg, spec, bank, prompt_list, sets, n_new, width=32):
    """Step-by-step full forwards without a cache over right-padded rows: greedy tokens and log-probs."""
    ids, w = pad_active(sets, 2)
    seqs = [list(p) for p in prompt_list]
    out, lps = np.zeros((len(seqs), n_new), np.int64), np.zeros((len(seqs), n_new), np.float32)
    for t in range(n_new):
        toks, valid = np.zeros((len(seqs), width), np.int32), np.zeros((len(seqs), width), bool)
        for r, s in enumerate(seqs):
            toks[r, :len(s)], valid[r, :len(s)] = s, True
        lp = np.asarray(jax.nn.log_softmax(lora_logits(params, bank, ids, w, toks, valid, cfg=cfg, spec=spec), -1))
        for r, s in enumerate(seqs):
            out[r, t] = int(np.argmax(lp[r, len(s) - 1]))
            lps[r, t] = lp[r, len(s) - 1, out[r, t]]
            s.append(int(out[r, t]))
    return out, lps


@pytest.mark.parametrize("decode_path", ["fused", pytest.param("model", marks=pytest.mark.slow)])
def test_sampler_greedy_matches_full_forward(decode_path):
    """The jitted sampler (cached, unrolled, left-padded, chunked prefill, per-row experts) gives the
    greedy tokens of uncached full forwards on a tiny Gemma 4 with every option switched on."""
    # 4 layers (compiles dominate): 0 S | 1 F, k = v, stores | 2 S | 3 F KV-shared, double-wide
    cfg = dataclasses.replace(CONFIGS["kvshared-ple"], vocab_size=300, per_layer_vocab_size=300, num_layers=4,
                              layer_types=(S, F, S, F), num_kv_shared_layers=1)
    params = random_params(cfg, seed=5)
    spec = ExpertBankSpec(num_subtask=4, rank=4, alpha=6.0, n_adapt=3)
    bank = trained_bank(cfg, spec, seed=4, b_std=0.5)
    rng = np.random.default_rng(1)
    ps = [rng.integers(0, cfg.vocab_size, size=n).tolist() for n in PROMPT_LENS]
    n = 8
    reqs = [Request(p, expert_ids=[e for e, _ in s], expert_weights=[x for _, x in s], temperature=0.0,
                    max_new_tokens=n) for p, s in zip(ps, SAMPLER_SETS)]
    sampler = Sampler(Backbone(cfg, params, None), spec, dataclasses.replace(SMALL, decode_path=decode_path))
    got = sampler.generate(bank, reqs, key=jax.random.PRNGKey(0))
    want, want_lp = greedy_reference(split_segments(params, spec.n_adapt), cfg, spec, bank, ps, SAMPLER_SETS, n)
    for r, c in enumerate(got):
        assert c.token_ids == want[r].tolist(), f"row {r} (prompt length {PROMPT_LENS[r]})"
        np.testing.assert_allclose(c.logprobs, want_lp[r], atol=1e-4)
    assert len({tuple(c.token_ids) for c in got}) > 1  # rows differ: the test can tell them apart


def test_sharding_and_memory_plan_use_per_layer_kv_heads():
    """31B: sliding layers have 16 kv heads of 256, full layers 4 of 512. Over 8 tensor shards
    the sliding k projection splits by heads; the full one (4 heads) must not be cut mid-head
    though its width (2048) divides; the KV-cache estimate counts each layer's own width."""
    from morse_jax.parallel.memory import _ShapeMesh, memory_plan
    from morse_jax.parallel.sharding import mesh_axes_for

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from transformers import Gemma4TextConfig

        cfg = from_hf_config(Gemma4TextConfig(**GEMMA4_31B))
    mesh = _ShapeMesh((1, 1, 8))
    assert mesh_axes_for(mesh, "kv_heads", 16 * 256, cfg) == ("tensor",)
    assert mesh_axes_for(mesh, "kv_heads", 4 * 512, cfg) is None
    assert mesh_axes_for(mesh, "heads", 32 * 512, cfg) == ("tensor",)
    S = 4096
    plan = memory_plan(cfg, None, batch=1, cache_len=S, mesh_shape=(1, 1, 1), dtype="bfloat16", sample_batch=1)
    per_token = 2 * 2 * (50 * 16 * 256 + 10 * 4 * 512)  # k and v, bf16, sliding + full layers
    assert plan.kv_cache[(1, S)] == per_token * S
