"""The HGRPO update against the paper (issue 14): merge rows, regularisers, the router's Eq. 8
gradient, per-tree clipping, PPO passes, and the job's train config.

The trainers are module fixtures: each jitted update compiles once per Trainer, and compiles
dominate small tests on CPU.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from morse_jax.models import ModelConfig, init_params
from morse_jax.models.transformer import split_segments
from morse_jax.mole.experts import ExpertBankSpec, execute_set, merge_set
from morse_jax.rl.examples import RouteExample, SequenceExample, examples_from_groups
from morse_jax.rl.batch import pad_routes, pad_sequences
from morse_jax.rl.logprobs import sequence_logprobs
from morse_jax.rl.update import Trainer, TrainConfig, init_trainable, make_optimizer, route_gradients

CFG = ModelConfig(family="llama", vocab_size=32, hidden_size=32, intermediate_size=64, num_layers=3,
                  num_heads=4, num_kv_heads=2, head_dim=8)
SPEC = ExpertBankSpec(n_adapt=2)  # roles execute (0), merge (1); subtask experts 2..5
TCFG = TrainConfig(lora_lr=0.05, router_lr=0.05, weight_decay=0.0, micro_batch=8, length_buckets=(16,),
                   router_dim=8)


@dataclasses.dataclass
class Cand:
    prompt_ids: list
    token_ids: list
    logprobs: np.ndarray
    expert_ids: tuple
    expert_weights: tuple


@dataclasses.dataclass
class Group:
    rewards: np.ndarray
    candidates: list
    routes: list
    route_set_logp_old: np.ndarray
    description: str
    role: str = "execute"
    node_id: str = "n"


def _params():
    params = init_params(jax.random.key(0), CFG)
    params["lm_head"] = params["lm_head"] * 10.0  # logits that depend on the hidden state
    return params


@pytest.fixture(scope="module")
def trainer():
    return Trainer(CFG, _params(), SPEC, TCFG)


def _trainable(seed=1):
    t = init_trainable(jax.random.key(seed), CFG, SPEC, TCFG)
    # non-zero B: every expert's A then gets gradient from the rows that use it
    t["bank"]["b"] = jax.tree.map(lambda x: 0.1 * jax.random.normal(jax.random.key(seed + 1), x.shape),
                                  t["bank"]["b"])
    return t


def _host(tree):
    return jax.tree.map(np.asarray, tree)


def _expert_rows(bank, e):
    return np.concatenate([np.ravel(x[e]) for x in jax.tree.leaves(bank)])


def _desc_ids(desc):
    return [int(x) for x in desc.split()]


# ------------------------------------------------------------------------------- merge rows


def _merge_group(rewards):
    """One merge node: 2 routes x 2 candidates, active set = merge expert + inherited {0, 2}."""
    ids, ws = zip(*merge_set(SPEC, [[0], [2]]))
    assert ids == (1, 2, 4)  # merge role expert, subtask experts 0 and 2
    rng = np.random.default_rng(0)
    cands = [[Cand([1, 2, 3], rng.integers(1, 32, 4).tolist(), np.full(4, -3.0, np.float32), ids, ws)
              for _ in range(2)] for _ in range(2)]
    return Group(np.asarray(rewards, np.float32), cands, [], np.zeros(0), "1 2 3", role="merge")


def test_merge_rows_train_only_the_merge_expert(trainer):
    """Alg. 1: a merge node's A_within updates only the merge role expert; the inherited subtask
    experts act in the forward pass but get no gradient (weight decay 0, fresh AdamW: an expert
    without gradient does not move). merge_trains_subtask_experts=True is the authors' code."""
    g = _merge_group([[1.0, 0.0], [0.0, 1.0]])
    seqs, routes, _ = examples_from_groups([g], num_roles=SPEC.num_roles)
    assert len(seqs) == 4 and not routes
    assert all(tuple(e.expert_trainable) == (True, False, False) for e in seqs)
    before = _host(_trainable())
    new, _, m = trainer.update(_trainable(), trainer.init_opt_state(_trainable()), seqs, routes, num_groups=1)
    new = _host(new)
    assert m["skipped_update"] == 0.0
    assert not np.array_equal(_expert_rows(new["bank"], 1), _expert_rows(before["bank"], 1))  # merge expert
    for e in (0, 2, 3, 4, 5):  # execute expert (unused), inherited 2 and 4, unused 3 and 5
        np.testing.assert_array_equal(_expert_rows(new["bank"], e), _expert_rows(before["bank"], e), err_msg=str(e))

    seqs, _, _ = examples_from_groups([g], num_roles=SPEC.num_roles, merge_trains_subtask_experts=True)
    assert all(e.expert_trainable is None for e in seqs)
    new, _, _ = trainer.update(_trainable(), trainer.init_opt_state(_trainable()), seqs, [], num_groups=1)
    new = _host(new)
    for e in (1, 2, 4):
        assert not np.array_equal(_expert_rows(new["bank"], e), _expert_rows(before["bank"], e)), e
    with pytest.raises(ValueError, match="num_roles"):
        examples_from_groups([g])


