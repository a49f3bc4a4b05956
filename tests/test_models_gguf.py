"""The embedded SmolLM2-135M-Instruct GGUF: our load agrees with transformers' own load of the
same file (logits on a left-padded batch of chat prompts; a 64-token greedy continuation).

transformers' outputs are cached on disk (``ref_cache``, keyed by the GGUF's sha256, library
versions and the exact inputs), so its 20-30 s GGUF load happens once per machine.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

from morse_jax.models import forward, init_cache, load_backbone
from morse_jax.models.chat import encode_chat, stop_token_ids

pytestmark = pytest.mark.gguf

PROMPTS = [
    [{"role": "user", "content": "Write a Python function that returns the n-th Fibonacci number."}],
    [{"role": "system", "content": "You are a concise assistant."},
     {"role": "user", "content": "What is the capital of France?"}],
]
NEW_TOKENS = 64
_forward = jax.jit(forward, static_argnames=("cfg", "logits_mode"))


def ref_key(smollm2_hash, what, tokens):
    return {"gguf": smollm2_hash, "what": what, "tokens": np.asarray(tokens).tolist(),
            "transformers": transformers.__version__, "torch": torch.__version__}


@pytest.fixture(scope="module")
def padded_prompts(smollm2_backbone):
    ids = [encode_chat(smollm2_backbone.tokenizer, m) for m in PROMPTS]
    T = max(map(len, ids))
    tokens = np.zeros((len(ids), T), np.int64)
    valid = np.zeros((len(ids), T), bool)
    for i, row in enumerate(ids):
        tokens[i, T - len(row):] = row
        valid[i, T - len(row):] = True
    assert valid.sum(1).min() < T  # the batch really is padded
    return tokens, valid


def test_embedded_config(smollm2_backbone):
    cfg = smollm2_backbone.config
    assert (cfg.family, cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.vocab_size) == (
        "llama", 30, 576, 9, 3, 49152)
    assert cfg.tie_embeddings and "lm_head" not in smollm2_backbone.params
    assert cfg.rope_full.theta == 100000.0
    tok = smollm2_backbone.tokenizer
    assert tok is not None and tok.chat_template
    assert tok.convert_tokens_to_ids("<|im_end|>") in stop_token_ids(tok, cfg.eos_token_ids)


def test_logits_match_transformers_gguf_load(smollm2_backbone, smollm2_torch, smollm2_hash, ref_cache,
                                             padded_prompts):
    tokens, valid = padded_prompts

    def compute():
        positions = np.maximum(np.cumsum(valid, axis=1) - 1, 0)
        with torch.no_grad():
            out = smollm2_torch()(input_ids=torch.tensor(tokens), attention_mask=torch.tensor(valid.astype(np.int64)),
                                  position_ids=torch.tensor(positions))
        return {"logits": out.logits.float().numpy()}

    ref = ref_cache.get("smollm2_logits", ref_key(smollm2_hash, "padded logits", tokens), compute)["logits"]
    bb = smollm2_backbone
    ours, _ = _forward(bb.params, bb.config, jnp.asarray(tokens, jnp.int32), valid=jnp.asarray(valid))
    ours = np.asarray(ours)[valid]
    ref = ref[valid]
    err, scale = np.abs(ours - ref).max(), np.abs(ref).max()
    assert err <= 1e-4 * scale, f"max diff {err:.3g} vs max |logit| {scale:.3g} ({err / scale:.3g} rel)"
    assert (ours.argmax(-1) == ref.argmax(-1)).all()


@functools.partial(jax.jit, static_argnames=("cfg", "steps"))
def greedy_continue(params, cfg, prompt, *, steps):
    """Greedy decoding through the KV cache: prefill (last-position logits), then ``steps - 1``
    one-token steps under lax.scan. prompt: int32[1, P] -> int32[steps]."""
    cache = init_cache(cfg, params, prompt.shape[0], prompt.shape[1] + steps)
    logits, cache = forward(params, cfg, prompt, cache=cache, logits_mode="last")
    first = jnp.argmax(logits, -1).astype(jnp.int32)

    def step(carry, _):
        tok, cache = carry
        logits, cache = forward(params, cfg, tok[:, None], cache=cache, logits_mode="last")
        nxt = jnp.argmax(logits, -1).astype(jnp.int32)
        return (nxt, cache), nxt

    _, rest = jax.lax.scan(step, (first, cache), None, length=steps - 1)
    return jnp.concatenate([first, rest[:, 0]])


def test_greedy_continuation_matches_transformers_generate(smollm2_backbone, smollm2_torch, smollm2_hash,
                                                           ref_cache):
    bb = smollm2_backbone
    prompt = np.asarray([encode_chat(bb.tokenizer, PROMPTS[0])], np.int64)

    def compute():
        model = smollm2_torch()
        with torch.no_grad():
            out = model.generate(torch.tensor(prompt), attention_mask=torch.ones_like(torch.tensor(prompt)),
                                 do_sample=False, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                                 pad_token_id=bb.tokenizer.eos_token_id)
        return {"tokens": out[0, prompt.shape[1]:].numpy()}

    ref = ref_cache.get("smollm2_greedy", ref_key(smollm2_hash, f"greedy {NEW_TOKENS}", prompt), compute)["tokens"]
    assert ref.shape == (NEW_TOKENS,)
    # min_new_tokens only masks end-of-turn tokens; the prompt asks for code, which does not end
    # within 64 tokens, so the reference is plain greedy decoding.
    assert not set(ref.tolist()) & set(stop_token_ids(bb.tokenizer, bb.config.eos_token_ids))
    ours = np.asarray(greedy_continue(bb.params, bb.config, jnp.asarray(prompt, jnp.int32), steps=NEW_TOKENS))
    first_diff = int(np.argmax(ours != ref)) if (ours != ref).any() else None
    assert first_diff is None, (
        f"first difference at token {first_diff}: ours {bb.tokenizer.decode(ours)!r} vs "
        f"transformers {bb.tokenizer.decode(ref)!r}")
    assert "def" in bb.tokenizer.decode(ours)  # sanity: the model writes code


def test_hf_directory_with_tokenizer_files(smollm2_backbone, tiny_hf_model):
    """A safetensors directory that ships tokenizer files gets its tokenizer and chat template."""
    tok = smollm2_backbone.tokenizer
    path, _ = tiny_hf_model("llama", vocab_size=len(tok), num_hidden_layers=1)
    tok.save_pretrained(path)
    bb = load_backbone(path)
    assert bb.tokenizer is not None
    assert encode_chat(bb.tokenizer, PROMPTS[1]) == encode_chat(tok, PROMPTS[1])


def test_load_on_host_keeps_numpy_arrays(tiny_hf_model):
    """on_device=False (what the job does before sharding over a mesh) leaves every weight a host
    array, with the values a device load gives."""
    path, _ = tiny_hf_model("llama", num_hidden_layers=2)
    host = load_backbone(path, tokenizer=False, on_device=False)
    dev = load_backbone(path, tokenizer=False)
    host_leaves, dev_leaves = jax.tree.leaves(host.params), jax.tree.leaves(dev.params)
    assert all(isinstance(x, np.ndarray) for x in host_leaves)
    assert all(isinstance(x, jax.Array) for x in dev_leaves)
    for a, b in zip(host_leaves, dev_leaves):
        np.testing.assert_array_equal(a, np.asarray(b))


def test_final_assistant_message_is_an_open_answer_prefix(smollm2_backbone):
    """A trailing assistant message renders unclosed after the generation prompt (planner prefix)."""
    tok = smollm2_backbone.tokenizer
    plain = encode_chat(tok, PROMPTS[0])
    prefixed = encode_chat(tok, [*PROMPTS[0], {"role": "assistant", "content": '{"nodes": ['}])
    assert prefixed[:len(plain)] == plain
    assert tok.decode(prefixed[len(plain):]) == '{"nodes": ['
