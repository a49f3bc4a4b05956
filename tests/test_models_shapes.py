"""Full-size configs: our parameter shapes (``jax.eval_shape`` of ``init_params``) give the same
parameter counts as the transformers models built from the same config.json values on the meta
device (no weights allocated anywhere).

The dicts below are the public config.json values of the named checkpoints (text parts only).
"""

from __future__ import annotations

import functools
import math
import warnings

import jax
import pytest
import torch
from transformers import AutoModelForCausalLM
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

from morse_jax.models import from_hf_config, init_params, num_params

QWEN3_4B = dict(
    model_type="qwen3", vocab_size=151936, hidden_size=2560, intermediate_size=9728, num_hidden_layers=36,
    num_attention_heads=32, num_key_value_heads=8, head_dim=128, hidden_act="silu", max_position_embeddings=40960,
    rms_norm_eps=1e-6, rope_theta=1000000, tie_word_embeddings=True, attention_bias=False, use_sliding_window=False,
    bos_token_id=151643, eos_token_id=151645)

LLAMA_31_8B = dict(
    model_type="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
    num_attention_heads=32, num_key_value_heads=8, hidden_act="silu", max_position_embeddings=131072,
    rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=False, attention_bias=False, mlp_bias=False,
    rope_scaling={"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    bos_token_id=128000, eos_token_id=128001)

GEMMA3_4B_TEXT = dict(
    model_type="gemma3_text", vocab_size=262208, hidden_size=2560, intermediate_size=10240, num_hidden_layers=34,
    num_attention_heads=8, num_key_value_heads=4, head_dim=256, hidden_activation="gelu_pytorch_tanh",
    max_position_embeddings=131072, rms_norm_eps=1e-6, query_pre_attn_scalar=256, sliding_window=1024,
    sliding_window_pattern=6, rope_theta=1000000.0, rope_local_base_freq=10000.0,
    rope_scaling={"factor": 8.0, "rope_type": "linear"}, final_logit_softcapping=None,
    attn_logit_softcapping=None, tie_word_embeddings=True)

# Published sizes (text backbone), a sanity check that both counts are not wrong the same way.
MODELS = {
    "Qwen3-4B": (QWEN3_4B, 4.02e9),
    "Llama-3.1-8B": (LLAMA_31_8B, 8.03e9),
    "gemma-3-4b (text)": (GEMMA3_4B_TEXT, 3.88e9),
}


def hf_config(values: dict):
    values = dict(values)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return CONFIG_MAPPING[values.pop("model_type")](**values)


@pytest.mark.parametrize("name", list(MODELS))
def test_param_count_matches_transformers(name):
    values, published = MODELS[name]
    hf = hf_config(values)
    cfg = from_hf_config(hf)
    shapes = jax.eval_shape(functools.partial(init_params, cfg=cfg), jax.random.PRNGKey(0))
    ours = sum(math.prod(x.shape) for x in jax.tree.leaves(shapes))
    with torch.device("meta"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = AutoModelForCausalLM.from_config(hf)
    theirs = sum(p.numel() for p in model.parameters())  # tied embeddings counted once
    assert ours == theirs == num_params(cfg)
    assert abs(ours - published) / published < 0.01
    assert all(x.dtype == "float32" for x in jax.tree.leaves(shapes))


def test_full_size_configs_translate():
    """The features the tiny parity tests exercise are switched on by the real configs."""
    qwen = from_hf_config(hf_config(QWEN3_4B))
    assert (qwen.family, qwen.qk_norm, qwen.head_dim, qwen.tie_embeddings) == ("qwen3", True, 128, True)
    assert qwen.rope_full.theta == 1e6 and qwen.scale == 128 ** -0.5

    llama = from_hf_config(hf_config(LLAMA_31_8B))
    assert (llama.family, llama.qk_norm, llama.tie_embeddings, llama.rms_norm_eps) == ("llama", False, False, 1e-5)
    assert llama.rope_full.rope_type == "llama3" and llama.rope_full.factor == 8.0
    assert llama.rope_full.theta == 500000.0 and llama.rope_full.original_max_position_embeddings == 8192

    gemma = from_hf_config(hf_config(GEMMA3_4B_TEXT))
    assert (gemma.family, gemma.norm_offset, gemma.embed_scale, gemma.post_norms) == ("gemma3", 1.0, True, True)
    assert gemma.layer_types.count("full_attention") == 34 // 6  # every 6th layer is global
    assert gemma.layer_types[5] == "full_attention" and gemma.layer_types[0] == "sliding_attention"
    assert gemma.sliding_window == 1024 and gemma.scale == 256 ** -0.5
    assert (gemma.rope_full.rope_type, gemma.rope_full.factor, gemma.rope_full.theta) == ("linear", 8.0, 1e6)
    assert (gemma.rope_sliding.rope_type, gemma.rope_sliding.theta) == ("default", 10000.0)


def test_gemma3_multimodal_config_unwraps_to_text():
    from transformers import Gemma3Config

    text = {k: v for k, v in GEMMA3_4B_TEXT.items() if k != "model_type"}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        wrapped = Gemma3Config(text_config=text)
    assert from_hf_config(wrapped) == from_hf_config(hf_config(GEMMA3_4B_TEXT))


@pytest.mark.parametrize("model_type", ["gpt2", "mixtral", None])
def test_unknown_architecture_is_rejected(model_type):
    class Cfg:
        pass

    cfg = Cfg()
    cfg.model_type = model_type
    with pytest.raises(ValueError, match=f"model_type {model_type!r} is not supported"):
        from_hf_config(cfg)


@pytest.mark.parametrize("one_draw", [True, False])
def test_init_params_statistics(monkeypatch, one_draw):
    """Both init regimes (one sliced draw for small models, per-leaf draws for large ones) give
    the documented distribution, the shapes of param_shapes, and independent leaves."""
    import numpy as np

    from morse_jax.models import ModelConfig, param_shapes
    from morse_jax.models import params as transformer_params

    monkeypatch.setattr(transformer_params, "_FLAT_INIT_MAX", 1 << 40 if one_draw else 0)
    cfg = ModelConfig(family="gemma3", vocab_size=64, hidden_size=32, intermediate_size=32, num_layers=1,
                      num_heads=2, num_kv_heads=1, head_dim=16, activation="gelu_tanh", qk_norm=True,
                      norm_offset=1.0, embed_scale=True, post_norms=True)
    params = init_params(jax.random.PRNGKey(0), cfg)
    got = jax.tree_util.tree_flatten_with_path(params)[0]
    want = jax.tree.leaves(param_shapes(cfg), is_leaf=lambda x: isinstance(x, tuple) and all(
        isinstance(i, int) for i in x))
    assert [x.shape for _, x in got] == [tuple(s) for s in want]
    weights = []
    for path, x in got:
        x = np.asarray(x)
        if "norm" in jax.tree_util.keystr(path):
            assert (x == 0.0).all()  # Gemma: (1 + w) with w = 0 is an effective scale of 1
        else:
            assert abs(x.std() - 0.02) < 0.004 and abs(x.mean()) < 0.004
            weights.append(x.ravel())
    firsts = [w[:16] for w in weights]
    assert len({w.tobytes() for w in firsts}) == len(firsts)  # no two leaves share a slice