@pytest.mark.parametrize("shared", [False, True])
def test_frozen_slots_same_forward_no_gradient_in_both_compose_modes(shared):
    """A non-trainable slot changes nothing in the forward pass and receives no gradient from its
    row; gather and onehot composition agree (flat and prompt-sharing batches)."""
    from morse_jax.rl.batch import pad_shared

    frozen = split_segments(_params(), SPEC.n_adapt)
    bank = _trainable()["bank"]
    merge_ids, merge_ws = zip(*merge_set(SPEC, [[0, 1]]))  # (1, 2, 3)
    exe_ids, exe_ws = zip(*execute_set(SPEC, [1, 3]))  # (0, 3, 5): expert 3 also trained here
    seqs = [SequenceExample([1, 2, 3], [4, 5, 6], np.zeros(3, np.float32), merge_ids, merge_ws, 1.0,
                            expert_trainable=(True, False, False)),
            SequenceExample([1, 2, 3], [7, 8, 9], np.zeros(3, np.float32), merge_ids, merge_ws, 1.0,
                            expert_trainable=(True, False, False)),
            SequenceExample([2, 3], [9, 9, 1], np.zeros(3, np.float32), exe_ids, exe_ws, 1.0)]
    pad = (lambda s: pad_shared(s, rows=4, buckets=(8,), max_active=4)) if shared else (
        lambda s: pad_sequences(s, rows=4, length_buckets=(8,), max_active=4))
    batch = jax.tree.map(jnp.asarray, pad(seqs))
    untagged = jax.tree.map(jnp.asarray, pad([dataclasses.replace(e, expert_trainable=None) for e in seqs]))

    def run(spec, b):
        f = lambda bk: jnp.sum(sequence_logprobs(frozen, CFG, spec, bk, b))  # noqa: E731
        return jax.value_and_grad(f)(bank)

    results = {}
    for compose in ("gather", "onehot"):
        spec = dataclasses.replace(SPEC, compose=compose)
        value, grad = run(spec, batch)
        value_all, grad_all = run(spec, untagged)
        assert float(value) == pytest.approx(float(value_all), rel=1e-6)  # same forward
        for e in (1, 3, 5, 0):  # merge expert, shared expert 3 (execute row), execute-only experts
            assert np.abs(_expert_rows(grad, e)).sum() > 0, (compose, e)
        np.testing.assert_array_equal(_expert_rows(grad, 2), 0.0)  # used only by merge rows, frozen there
        assert np.abs(_expert_rows(grad_all, 2)).sum() > 0  # ... and trained when every slot trains
        # expert 3: trained by the execute row only, not by the merge rows that also use it
        assert not np.allclose(_expert_rows(grad, 3), _expert_rows(grad_all, 3))
        results[compose] = grad
    for x, y in zip(jax.tree.leaves(results["gather"]), jax.tree.leaves(results["onehot"])):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=2e-4, atol=1e-6)


