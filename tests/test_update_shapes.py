"""One padded shape per update (``Trainer.update_shape``) and few compiles across updates.

Padding to a larger shape than the examples' own (more prompt rows, longer prompts and
completions, more LM-head positions) must not change the loss or the gradient; two updates whose
raw sizes differ but fall in one bucket, and the router's REINFORCE (first step) and PPO forms,
must reuse the compiled programs.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest

from morse_jax.models import ModelConfig, init_params
from morse_jax.models.transformer import split_segments
from morse_jax.mole.experts import ExpertBankSpec, execute_set
from morse_jax.rl.batch import pad_sequences, pad_shared, sequence_shape, shared_shape
from morse_jax.rl.examples import RouteExample, SequenceExample
from morse_jax.rl.update import Trainer, TrainConfig, init_trainable, make_train_step

CFG = ModelConfig(family="llama", vocab_size=32, hidden_size=32, intermediate_size=64, num_layers=3,
                  num_heads=4, num_kv_heads=2, head_dim=8)
SPEC = ExpertBankSpec(n_adapt=2)
BUCKETS = (8, 12, 16, 24, 32)
TCFG = TrainConfig(lora_lr=0.05, router_lr=0.05, micro_batch=4, length_buckets=(16, 32, 64), router_dim=8,
                   completion_buckets=BUCKETS)
START = CFG.num_layers - SPEC.n_adapt


def _params():
    params = init_params(jax.random.key(0), CFG)
    params["lm_head"] = params["lm_head"] * 10.0  # logits that depend on the hidden state
    return params


def _trainable():
    t = init_trainable(jax.random.key(1), CFG, SPEC, TCFG)
    t["bank"]["b"] = jax.tree.map(lambda x: 0.1 * jax.random.normal(jax.random.key(2), x.shape), t["bank"]["b"])
    return t


def _examples(rng, prompts: int, per_prompt: int, prompt_len: int, completion_len: int):
    """``prompts`` (prompt, active set) groups of ``per_prompt`` candidates each, lengths up to
    the given ones (the first candidate of the first group has exactly them)."""
    out = []
    for g in range(prompts):
        p_len = prompt_len if g == 0 else int(rng.integers(2, prompt_len + 1))
        prompt = rng.integers(1, 32, p_len).tolist()
        ids, ws = zip(*execute_set(SPEC, [g % 4, (g + 1) % 4]))
        for m in range(per_prompt):
            c = completion_len if g == m == 0 else int(rng.integers(1, completion_len + 1))
            out.append(SequenceExample(prompt, rng.integers(1, 32, c).tolist(),
                                       (-1.0 - rng.random(c)).astype(np.float32), ids, ws, float(rng.normal())))
    return out


@pytest.fixture(scope="module")
def frozen():
    return split_segments(_params(), SPEC.n_adapt)


@pytest.mark.parametrize("layout", ["shared", "flat"])
def test_padding_to_a_larger_shape_keeps_loss_and_gradient(frozen, layout):
    rng = np.random.default_rng(0)
    seqs = _examples(rng, prompts=1, per_prompt=3, prompt_len=5, completion_len=7)
    step = make_train_step(CFG, SPEC, TCFG, start_layer=START)
    trainable = _trainable()
    if layout == "shared":
        own = shared_shape(seqs, buckets=BUCKETS)
        assert own == (1, 8, 8)
        batches = [pad_shared(seqs, rows=4, buckets=BUCKETS, max_active=TCFG.max_active, shape=shape)
                   for shape in (None, (4, 24, 16))]
        assert batches[1].prompt_tokens.shape == (4, 24) and batches[1].tokens.shape == (4, 16)
    else:
        own = sequence_shape(seqs, length_buckets=TCFG.length_buckets, completion_buckets=BUCKETS)
        assert own == (16, 8)
        batches = [pad_sequences(seqs, rows=4, length_buckets=TCFG.length_buckets, max_active=TCFG.max_active,
                                 completion_buckets=BUCKETS, shape=shape) for shape in (None, (32, 16))]
        assert batches[1].tokens.shape == (4, 32) and batches[1].logit_index.shape == (4, 16)
    (g0, m0), (g1, m1) = (step.lora(trainable, frozen, b) for b in batches)
    for k in ("lora_loss", "token_nll", "tokens", "ratio_mean", "logp_gap_mean"):
        np.testing.assert_allclose(float(m1[k]), float(m0[k]), rtol=1e-5, atol=1e-6, err_msg=k)
    for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g0)):
        scale = float(np.abs(np.asarray(b)).max()) or 1.0
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5 * scale, rtol=1e-4)
    assert any(np.abs(np.asarray(x)).max() > 0 for x in jax.tree.leaves(g0))
    with pytest.raises(ValueError, match="does not fit"):  # smaller than the examples need
        if layout == "shared":
            pad_shared(seqs, rows=4, buckets=BUCKETS, max_active=TCFG.max_active, shape=(1, 4, 8))
        else:
            pad_sequences(seqs, rows=4, length_buckets=TCFG.length_buckets, max_active=TCFG.max_active,
                          completion_buckets=BUCKETS, shape=(16, 4))


def test_micro_batches_of_an_update_share_one_shape():
    trainer = Trainer(CFG, _params(), SPEC, TCFG)
    rng = np.random.default_rng(1)
    # groups of 2 candidates: the first micro-batch holds 2 prompts, the last 1; lengths differ
    seqs = _examples(rng, prompts=3, per_prompt=2, prompt_len=13, completion_len=20)
    batch = trainer.batch(seqs, [], num_groups=1)
    assert len(batch.sequences) == 2
    shapes = {(b.prompt_tokens.shape, b.tokens.shape) for b in batch.sequences}
    assert shapes == {((2, 16), (4, 24))}


def test_updates_of_different_raw_sizes_in_one_bucket_compile_once():
    """Step 1 (REINFORCE router form) and step 2 (PPO form) with different numbers of candidates,
    distinct prompts per micro-batch, prompt and completion lengths, all inside one bucket: the
    second update compiles nothing."""
    trainer = Trainer(CFG, _params(), SPEC, TCFG)
    trainable = _trainable()
    opt = trainer.init_opt_state(trainable)
    rng = np.random.default_rng(2)
    # 6 then 8 candidates (2 micro-batches each: 2 + 1, then 2 + 2 prompts), longest prompt 13
    # then 16 (bucket 16), longest completion 17 then 24 (bucket 24), 3 then 5 routes (bucket 8)
    updates = [(_examples(rng, prompts=3, per_prompt=2, prompt_len=13, completion_len=17), 3, True),
               (_examples(rng, prompts=4, per_prompt=2, prompt_len=16, completion_len=24), 5, False)]
    counts = []
    for seqs, n_routes, reinforce in updates:
        routes = [RouteExample([5, 6, 7][:1 + r % 3], (r % 4, (r + 1) % 4), -1.5, 0.3 * (-1) ** r)
                  for r in range(n_routes)]
        trainable, opt, m = trainer.update(trainable, opt, seqs, routes, num_groups=2, reinforce=reinforce)
        assert m["skipped_update"] == 0.0 and np.isfinite(m["lora_loss"])
        counts.append(trainer.compile_count)
    assert counts[0] == counts[1], trainer.train_step.traces
