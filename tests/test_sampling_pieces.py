"""The sampler's pure pieces on their own: request packing, the decode loop's state and finish
rules, stop strings and completions. References follow the definitions (docstrings of
``sampling.requests``, ``sampling.state`` and ``sampling.finish``), not the code."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from morse_jax.sampling.finish import completions, cut_text, find_stop, healed_logprob, mark_stop_strings
from morse_jax.sampling.requests import MAX_STOP_IDS, Request, SamplerConfig, batch_shape, pack_requests
from morse_jax.sampling.state import (REASON_EOS, REASON_LENGTH, DecodeSettings, PrefillOutput, SamplingState,
                                      initial_state, record_tokens)


class CharTokenizer:
    """id i decodes to chr(ord('a') + i)."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(ord("a") + int(i)) for i in ids)


def test_batch_shape_buckets_and_aligns_prompts_to_the_chunk_grid():
    cfg = SamplerConfig(batch_buckets=(2, 4), prompt_buckets=(16, 32), new_token_buckets=(8, 16), max_batch=4,
                        prefill_rows=16)
    reqs = [Request([1] * 5, max_new_tokens=3), Request([1] * 17, max_new_tokens=9), Request([2], max_new_tokens=1)]
    s = batch_shape(reqs, cfg)
    # 3 rows -> bucket 4; longest prompt 17 -> bucket 32; 16 rows / 4 = chunks of 4; 17 -> 20
    assert (s.rows, s.prompt, s.chunk, s.prompt_end, s.new_tokens) == (4, 32, 4, 20, 16)
    assert s.cache_len == 48 and s.prefill_chunks == 5
    with pytest.raises(ValueError, match="batch=5 exceeds the largest bucket"):
        batch_shape([Request([1])] * 5, cfg)


def test_pack_requests_left_pads_prompts_and_marks_padding_rows_done():
    cfg = SamplerConfig(batch_buckets=(4,), prompt_buckets=(8,), new_token_buckets=(4,), max_batch=4, max_active=2,
                        prefill_rows=32)
    reqs = [Request([5, 6, 7], expert_ids=[3], expert_weights=[0.5], temperature=0.0, top_k=2, top_p=0.5,
                    max_new_tokens=2, stop_token_ids=[9, 10]),
            Request([8], max_new_tokens=4)]
    shape = batch_shape(reqs, cfg)
    prompts, experts, settings, done = pack_requests(reqs, shape, cfg.max_active)
    assert shape.prompt_end == 8  # chunk 8: the whole bucket
    np.testing.assert_array_equal(prompts.tokens[0], [0, 0, 0, 0, 0, 5, 6, 7])
    np.testing.assert_array_equal(prompts.valid[1], [False] * 7 + [True])
    assert not prompts.valid[2:].any()
    np.testing.assert_array_equal(experts.ids, [[3, 0], [0, 0], [0, 0], [0, 0]])
    np.testing.assert_array_equal(experts.weights[0], [0.5, 0.0])
    np.testing.assert_array_equal(settings.temperature, [0.0, 1.0, 0.0, 0.0])
    np.testing.assert_array_equal(settings.top_k, [2, 0, 0, 0])
    np.testing.assert_array_equal(settings.max_new, [2, 4, 1, 1])
    assert settings.stop_ids.shape == (4, MAX_STOP_IDS)
    np.testing.assert_array_equal(settings.stop_ids[0, :3], [9, 10, -1])
    np.testing.assert_array_equal(done, [False, False, True, True])


def _state(done, n_gen=(0, 0, 0), step=0, N=4):
    B = len(done)
    pre = PrefillOutput(logits=jnp.zeros((B, 5)), cache={"k": jnp.zeros((B, 2))}, pos=jnp.full(B, 3, jnp.int32))
    s = initial_state(jax.random.key(0), pre, np.asarray(done), N)
    return s.replace(n_gen=jnp.asarray(n_gen, jnp.int32), step=jnp.int32(step))