# ------------------------------------------------------------------------------- routes


def _execute_group(rewards, seed=0):
    """An execute node, 2 routes x 2 candidates, with real router draws recorded."""
    rng = np.random.default_rng(seed)
    routes = [(0, 1), (2, 3)]
    cands = []
    for members in routes:
        ids, ws = zip(*execute_set(SPEC, members))
        cands.append([Cand([1, 2, 3], rng.integers(1, 32, 4).tolist(), np.full(4, -3.0, np.float32), ids, ws)
                      for _ in range(2)])
    return Group(np.asarray(rewards, np.float32), cands, routes, np.array([-1.5, -2.0], np.float32), "5 6 7")


def test_route_examples_carry_a_cross():
    """Eq. 6 by hand: u = [[1, 0], [1, 1]]; route means 0.5 and 1; A_cross = (mu_b - 0.75) / (0.25 + eps)
    = -1, +1; A_within of route 0 = (+1, -1), of route 1 = 0 (constant)."""
    g = _execute_group([[1.0, 0.0], [1.0, 1.0]])
    seqs, routes, _ = examples_from_groups([g], description_ids=_desc_ids)
    assert [r.advantage for r in routes] == pytest.approx([-1.0, 1.0], abs=1e-4)
    assert [r.members for r in routes] == [(0, 1), (2, 3)]
    assert [r.behaviour_set_logp for r in routes] == pytest.approx([-1.5, -2.0])
    assert [s.advantage for s in seqs] == pytest.approx([1.0, -1.0], abs=1e-4)
    # flat GRPO (variant C): the router's advantage is the sum of its candidates' advantages
    _, flat_routes, _ = examples_from_groups([g], advantage="grpo", description_ids=_desc_ids)
    u = np.array([1.0, 0.0, 1.0, 1.0])
    a = (u - u.mean()) / (u.std() + 1e-6)
    assert [r.advantage for r in flat_routes] == pytest.approx([a[0] + a[1], a[2] + a[3]], abs=1e-4)


def test_regularisers_reach_the_router_when_every_a_cross_is_zero(trainer):
    """Both routes have mean reward 0.5, so A_cross = 0 everywhere, while A_within != 0; the entropy
    and orthogonality terms must still move the router (the paper applies them every update)."""
    g = _execute_group([[1.0, 0.0], [0.0, 1.0]])
    seqs, routes, _ = examples_from_groups([g], description_ids=_desc_ids)
    assert seqs and len(routes) == 2 and all(r.advantage == 0.0 for r in routes)
    before = _host(_trainable()["router"])
    new, _, m = trainer.update(_trainable(), trainer.init_opt_state(_trainable()), seqs, routes, num_groups=1)
    assert m["grad_norm_router"] > 0 and m["routing_entropy"] > 0 and m["orthogonality"] > 0
    for x, y in zip(jax.tree.leaves(before), jax.tree.leaves(_host(new["router"]))):
        assert not np.array_equal(x, y)


def test_router_changes_after_an_update_with_a_cross(trainer):
    g = _execute_group([[1.0, 0.0], [1.0, 1.0]])
    _, routes, _ = examples_from_groups([g], description_ids=_desc_ids)
    before = _host(_trainable())
    new, _, m = trainer.update(_trainable(), trainer.init_opt_state(_trainable()), [], routes, num_groups=1)
    assert m["skipped_update"] == 0.0 and m["router_loss"] != 0.0
    new = _host(new)
    assert not np.array_equal(new["router"]["prototypes"], before["router"]["prototypes"])
    jax.tree.map(np.testing.assert_array_equal, new["bank"], before["bank"])  # no LoRA signal


# Eq. 8 and the regularisers from their definitions, in float64 numpy.


