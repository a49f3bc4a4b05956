"""Restarting at the first adapted layer from the sampler's prefix states.

The layers before the first adapted one are frozen and expert-free, so the residual stream
entering it is the same under any experts: the sampler returns it and the update starts there.
These tests pin that the restart is exact: the model from a captured residual equals the whole
model, the sampler's captured residual equals a full forward's, and the update from states
equals the update that recomputes them.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest
from conftest import assert_same_update

from morse_jax.models import Backbone, ModelConfig, init_params
from morse_jax.models.transformer import forward, split_segments
from morse_jax.mole.experts import ExpertBankSpec, execute_set
from morse_jax.rl.examples import SequenceExample, examples_from_groups
from morse_jax.rl.batch import pad_shared
from morse_jax.rl.update import Trainer, TrainConfig, init_trainable
from morse_jax.sampling.sampler import Request, Sampler, SamplerConfig

LLAMA = ModelConfig(family="llama", vocab_size=32, hidden_size=32, intermediate_size=64, num_layers=4,
                    num_heads=4, num_kv_heads=2, head_dim=8)
GEMMA3 = ModelConfig(family="gemma3", vocab_size=32, hidden_size=32, intermediate_size=48, num_layers=4,
                     num_heads=4, num_kv_heads=1, head_dim=16, activation="gelu_tanh", qk_norm=True, norm_offset=1.0,
                     embed_scale=True, post_norms=True, query_scale=20 ** -0.5, sliding_window=3,
                     tie_embeddings=True,
                     layer_types=("sliding_attention", "full_attention", "sliding_attention", "full_attention"))


def _params(cfg, n_adapt):
    params = init_params(jax.random.key(0), cfg)
    params["lm_head" if "lm_head" in params else "embed"] *= 10.0  # logits that respond to the residual
    return split_segments(params, n_adapt)


def _tokens(B=3, T=11, seed=0):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(1, 32, (B, T)).astype(np.int32)
    valid = np.ones((B, T), bool)
    valid[1, :4] = False  # left padding in one row, right padding in another
    valid[2, -3:] = False
    return tokens, valid


@pytest.mark.parametrize("cfg", [LLAMA, GEMMA3], ids=["llama", "gemma3"])
def test_forward_from_captured_residual_equals_whole_model(cfg):
    params = _params(cfg, 2)
    tokens, valid = _tokens()
    full, _ = forward(params, cfg, tokens, valid=valid)
    resid, _ = forward(params, cfg, tokens, valid=valid, stop_layer=2)
    assert resid.shape == (*tokens.shape, cfg.hidden_size)
    restarted, _ = forward(params, cfg, tokens, valid=valid, start_layer=2, hidden=resid)
    np.testing.assert_allclose(np.asarray(restarted), np.asarray(full), atol=1e-5)
    # the restart really skips the prefix: other states give other logits
    other, _ = forward(params, cfg, tokens, valid=valid, start_layer=2, hidden=resid * 0.5)
    assert np.abs(np.asarray(other) - np.asarray(full)).max() > 1e-2


def test_restart_layer_errors():
    params = _params(LLAMA, 2)
    tokens, valid = _tokens()
    resid, _ = forward(params, LLAMA, tokens, valid=valid, stop_layer=2)
    with pytest.raises(ValueError, match="segment boundary"):  # layers 0..1 are one stacked segment
        forward(params, LLAMA, tokens, valid=valid, start_layer=1, hidden=resid)
    with pytest.raises(ValueError, match="needed exactly when"):
        forward(params, LLAMA, tokens, valid=valid, start_layer=2)
    with pytest.raises(ValueError, match="stop_layer"):
        forward(params, LLAMA, tokens, valid=valid, start_layer=2, hidden=resid, stop_layer=2)


def _sampler_setup(n_adapt=2, **sampler_kw):
    params = init_params(jax.random.key(0), LLAMA)
    params["lm_head"] = params["lm_head"] * 10.0
    bb = Backbone(config=LLAMA, params=params, tokenizer=None)
    spec = ExpertBankSpec(n_adapt=n_adapt, rank=4, alpha=8)
    tcfg = TrainConfig(micro_batch=8, length_buckets=(32,))
    trainable = init_trainable(jax.random.key(3), LLAMA, spec, tcfg)
    trainable["bank"]["b"] = jax.tree.map(lambda x: 0.3 * jax.random.normal(jax.random.key(4), x.shape),
                                          trainable["bank"]["b"])
    cfg = SamplerConfig(batch_buckets=(8,), prompt_buckets=(16,), new_token_buckets=(16,), max_batch=8,
                        return_prefix_states=True, **sampler_kw)
    return bb, spec, trainable, Sampler(bb, spec, cfg)


def _generate(sampler, spec, trainable, n=6):
    reqs = []
    for i in range(n):  # mixed prompt lengths, two routes sharing prompts, per-row expert sets
        prompt = [1, 2, 3, 4, 5, 6, 7][: 3 + 2 * (i % 2)]
        reqs.append(Request(prompt, *zip(*execute_set(spec, [i % 2, 2 + i % 2])), max_new_tokens=10 + i % 3,
                            temperature=1.0))
    return reqs, sampler.generate(trainable["bank"], reqs, key=jax.random.key(5))


def test_sampler_prefix_states_equal_full_forward_residual():
    bb, spec, trainable, sampler = _sampler_setup(prefill_rows=16)  # prompts in several prefill chunks
    reqs, outs = _generate(sampler, spec, trainable)
    params = split_segments(bb.params, spec.n_adapt)
    for r, o in zip(reqs, outs):
        seq = np.asarray([list(r.prompt_ids) + o.token_ids], np.int32)
        want, _ = forward(params, LLAMA, seq, stop_layer=LLAMA.num_layers - spec.n_adapt)
        assert o.prefix_states.shape == (seq.shape[1], LLAMA.hidden_size)
        np.testing.assert_allclose(o.prefix_states, np.asarray(want)[0], atol=1e-5)


@pytest.mark.parametrize("share", [True, False], ids=["shared-prompts", "flat"])
def test_update_from_prefix_states_equals_recomputing_them(share):
    bb, spec, trainable, sampler = _sampler_setup()
    reqs, outs = _generate(sampler, spec, trainable)
    rng = np.random.default_rng(0)
    seqs = [SequenceExample(r.prompt_ids, o.token_ids, o.logprobs, r.expert_ids, r.expert_weights,
                            float(rng.normal()), o.prefix_states) for r, o in zip(reqs, outs)]
    results = []
    for reuse in (True, False):
        tcfg = TrainConfig(micro_batch=8, length_buckets=(32,), share_prompts=share, reuse_prefix_states=reuse)
        trainer = Trainer(LLAMA, bb.params, spec, tcfg)
        assert trainer.use_states(seqs) == reuse
        lps = trainer.logprobs(trainable["bank"], seqs)
        for o, lp in zip(outs, lps):  # the trainer re-scores what the sampler generated
            np.testing.assert_allclose(lp, o.logprobs, atol=1e-4)
        params = jax.tree.map(np.array, trainable)  # update donates its input
        new, _, m = trainer.update(params, trainer.init_opt_state(params), seqs, [], num_groups=2)
        results.append((lps, new, m))
    assert_same_update(*results)


def test_prefix_state_config_errors():
    with pytest.raises(ValueError, match="decode_path"):
        SamplerConfig(return_prefix_states=True, decode_path="model")
    params = init_params(jax.random.key(0), LLAMA)
    bb = Backbone(config=LLAMA, params=params, tokenizer=None)
    with pytest.raises(ValueError, match="frozen prefix"):
        Sampler(bb, None, SamplerConfig(return_prefix_states=True))
    with pytest.raises(ValueError, match="frozen prefix"):  # every layer adapted: nothing to skip
        Sampler(bb, ExpertBankSpec(n_adapt=LLAMA.num_layers), SamplerConfig(return_prefix_states=True))
    bad = SequenceExample([1, 2], [3], np.zeros(1, np.float32), (), (), 1.0, np.zeros((2, 32), np.float32))
    with pytest.raises(ValueError, match=r"prefix_states must be \[3, d\]"):
        pad_shared([bad], rows=2, buckets=(8,), max_active=1, with_states=True)


def test_examples_carry_candidate_prefix_states():
    @dataclasses.dataclass
    class Cand:
        prompt_ids: list
        token_ids: list
        logprobs: np.ndarray
        expert_ids: tuple
        expert_weights: tuple
        prefix_states: np.ndarray

    @dataclasses.dataclass
    class Group:
        rewards: np.ndarray
        candidates: list
        routes: list = dataclasses.field(default_factory=list)

    states = [np.full((3, 4), float(i), np.float32) for i in range(2)]
    g = Group(np.array([[0.0, 1.0]], np.float32),
              [[Cand([1, 2], [3], np.zeros(1, np.float32), (0,), (1.0,), s) for s in states]])
    seqs, _, _ = examples_from_groups([g])
    assert [float(e.prefix_states[0, 0]) for e in seqs] == [0.0, 1.0]
