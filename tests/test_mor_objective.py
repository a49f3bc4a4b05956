"""MoR's SFT objective: gradients reach only the trainable tree; the balance and orthogonality
terms are losses.py's functions on the router logits the forward hands back and on the routed
factors; the ablation settings switch the terms; packed rows attend within their segment; the
paper's setting on Llama-3.2-1B-Instruct counts 0.16 B trainable parameters."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from morse_jax.models import ModelConfig, init_params
from morse_jax.models.transformer import forward, split_segments
from morse_jax.mor.adapter import MoRInputs
from morse_jax.mor.batch import NO_ROLE, SFTBatch
from morse_jax.mor.config import MoRConfig
from morse_jax.mor.losses import ALPHA_BALANCE, ALPHA_ORTH, mor_balance_loss, orthogonality_loss, role_ce
from morse_jax.mor.objective import sft_loss
from morse_jax.mor.params import PAPER, init_mor_params, llama_3_2_1b_instruct, param_count, plain_lora_config

CFG = ModelConfig(family="llama", vocab_size=61, hidden_size=32, intermediate_size=48, num_layers=3, num_heads=4,
                  num_kv_heads=2, head_dim=8)
MOR = MoRConfig(rank=4, n_adapt=2, targets=("q", "v", "o", "down"))
B, T = 2, 10


@pytest.fixture(scope="module")
def setup():
    frozen = split_segments(init_params(jax.random.PRNGKey(0), CFG), MOR.n_adapt)
    rng = np.random.default_rng(0)
    roles = np.array([[-1, -1, 0, 0, 0, 1, 1, 1, 2, 2], [-1, 2, 2, 2, 0, 0, 1, 1, 1, NO_ROLE]], np.int32)
    valid = np.ones((B, T), bool)
    valid[1, -1] = False
    batch = SFTBatch(tokens=jnp.asarray(rng.integers(1, CFG.vocab_size, (B, T)), jnp.int32),
                     role_ids=jnp.asarray(roles), loss_mask=jnp.asarray(roles >= 0),
                     valid=jnp.asarray(valid), positions=jnp.tile(jnp.arange(T, dtype=jnp.int32), (B, 1)),
                     segment_ids=jnp.zeros((B, T), jnp.int32))
    return frozen, batch


def trainable(cfg, seed=1):
    p = init_mor_params(jax.random.PRNGKey(seed), CFG, cfg)
    keys = iter(jax.random.split(jax.random.PRNGKey(seed + 100), 32))
    p["b"] = {t: 0.3 * jax.random.normal(next(keys), b.shape) for t, b in p["b"].items()}
    return p


def loss_and_grads(cfg, frozen, batch):
    fn = jax.jit(jax.value_and_grad(sft_loss, argnums=(0, 1), has_aux=True), static_argnums=(3, 4))
    return fn(trainable(cfg), frozen, batch, CFG, cfg)


def test_gradients_reach_only_the_trainable_tree(setup):
    frozen, batch = setup
    (loss, _), (g_train, g_frozen) = loss_and_grads(MoRConfig(**{**dataclasses.asdict(MOR), "shared_gate": "sigmoid"}),
                                                     frozen, batch)
    assert np.isfinite(float(loss))
    assert all(not np.any(np.asarray(g)) for g in jax.tree.leaves(g_frozen))  # exact zeros
    for part in ("a", "b", "router", "gate"):
        for t, g in g_train[part].items():
            assert np.all(np.isfinite(g)) and np.any(np.asarray(g) != 0), (part, t)


def test_balance_and_orthogonality_terms_are_the_losses_on_what_the_adapter_exposes(setup):
    frozen, batch = setup
    params = trainable(MOR)
    loss, m = jax.jit(sft_loss, static_argnums=(3, 4))(params, frozen, batch, CFG, MOR)
    role_ids = jnp.where(batch.valid, batch.role_ids, NO_ROLE)
    logits, _, aux = jax.jit(lambda f, p: forward(f, CFG, batch.tokens, positions=batch.positions, valid=batch.valid,
                                                  lora=MoRInputs(p, role_ids, MOR), with_aux=True))(frozen, params)
    ce, _ = role_ce(logits, batch.tokens, batch.loss_mask & batch.valid, role_ids, MOR.role_names)
    per_role, orth = [], 0.0
    for r, e in enumerate(MOR.routed):
        cols = slice(sum(MOR.routed[:r]), sum(MOR.routed[:r + 1]))
        per_role.append(jnp.concatenate([aux[t][..., cols] for t in MOR.targets]))  # [L * targets, B, T, E_r]
        lo = sum(1 + x for x in MOR.routed[:r]) + 1  # routed LoRAs follow the role's shared one
        orth += np.mean([float(orthogonality_loss(params["a"][t][:, lo:lo + e], params["b"][t][:, lo:lo + e]))
                         for t in MOR.targets])
    balance = mor_balance_loss(per_role, role_ids, MOR.top_k)
    np.testing.assert_allclose(float(m["balance"]), float(balance), rtol=1e-5)
    np.testing.assert_allclose(float(m["orth"]), orth, rtol=1e-5)
    np.testing.assert_allclose(float(m["ce"]), float(ce), rtol=1e-5)
    np.testing.assert_allclose(float(loss), float(ce) + ALPHA_BALANCE * float(balance) + ALPHA_ORTH * orth, rtol=1e-6)
    assert float(m["balance"]) > 0 and float(m["orth"]) > 0
    assert m["router/reasoner/load0"].shape == () and "router/summarizer/entropy" in m


@pytest.mark.parametrize("change,has", [
    pytest.param({"use_balance": False}, ("orth",), marks=pytest.mark.slow),
    pytest.param({"use_orth": False}, ("balance",), marks=pytest.mark.slow),
    ({"routing": "uniform"}, ("orth",)),
    pytest.param({"kind": "lora"}, (), marks=pytest.mark.slow)], ids=["no_balance", "no_orth", "uniform", "lora"])
def test_ablation_settings_switch_the_terms(setup, change, has):
    frozen, batch = setup
    cfg = dataclasses.replace(MOR, **change)
    loss, m = jax.jit(sft_loss, static_argnums=(3, 4))(trainable(cfg), frozen, batch, CFG, cfg)
    want = float(m["ce"]) + ("balance" in has) * ALPHA_BALANCE * float(m["balance"]) \
        + ("orth" in has) * ALPHA_ORTH * float(m["orth"])
    np.testing.assert_allclose(float(loss), want, rtol=1e-6)
    if change.get("routing") == "uniform" or change.get("kind") == "lora":
        assert float(m["balance"]) == 0 and "router" not in trainable(cfg)


def test_packed_rows_attend_within_their_segment():
    params = init_params(jax.random.PRNGKey(0), CFG)
    rng = np.random.default_rng(1)
    a, b = rng.integers(1, CFG.vocab_size, 4), rng.integers(1, CFG.vocab_size, 5)
    packed = jnp.asarray(np.concatenate([a, b])[None], jnp.int32)
    seg = jnp.asarray([[0] * 4 + [1] * 5], jnp.int32)
    pos = jnp.asarray([list(range(4)) + list(range(5))], jnp.int32)
    run = jax.jit(lambda tk, **kw: forward(params, CFG, tk, **kw)[0])
    got = np.asarray(run(packed, positions=pos, segment_ids=seg))
    want_a, want_b = (np.asarray(run(jnp.asarray(x[None], jnp.int32))) for x in (a, b))
    np.testing.assert_allclose(got[0, :4], want_a[0], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got[0, 4:], want_b[0], rtol=1e-5, atol=1e-5)


def test_llama_3_2_1b_paper_setting_counts_0_16_billion_trainable_parameters():
    cfg = llama_3_2_1b_instruct()
    assert (cfg.hidden_size, cfg.intermediate_size, cfg.num_layers, cfg.num_kv_heads) == (2048, 8192, 16, 8)
    # per layer: LoRAs 14 x rank 16 x Σ_targets (d_in + d_out) = 224 x 44,032; routers 11 x Σ d_in = 11 x 20,480
    loras, routers = 16 * 224 * 44_032, 16 * 11 * 20_480
    n = param_count(cfg, PAPER)
    assert n == loras + routers == 161_415_168  # 157.8 M LoRA + 3.6 M routers: the paper's 0.16 B
    assert param_count(cfg, dataclasses.replace(PAPER, shared_gate="sigmoid")) == n + 16 * 3 * 20_480
    plain = plain_lora_config(cfg, PAPER)
    assert plain.rank == 229 and abs(param_count(cfg, plain) - n) / n < 0.005