def _np_router_loss(router, embed, desc, members, adv, *, alpha, w_h, w_o, scale):
    def unit(x):
        return x / np.sqrt(np.maximum(np.sum(x * x, -1, keepdims=True), 1e-12))

    loss, ents = 0.0, []
    for d, mem, a in zip(desc, members, adv):
        emb = embed[d].mean(0)  # mean input embedding of the description's tokens
        z = unit(emb @ router["proj"]["kernel"] + router["proj"]["bias"]) @ unit(router["prototypes"]).T
        p = np.exp(z - z.max())
        p /= p.sum()
        # probability of the unordered set: sequential draws without replacement over all orders
        prob = 0.0
        for order in itertools.permutations(mem):
            left, q = 1.0, 1.0
            for e in order:
                q *= p[e] / left
                left -= p[e]
            prob += q
        loss += -alpha * scale * a * np.log(prob)
        ents.append(-np.sum(p * np.log(p)))
    ph = unit(router["prototypes"])
    ortho = np.sum((ph @ ph.T - np.eye(len(ph))) ** 2)
    return loss - w_h * np.mean(ents) + w_o * ortho


@pytest.mark.parametrize("reinforce", [True, False])
def test_router_gradient_equals_eq8_by_finite_differences(trainer, reinforce):
    """The router gradient of the update equals the central-difference gradient of
    (1/G) alpha_pi sum_b -A_b log pi(E_b | s) - w_H mean H(pi) + w_O ||P P^T - I||^2 (Eq. 8 plus
    the regularisers), with the set probability enumerated over orderings. At the behaviour
    router the PPO form has the same gradient as REINFORCE."""
    router = _host(_trainable(seed=7)["router"])
    embed = np.asarray(trainer.frozen["embed"], np.float64)
    desc = [[5, 6, 7], [9, 10], [5, 6, 7]]
    members = [(0, 1), (2, 3), (3, 0)]
    adv = [1.3, -0.4, 0.0]
    G = 2
    r64 = jax.tree.map(lambda x: x.astype(np.float64), router)
    kw = dict(alpha=TCFG.alpha_pi, w_h=TCFG.entropy_weight, w_o=TCFG.orthogonality_weight, scale=1 / G)
    old = []
    for d, mem in zip(desc, members):  # behaviour set log-probs = the current router's
        lp = _np_router_loss(r64, embed, [d], [mem], [1.0], alpha=1.0, w_h=0.0, w_o=0.0, scale=1.0)
        old.append(-lp + 0.0)
    examples = [RouteExample(d, m, float(o), a) for d, m, o, a in zip(desc, members, old, adv)]
    batch = pad_routes(examples, rows=8, k=2, scale=1 / G)
    grad_fn = jax.jit(functools.partial(route_gradients, cfg=trainer.cfg, reinforce=reinforce))
    # the gradient the step's finish program adds to the bank's
    got, _ = grad_fn(jax.tree.map(jnp.asarray, router), trainer.frozen["embed"], batch)
    got = _host(got)

    leaves, treedef = jax.tree.flatten(r64)
    h = 1e-6
    for i, leaf in enumerate(leaves):
        num = np.zeros_like(leaf)
        it = np.nditer(leaf, flags=["multi_index"])
        for _ in it:
            idx = it.multi_index
            vals = []
            for sign in (1, -1):
                pert = [x.copy() for x in leaves]
                pert[i][idx] += sign * h
                vals.append(_np_router_loss(jax.tree.unflatten(treedef, pert), embed, desc, members, adv, **kw))
            num[idx] = (vals[0] - vals[1]) / (2 * h)
        np.testing.assert_allclose(jax.tree.leaves(got)[i], num, rtol=2e-3, atol=2e-6)


# ------------------------------------------------------------------------------- optimiser


