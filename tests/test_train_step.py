"""The HGRPO update: trainer log-probs match the sampler's, and training raises a synthetic reward."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_same_update

from morse_jax.models import Backbone, ModelConfig, init_params
from morse_jax.mole import router as rt
from morse_jax.mole.experts import ExpertBankSpec, execute_set, single_set
from morse_jax.rl.examples import examples_from_groups
from morse_jax.rl.update import Trainer, TrainConfig, init_trainable
from morse_jax.sampling.sampler import Request, Sampler, SamplerConfig

CFG = ModelConfig(family="llama", vocab_size=32, hidden_size=32, intermediate_size=64, num_layers=3,
                  num_heads=4, num_kv_heads=2, head_dim=8)
TARGET = np.arange(8)  # reward = fraction of generated tokens in this set


@dataclasses.dataclass
class Cand:
    prompt_ids: list
    token_ids: list
    logprobs: np.ndarray
    expert_ids: list
    expert_weights: list


@dataclasses.dataclass
class Group:
    rewards: np.ndarray
    candidates: list
    routes: list
    route_set_logp_old: np.ndarray
    description: str
    node_id: str = "n"


def _backbone():
    params = init_params(jax.random.key(0), CFG)
    # init_params draws everything at std 0.02, which makes the logits nearly flat and insensitive
    # to the hidden state; a unit-scale head gives the experts something to steer, like a real LM.
    params["lm_head"] = params["lm_head"] * 10.0
    return Backbone(config=CFG, params=params, tokenizer=None)


def _rollout(sampler, trainable, spec, key, *, B, M, variant, n_prompts=2, new_tokens=8):
    """One synthetic node per prompt: B routes x M candidates (variant D) or B*M candidates of one
    fixed expert (variant B)."""
    groups, all_r = [], []
    for p in range(n_prompts):
        key, k_route, k_gen = jax.random.split(key, 3)
        prompt = [1 + p, 9, 10, 11]
        desc_ids = np.array([prompt + [0] * 4], np.int32)
        desc_mask = np.array([[True] * 4 + [False] * 4])
        if variant == "D":
            emb = rt.subtask_embedding(sampler.backbone.params["embed"], desc_ids, desc_mask)
            probs = rt.router_probs(trainable["router"], emb)
            keys = jax.random.split(k_route, B)
            members = np.stack([np.asarray(rt.sample_route(k, probs, 2))[0] for k in keys])
            set_logp = np.asarray(rt.set_log_prob(jnp.repeat(probs, B, 0), jnp.asarray(members)))
            sets = [execute_set(spec, m) for m in members]
        else:
            members, set_logp, sets = [()], np.zeros(1), [single_set(spec)]
        reqs = []
        per_route = M if variant == "D" else B * M
        for s in sets:
            for _ in range(per_route):
                reqs.append(Request(prompt, [e for e, _ in s], [w for _, w in s], max_new_tokens=new_tokens,
                                    temperature=1.0))
        outs = sampler.generate(trainable["bank"], reqs, key=k_gen)
        rewards = np.array([np.isin(o.token_ids, TARGET).mean() for o in outs], np.float32)
        all_r.append(rewards)
        rows = len(sets)
        cands = [[Cand(prompt, o.token_ids, o.logprobs, list(r.expert_ids), list(r.expert_weights))
                  for o, r in zip(outs[b * per_route:(b + 1) * per_route], reqs[b * per_route:(b + 1) * per_route])]
                 for b in range(rows)]
        routes = [tuple(int(x) for x in m) for m in members] if variant == "D" else [()]
        groups.append(Group(rewards.reshape(rows, per_route), cands, routes, set_logp,
                            description=" ".join(map(str, prompt))))
    return groups, float(np.mean(all_r)), key


def _desc_ids(desc):
    return [int(x) for x in desc.split()]


def _train(variant, steps, lr):
    bb = _backbone()
    if variant == "D":
        spec = ExpertBankSpec(n_adapt=2, rank=8, alpha=16)
    else:
        spec = ExpertBankSpec(role_names=("single",), num_subtask=0, n_adapt=2, rank=24, alpha=48)
    tcfg = TrainConfig(lora_lr=lr, router_lr=lr, micro_batch=16, length_buckets=(16,), max_grad_norm=None)
    trainer = Trainer(CFG, bb.params, spec, tcfg)
    trainable = init_trainable(jax.random.key(1), CFG, spec, tcfg)
    opt = trainer.init_opt_state(trainable)
    sampler = Sampler(bb, spec, SamplerConfig(batch_buckets=(16, 32), prompt_buckets=(8,), new_token_buckets=(8,),
                                              max_batch=32))
    key = jax.random.key(2)
    curve = []
    adv = "hgrpo" if variant == "D" else "grpo"
    for _ in range(steps):
        groups, mean_r, key = _rollout(sampler, trainable, spec, key, B=4, M=4, variant=variant)
        curve.append(mean_r)
        seqs, routes, _ = examples_from_groups(groups, advantage=adv, description_ids=_desc_ids)
        trainable, opt, metrics = trainer.update(trainable, opt, seqs, routes, num_groups=len(groups))
    return curve, metrics, trainer


@pytest.mark.parametrize("variant", ["D", "B"])
def test_training_raises_synthetic_reward(variant):
    curve, metrics, trainer = _train(variant, steps=10, lr=3e-2)
    first, last = np.mean(curve[:2]), np.mean(curve[-2:])
    assert last > first + 0.15, f"reward did not rise: {np.round(curve, 3)}"
    assert metrics["skipped_update"] == 0.0
    # the sampler's behaviour log-probs and the trainer's recomputation agree (same experts)
    assert metrics["logp_gap_max"] < 1e-4
    assert trainer.compile_count <= 4


def test_trainer_logprobs_equal_sampler_logprobs():
    bb = _backbone()
    spec = ExpertBankSpec(n_adapt=2)
    tcfg = TrainConfig(micro_batch=8, length_buckets=(32,))
    trainable = init_trainable(jax.random.key(3), CFG, spec, tcfg)
    trainable["bank"]["b"] = jax.tree.map(lambda x: 0.3 * jax.random.normal(jax.random.key(4), x.shape),
                                          trainable["bank"]["b"])
    sampler = Sampler(bb, spec, SamplerConfig(batch_buckets=(8,), prompt_buckets=(16,), new_token_buckets=(16,),
                                              max_batch=8))
    reqs = [Request([1, 2, 3, 4, 5][: 2 + i % 4], *zip(*execute_set(spec, [i % 4, (i + 1) % 4])),
                    max_new_tokens=12, temperature=1.0) for i in range(6)]
    outs = sampler.generate(trainable["bank"], reqs, key=jax.random.key(5))
    from morse_jax.rl.examples import SequenceExample
    seqs = [SequenceExample(r.prompt_ids, o.token_ids, o.logprobs, r.expert_ids, r.expert_weights, 1.0)
            for r, o in zip(reqs, outs)]
    trainer = Trainer(CFG, bb.params, spec, tcfg)
    for o, lp in zip(outs, trainer.logprobs(trainable["bank"], seqs)):
        np.testing.assert_allclose(lp, o.logprobs, atol=1e-4)


def test_update_touches_only_trainable_and_skips_constant_groups():
    bb = _backbone()
    spec = ExpertBankSpec(n_adapt=2)
    tcfg = TrainConfig(micro_batch=4, length_buckets=(16,))
    trainer = Trainer(CFG, bb.params, spec, tcfg)
    trainable = init_trainable(jax.random.key(1), CFG, spec, tcfg)
    opt = trainer.init_opt_state(trainable)
    cand = Cand([1, 2], [3, 4], np.zeros(2, np.float32), [0, 2], [0.5, 0.5])
    g = Group(np.ones((2, 2), np.float32), [[cand, cand], [cand, cand]], [(0, 1), (1, 2)], np.zeros(2), "1 2")
    seqs, routes, stats = examples_from_groups([g], advantage="hgrpo", description_ids=_desc_ids)
    assert not seqs and stats.skipped_within == 1.0 and stats.skipped_cross == 1.0
    assert [r.advantage for r in routes] == [0.0, 0.0]  # kept for the regularisers, no signal
    before = jax.tree.map(np.asarray, trainable)
    trainable, opt, metrics = trainer.update(trainable, opt, seqs, routes, num_groups=1)
    assert metrics["skipped_update"] == 1.0
    jax.tree.map(np.testing.assert_array_equal, before, jax.tree.map(np.asarray, trainable))


def test_nan_rewards_raise():
    cand = Cand([1], [2], np.zeros(1, np.float32), [0], [1.0])
    g = Group(np.array([[np.nan, 1.0]], np.float32), [[cand, cand]], [()], np.zeros(1), "1")
    with pytest.raises(ValueError, match="NaN|nan|finite"):
        examples_from_groups([g], advantage="grpo")


def test_shared_prompt_update_equals_unshared():
    """share_prompts runs a prompt once per (prompt, active set) and continues every candidate
    from its KV cache; the update must equal running each candidate's whole sequence."""
    from morse_jax.rl.examples import SequenceExample

    bb = _backbone()
    spec = ExpertBankSpec(n_adapt=2)
    rng = np.random.default_rng(0)
    seqs = []
    for g in range(2):  # two routes x four candidates, each route its own prompt and expert set
        prompt = rng.integers(1, CFG.vocab_size, 6 + g).tolist()
        ids, ws = zip(*execute_set(spec, [g, g + 1]))
        for m in range(4):
            seqs.append(SequenceExample(prompt, rng.integers(1, CFG.vocab_size, 5 + m).tolist(),
                                        (-rng.random(5 + m)).astype(np.float32), ids, ws, float(rng.normal())))
    results = []
    for share in (True, False):
        tcfg = TrainConfig(micro_batch=8, length_buckets=(32,), share_prompts=share)
        trainable = init_trainable(jax.random.key(3), CFG, spec, tcfg)
        trainable["bank"]["b"] = jax.tree.map(lambda x: 0.3 * jax.random.normal(jax.random.key(4), x.shape),
                                              trainable["bank"]["b"])
        trainer = Trainer(CFG, bb.params, spec, tcfg)
        lps = trainer.logprobs(trainable["bank"], seqs)  # before the update: it donates the trainable
        new, _, m = trainer.update(trainable, trainer.init_opt_state(trainable), seqs, [], num_groups=2)
        results.append((lps, new, m))
    assert_same_update(*results)