def test_initial_state_is_empty_and_optionally_captures():
    s = _state([False, True, False])
    assert isinstance(s, SamplingState) and s.states is None
    assert s.tokens.shape == (3, 4) and s.logps.dtype == jnp.float32 and int(s.step) == 0
    np.testing.assert_array_equal(s.done, [False, True, False])
    pre = PrefillOutput(logits=jnp.zeros((2, 5)), cache={}, pos=jnp.zeros(2, jnp.int32))
    c = initial_state(jax.random.key(0), pre, np.zeros(2, bool), 4, hidden_size=6, states_dtype=jnp.bfloat16)
    assert c.states.shape == (2, 4, 6) and c.states.dtype == jnp.bfloat16


def test_record_tokens_finish_rules():
    # rows: 0 draws a stop id, 1 reaches its budget, 2 was already done, 3 keeps going
    s = _state([False, False, True, False], n_gen=(1, 1, 2, 1), step=1)  # tokens go to column n_gen
    settings = DecodeSettings(temperature=jnp.ones(4), top_k=jnp.zeros(4, jnp.int32), top_p=jnp.ones(4),
                              max_new=jnp.array([4, 2, 4, 4], jnp.int32),
                              stop_ids=jnp.array([[7, -1], [7, -1], [7, -1], [7, -1]], jnp.int32))
    key = jax.random.key(5)
    tok = jnp.array([7, 3, 7, 2], jnp.int32)
    lp = jnp.array([-0.5, -1.0, -2.0, -3.0], jnp.float32)
    out, active = record_tokens(s, key, tok, lp, settings)
    np.testing.assert_array_equal(active, [True, True, False, True])
    np.testing.assert_array_equal(out.tokens[:, 1], [7, 3, 0, 2])  # a done row records 0
    np.testing.assert_array_equal(out.logps[:, 1], [-0.5, -1.0, 0.0, -3.0])
    np.testing.assert_array_equal(out.n_gen, [2, 2, 2, 2])
    np.testing.assert_array_equal(out.reason, [REASON_EOS, REASON_LENGTH, 0, 0])
    np.testing.assert_array_equal(out.done, [True, True, True, False])
    assert int(out.step) == 1 and out.key is key  # the step counter belongs to the loop body


def test_stop_strings_and_completions():
    tok = CharTokenizer()
    reqs = [Request([0], stop_strings=["cd"]), Request([0, 1]), Request([0], stop_strings=["zz"])]
    tokens = np.array([[0, 1, 2, 3, 4], [3, 4, 5, 0, 0], [1, 1, 0, 0, 0]], np.int32)  # "abcde", "def", "bb"
    n_gen = np.array([5, 3, 2])
    stop_at = np.full(3, -1)
    assert find_stop(tok, [0, 1, 2, 3, 4], ["cd"]) == 4  # "abcd" is the shortest prefix holding "cd"
    assert cut_text("abcde", ["de", "cd"]) == "ab"
    assert mark_stop_strings(tok, reqs, tokens, n_gen, stop_at) == [0]
    assert mark_stop_strings(tok, reqs, tokens, n_gen, stop_at) == []  # marked once
    np.testing.assert_array_equal(stop_at, [4, -1, -1])
    logps = -np.arange(15, dtype=np.float32).reshape(3, 5)
    first = np.zeros((3, 26), np.float32)
    first[2, 1] = 2.0
    heal = ("b", np.ones(26, bool))
    out = completions(reqs, tok, tokens=tokens, logps=logps, n_gen=n_gen, reason=np.array([0, REASON_EOS, 0]),
                      stop_at=stop_at, heals=[None, None, heal], first_logits=first, prompt_end=2)
    assert [(c.token_ids, c.text, c.finish_reason, c.prompt_len) for c in out] == [
        ([0, 1, 2, 3], "ab", "stop", 1), ([3, 4, 5], "def", "eos", 2), ([1, 1], "b", "length", 1)]
    assert out[2].healed_text == "b"
    # the healed first token's log-prob is its unconstrained log-softmax; the rest are the loop's
    expected = 2.0 - np.log(np.exp(2.0) + 25.0)
    assert out[2].logprobs[0] == pytest.approx(expected) == pytest.approx(healed_logprob(first[2], 1))
    assert out[2].logprobs[1] == logps[2, 1]
