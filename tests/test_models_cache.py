"""KV-cache decoding equals the full forward pass.

A left-padded batch of mixed-length prompts is prefilled into a cache (``init_cache`` +
``forward(..., cache=...)``), then continued one token at a time; every logit must match a
single full forward over prompt + continuation, for stacked (scan) params, unrolled
(``unstack_segments``) params, ``split_segments`` and mixed segment layouts.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from morse_jax.models import (Backbone, ModelConfig, RopeSpec, forward, init_cache, init_params, logits,
                              split_segments, unstack_segments)

_forward = jax.jit(forward, static_argnames=("cfg", "logits_mode"))

CONFIGS = {
    "llama-gqa2": ModelConfig(
        family="llama", vocab_size=61, hidden_size=32, intermediate_size=48, num_layers=4, num_heads=4,
        num_kv_heads=2, head_dim=8, attention_bias=True),
    "gemma3-sliding": ModelConfig(
        family="gemma3", vocab_size=61, hidden_size=32, intermediate_size=48, num_layers=4, num_heads=4,
        num_kv_heads=1, head_dim=16, activation="gelu_tanh", qk_norm=True, norm_offset=1.0, embed_scale=True,
        post_norms=True, query_scale=20 ** -0.5, sliding_window=3,
        layer_types=("sliding_attention", "full_attention", "sliding_attention", "sliding_attention"),
        rope_full=RopeSpec(theta=1e6, rope_type="linear", factor=4.0), rope_sliding=RopeSpec(theta=10.0)),
}

LENGTHS = (6, 4, 1)  # prompt lengths, left padded to P
P, N, MAX_LEN = 6, 5, 14  # prompt width, decode steps, cache slots (some never written)


def random_params(cfg: ModelConfig, seed: int):
    """init_params with larger weights (peaked attention) and noisy norms, so masks and offsets matter."""
    params = jax.jit(init_params, static_argnums=1)(jax.random.PRNGKey(seed), cfg)
    rng = np.random.default_rng(seed)

    def perturb(path, x):  # in numpy: eager jnp ops would compile one kernel per leaf shape
        x = np.asarray(x)
        if "norm" in jax.tree_util.keystr(path):
            return jnp.asarray(x + 0.3 * rng.normal(size=x.shape).astype(x.dtype))
        return jnp.asarray(8.0 * x)

    return jax.tree_util.tree_map_with_path(perturb, params)


def layouts(params):
    split = split_segments(params, 2)
    return {
        "stacked": params,
        "unstacked": unstack_segments(params),
        "split2": split,
        # first segment scanned, adapted segment unrolled (what the sampler runs)
        "split1-mixed": {**params, "layers": (
            split_segments(params, 1)["layers"][0], unstack_segments(split_segments(params, 1))["layers"][1])},
    }


def batch(cfg, seed=0):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(1, cfg.vocab_size, (len(LENGTHS), P + N))
    prompt_valid = np.arange(P)[None, :] >= (P - np.asarray(LENGTHS))[:, None]
    tokens[:, :P] = np.where(prompt_valid, tokens[:, :P], 0)
    valid = np.concatenate([prompt_valid, np.ones((len(LENGTHS), N), bool)], axis=1)
    return tokens, valid


def assert_close(ours, ref, what):
    ours, ref = np.asarray(ours), np.asarray(ref)
    err = np.abs(ours - ref).max()
    assert err <= 1e-4 * np.abs(ref).max(), f"{what}: max diff {err:.3g} (max |logit| {np.abs(ref).max():.3g})"


@pytest.fixture(scope="module", params=list(CONFIGS))
def model(request):
    cfg = CONFIGS[request.param]
    params = random_params(cfg, seed=len(request.param))
    tokens, valid = batch(cfg)
    full, _ = _forward(params, cfg, jnp.asarray(tokens, jnp.int32), valid=jnp.asarray(valid))
    return cfg, params, tokens, valid, np.asarray(full)


@functools.partial(jax.jit, static_argnames=("cfg",))
def prefill_then_decode(params, cfg, tokens, valid):
    """Prefill tokens[:, :P] into a fresh cache, then feed tokens[:, P:] one at a time.

    One jit per layout (the decode steps run under lax.scan) keeps compiles to one per case.
    Returns (prefill logits [B, P, V], step logits [N, B, V], final cache).
    """
    cache = init_cache(cfg, params, tokens.shape[0], MAX_LEN)
    prefill, cache = forward(params, cfg, tokens[:, :P], valid=valid[:, :P], cache=cache)

    def step(cache, tok):
        logits, cache = forward(params, cfg, tok[:, None], valid=jnp.ones_like(tok[:, None], bool), cache=cache)
        return cache, logits[:, 0]

    cache, steps = jax.lax.scan(step, cache, tokens[:, P:].T)
    return prefill, steps, cache


@pytest.mark.parametrize("layout", ["stacked", "unstacked", "split2", "split1-mixed"])
def test_cached_decode_matches_full_forward(model, layout):
    cfg, params, tokens, valid, full = model
    params = layouts(params)[layout]
    prefill, steps, cache = prefill_then_decode(params, cfg, jnp.asarray(tokens, jnp.int32), jnp.asarray(valid))
    pv = valid[:, :P]
    assert_close(np.asarray(prefill)[pv], full[:, :P][pv], f"{layout} prefill")
    for i in range(N):
        assert_close(steps[i], full[:, P + i], f"{layout} decode step {i}")
    assert int(cache["index"]) == P + N
    cache_valid = np.asarray(cache["valid"])
    np.testing.assert_array_equal(cache_valid[:, :P + N], valid)
    assert not cache_valid[:, P + N:].any()
    # the cache mirrors the param layout (per-layer buffers for unrolled segments)
    assert [type(s) for s in cache["layers"]] == [type(s) for s in params["layers"]]


def test_chunked_prefill_and_last_logits(model):
    """Prefill in two chunks (the second one with logits_mode='last') equals the full forward."""
    cfg, params, tokens, valid, full = model
    B, split = tokens.shape[0], P - 2
    cache = init_cache(cfg, params, batch=B, max_len=MAX_LEN)
    first, cache = _forward(params, cfg, jnp.asarray(tokens[:, :split], jnp.int32),
                            valid=jnp.asarray(valid[:, :split]), cache=cache)
    last, cache = _forward(params, cfg, jnp.asarray(tokens[:, split:], jnp.int32),
                           valid=jnp.asarray(valid[:, split:]), cache=cache, logits_mode="last")
    v = valid[:, :split]
    assert_close(np.asarray(first)[v], full[:, :split][v], "first chunk")
    assert last.shape == (B, cfg.vocab_size)
    assert_close(last, full[:, -1], "second chunk, last position")


def test_padding_does_not_change_valid_logits(model):
    """A row's logits do not depend on how much left padding it carries or on the padding's ids."""
    cfg, params, tokens, valid, full = model
    row = 1
    n = int(valid[row].sum())
    alone, _ = _forward(params, cfg, jnp.asarray(tokens[row:row + 1, -n:], jnp.int32))
    assert_close(alone[0], full[row, -n:], "unpadded row")
    noisy = tokens.copy()
    noisy[~valid] = (noisy[~valid] + 7) % cfg.vocab_size
    again, _ = _forward(params, cfg, jnp.asarray(noisy, jnp.int32), valid=jnp.asarray(valid))
    assert_close(np.asarray(again)[valid], full[valid], "other padding ids")


def test_logits_helper(model):
    """``morse_jax.models.logits`` (the jitted no-adapter path) is the full forward; 1-D input is one row."""
    cfg, params, tokens, valid, full = model
    bb = Backbone(config=cfg, params=params, tokenizer=None)
    out = logits(bb, tokens, valid)
    assert out.shape == full.shape and out.dtype == jnp.float32
    assert_close(np.asarray(out)[valid], full[valid], "logits()")
    assert_close(logits(bb, tokens[0])[0], full[0], "logits() of a 1-D row")
