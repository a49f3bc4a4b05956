"""Tiny model, expert bank, requests and training examples shared by the parallel test scripts.

Imported by ``parallel_equivalence.py`` and ``parallel_two_process_step.py`` after they have set
XLA_FLAGS / JAX_PLATFORMS (this module imports jax).
"""

from __future__ import annotations

import jax
import numpy as np

from morse_jax.models import Backbone, ModelConfig, init_params
from morse_jax.mole.experts import ExpertBankSpec
from morse_jax.rl.examples import RouteExample, SequenceExample
from morse_jax.rl.update import TrainConfig, init_trainable
from morse_jax.sampling.sampler import Request, SamplerConfig

# Every sharded dimension divides 8 (vocab, hidden, MLP, heads), so each mesh really splits.
CFG = ModelConfig(family="llama", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                  num_kv_heads=2, head_dim=8)
SPEC = ExpertBankSpec(num_subtask=4, rank=4, alpha=6.0, n_adapt=1)
SAMPLER = SamplerConfig(batch_buckets=(4, 8), prompt_buckets=(16,), new_token_buckets=(8,), max_batch=8, max_active=3,
                        prefill_rows=32, return_prefix_states=True)
TRAIN = TrainConfig(micro_batch=8, length_buckets=(16,), route_buckets=(8,), lora_lr=1e-2, router_lr=1e-2,
                    max_active=3)


def backbone() -> Backbone:
    # Weights at 10x the init scale: peaked logits, so a wrong mask or shard changes the argmax.
    params = jax.jit(lambda k: jax.tree_util.tree_map_with_path(
        lambda p, x: x if "norm" in jax.tree_util.keystr(p) else 10.0 * x, init_params(k, CFG)))(jax.random.key(0))
    return Backbone(CFG, params, None)


def trainable0():
    t = init_trainable(jax.random.key(1), CFG, SPEC, TRAIN)
    # Non-zero B: every expert changes the model, so gradients reach A as well as B.
    t["bank"]["b"] = jax.tree.map(lambda x: 0.3 * jax.random.normal(jax.random.key(2), x.shape), t["bank"]["b"])
    return jax.tree.map(np.asarray, t)


def requests(n: int):
    rng = np.random.default_rng(0)
    return [Request(rng.integers(0, 64, 2 + i).tolist(), [i % 6, (i + 1) % 6], [0.5, 0.5], max_new_tokens=8,
                    temperature=0.0) for i in range(n)]


def with_prefix_states(bb: Backbone, seqs):
    """The examples with the residual stream entering the adapted layer (what the sampler returns)."""
    import dataclasses

    from morse_jax.models.transformer import forward, split_segments

    params = split_segments(bb.params, SPEC.n_adapt)
    out = []
    for e in seqs:
        tokens = np.asarray([list(e.prompt_ids) + list(e.completion_ids)], np.int32)
        states = forward(params, CFG, tokens, stop_layer=CFG.num_layers - SPEC.n_adapt)[0]
        out.append(dataclasses.replace(e, prefix_states=np.asarray(states)[0]))
    return out


def examples():
    rng = np.random.default_rng(1)
    seqs = [SequenceExample(rng.integers(0, 64, 3 + i % 4).tolist(), rng.integers(0, 64, 5).tolist(),
                            (-rng.random(5)).astype(np.float32), [i % 2, 2 + i % 4], [0.5, 0.5], float(rng.normal()))
            for i in range(12)]  # 12 rows: one full micro-batch of 8 and one padded one
    routes = [RouteExample(rng.integers(0, 64, 6).tolist(), (i % 4, (i + 1) % 4), -1.0, float(rng.normal()))
              for i in range(5)]
    return seqs, routes