def test_grad_clipping_is_off_by_default_and_per_tree_when_on():
    """With clipping on, the LoRA step must not depend on the router's gradient (and vice versa), as
    with the two separate optimisers of the paper and the authors' code. Adam is nearly scale
    invariant, so the bank gradient is taken at the scale of Adam's eps, where a joint clip (scaling
    it by 1 / the router's norm) visibly shrinks the step."""
    assert TrainConfig().max_grad_norm is None
    params = {"bank": {"w": jnp.zeros(3)}, "router": {"w": jnp.zeros(2)}}
    small = jnp.array([1e-9, -2e-9, 3e-9])

    def bank_step(max_norm, router_grad):
        tx = make_optimizer(TrainConfig(lora_lr=1.0, router_lr=1.0, weight_decay=0.0, max_grad_norm=max_norm))
        grads = {"bank": {"w": small}, "router": {"w": jnp.full(2, router_grad)}}
        updates, _ = tx.update(grads, tx.init(params), params)
        return np.asarray(updates["bank"]["w"])

    b1 = bank_step(1.0, 1e3)
    b2 = bank_step(1.0, 1e-3)
    b0 = bank_step(None, 1e3)
    np.testing.assert_allclose(b1, b2, rtol=1e-6)  # independent of the router gradient
    np.testing.assert_allclose(b1, b0, rtol=1e-6)  # the bank's own norm (< 1) is not clipped


# ------------------------------------------------------------------------------- PPO passes


def test_second_ppo_pass_moves_the_ratio_and_engages_the_clip():
    """ppo_epochs=2: the first pass runs at the sampler's policy (ratio 1, no clipping); after one
    large step the second pass's ratio differs from 1 and the clip zeroes some tokens' gradient."""
    tcfg = dataclasses.replace(TCFG, ppo_epochs=2, lora_lr=0.3)
    tr = Trainer(CFG, _params(), SPEC, tcfg)
    trainable = _trainable()
    rng = np.random.default_rng(3)
    ids, ws = zip(*execute_set(SPEC, [0, 1]))
    seqs = [SequenceExample([1, 2, 3], rng.integers(1, 32, 6).tolist(), np.zeros(6, np.float32), ids, ws,
                            float(a)) for a in (1.0, -1.0, 1.0, -1.0)]
    behaviour = tr.logprobs(trainable["bank"], seqs)  # old log-probs = the current policy's
    seqs = [dataclasses.replace(e, behaviour_logprobs=lp) for e, lp in zip(seqs, behaviour)]
    _, _, m = tr.update(trainable, tr.init_opt_state(trainable), seqs, [], num_groups=1)
    assert m["ratio_mean_first"] == pytest.approx(1.0, abs=1e-4)
    assert m["clip_fraction_first"] == 0.0
    assert abs(m["ratio_mean"] - 1.0) > 0.05
    assert m["clip_fraction"] > 0.0


# ------------------------------------------------------------------------------- job config


def test_train_config_maps_the_fidelity_fields():
    from morse_jax.config.defaults import get_config
    from morse_jax.config.derived import train_config

    c = get_config()
    t = train_config(c)
    assert t.max_grad_norm is None and t.ppo_epochs == 1 and t.loss_normalisation == "sequence_mean"
    assert c.train.merge_trains_subtask_experts is False
    c.train.max_grad_norm, c.train.ppo_epochs, c.train.loss_normalisation = 0.5, 3, "sequence_sum"
    t = train_config(c)
    assert (t.max_grad_norm, t.ppo_epochs, t.loss_normalisation) == (0.5, 3, "sequence_sum")


@pytest.mark.parametrize("field, value", [("loss_normalisation", "token_mean"), ("ppo_epochs", 0),
                                          ("max_grad_norm", -1.0)])
def test_bad_fidelity_fields_are_one_line_config_errors(field, value):
    from morse_jax.config.validate import ConfigError, validate_config
    from morse_jax.config.defaults import get_config

    c = get_config()
    c.model.path = "embedded"
    c.train[field] = value
    with pytest.raises(ConfigError, match=f"config.train.{field}"):
        validate_config(c, check_paths=False)
