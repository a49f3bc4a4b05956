"""The MoR adapter against a direct per-token reference written from the definition (a numpy loop:
role gate, float softmax of the role's router, top-k, renormalise over the kept, shared LoRA),
in the training forward (scanned and unrolled), in the prefill and in the cached decode step, on
a tiny random model with rows of different roles and rows whose role changes mid-sequence."""

from __future__ import annotations

import dataclasses
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import struct

from morse_jax.models import ModelConfig, init_params
from morse_jax.models import decode as D
from morse_jax.models.adapters import GROUPS
from morse_jax.models.transformer import forward, split_segments, unstack_segments
from morse_jax.mor.adapter import MoRInputs, layer_values
from morse_jax.mor.config import MoRConfig
from morse_jax.mor.params import init_mor_params

CFG = ModelConfig(family="llama", vocab_size=61, hidden_size=32, intermediate_size=48, num_layers=3, num_heads=4,
                  num_kv_heads=2, head_dim=8)
MOR = MoRConfig(rank=4, n_adapt=2)  # the paper's groups (1+4, 1+4, 1+3; top 3, 3, 2), all 7 targets
# rows of different roles; row 0 changes role mid-sequence and has role-less tokens in between
ROLES = np.array([[-1, -1, 0, 0, 1, 1, -1, 2, 2],
                  [2, 2, 2, -1, 0, 0, 0, 1, 1]], np.int32)
B, T = ROLES.shape
P = T - 1  # prefill length; the decode step feeds the last token


# --------------------------------------------------------------------------- the reference


def ref_delta(x, role, lp, cfg: MoRConfig, t):
    """One token: x float64 [d_in] of role ``role`` -> the delta [d_out] (module docstring of
    morse_jax.mor.adapter, written out)."""
    a, b = np.asarray(lp["a"][t], np.float64), np.asarray(lp["b"][t], np.float64)
    if cfg.kind == "lora":
        return x @ a[0] @ b[0] * cfg.scale
    if role < 0:
        return np.zeros(b.shape[-1])
    s = cfg.lora_offset(role)
    shared = 1.0
    if cfg.shared_gate == "sigmoid":
        shared = 1.0 / (1.0 + np.exp(-(x @ np.asarray(lp["gate"][t], np.float64)[:, role])))
    out = shared * (x @ a[s] @ b[s])
    e, k = cfg.routed[role], cfg.top_k[role]
    if cfg.routing == "uniform":
        weights = {i: 1.0 / e for i in range(e)}
    else:
        g = np.asarray(lp["router"][t], np.float64)[:, cfg.router_offset(role):cfg.router_offset(role) + e]
        logits = x @ g
        p = np.exp(logits - logits.max())
        p /= p.sum()
        kept = sorted(range(e), key=lambda i: (-p[i], i))[:k]
        weights = {i: p[i] / sum(p[j] for j in kept) for i in kept}
    for i, w in weights.items():
        out = out + w * (x @ a[s + 1 + i] @ b[s + 1 + i])
    return out * cfg.scale


@struct.dataclass
class RefLayer:
    """The reference as an adapter value: the numpy loop runs on the host (``jax.pure_callback``),
    so the reference model can be jitted like ours."""

    lp: dict
    roles: jax.Array  # [B, T] or [B]
    cfg: MoRConfig = struct.field(pytree_node=False)

    def deltas(self, x, group, out_dims, columns):
        targets = [t for t in GROUPS[group] if t in out_dims and t in self.lp["a"]]

        def host(x, roles, lp):
            x = np.asarray(x, np.float64)
            rows = x.T[:, None, :] if columns else x
            roles = np.asarray(roles)
            roles = roles[:, None] if roles.ndim == 1 else roles
            out = {}
            for t in targets:
                d = np.stack([np.stack([ref_delta(rows[i, j], roles[i, j], lp, self.cfg, t)
                                        for j in range(rows.shape[1])]) for i in range(rows.shape[0])])
                out[t] = (d[:, 0].T if columns else d).astype(np.float32)
            return out

        lead = (x.shape[1],) if columns else x.shape[:2]
        shapes = {t: jax.ShapeDtypeStruct((out_dims[t], *lead) if columns else (*lead, out_dims[t]), jnp.float32)
                  for t in targets}
        return jax.pure_callback(host, shapes, x, self.roles, self.lp)


@struct.dataclass
class RefInputs:
    """Stacked form of the reference (transformer.forward's StackedAdapter protocol)."""

    params: dict
    roles: jax.Array
    cfg: MoRConfig = struct.field(pytree_node=False)

    @property
    def num_layers(self):
        return jax.tree.leaves(self.params)[0].shape[0]

    def layers(self, start, stop):
        return self.replace(params=jax.tree.map(lambda p: p[start:stop], self.params))

    def scan_parts(self):
        return self.params, lambda p: RefLayer(p, self.roles, self.cfg)


def ref_layers(params, roles, cfg):
    n = jax.tree.leaves(params)[0].shape[0]
    return tuple(RefLayer(jax.tree.map(lambda p, j=j: p[j], params), roles, cfg) for j in range(n))


# --------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def backbone():
    params = init_params(jax.random.PRNGKey(0), CFG)
    tokens = jnp.asarray(np.random.default_rng(0).integers(1, CFG.vocab_size, (B, T)), jnp.int32)
    return params, tokens


def trained(cfg: MoRConfig, seed=1):
    """MoR params with non-zero B (an untrained adapter is a no-op) and spread router logits."""
    p = init_mor_params(jax.random.PRNGKey(seed), CFG, cfg)
    keys = iter(jax.random.split(jax.random.PRNGKey(seed + 100), 64))
    p["b"] = {t: 0.3 * jax.random.normal(next(keys), b.shape) for t, b in p["b"].items()}
    if "router" in p:
        p["router"] = {t: 3.0 * g for t, g in p["router"].items()}
    return p


def logits_of(params, tokens, lora):
    return np.asarray(jax.jit(lambda p, tk, lo: forward(p, CFG, tk, lora=lo)[0])(params, tokens, lora))


# --------------------------------------------------------------------------- tests


SLOW = pytest.mark.slow  # each variant compiles the model twice more (~20-40 s on 2 busy cores)


@pytest.mark.parametrize("cfg", [MOR, pytest.param(dataclasses.replace(MOR, shared_gate="sigmoid", scale=0.5), marks=SLOW),
                                 dataclasses.replace(MOR, routing="uniform"),
                                 pytest.param(dataclasses.replace(MOR, kind="lora", rank=6), marks=SLOW)],
                         ids=["paper", "sigmoid_gate_scaled", "uniform_routers", "plain_lora"])
def test_forward_equals_the_per_token_reference(backbone, cfg):
    params, tokens = backbone
    mor = trained(cfg)
    roles = jnp.asarray(ROLES)
    want = logits_of(split_segments(params, 2), tokens, RefInputs(mor, roles, cfg))
    scanned = logits_of(split_segments(params, 2), tokens, MoRInputs(mor, roles, cfg))
    unrolled = logits_of(unstack_segments(params), tokens, MoRInputs(mor, roles, cfg))
    base = logits_of(params, tokens, None)
    np.testing.assert_allclose(scanned, want, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(unrolled, want, rtol=1e-4, atol=1e-4)
    assert np.max(np.abs(want - base)) > 1e-2  # the deltas are visible


@pytest.mark.parametrize("cfg", [MOR, pytest.param(dataclasses.replace(MOR, shared_gate="sigmoid"), marks=SLOW)],
                         ids=["paper", "sigmoid"])
def test_prefill_and_decode_step_equal_the_reference(backbone, cfg):
    params, tokens = backbone
    mor = trained(cfg)
    dp = D.decode_params(params, CFG)
    valid = jnp.ones((B, P), bool)
    pos = D.positions_from_valid(valid)
    step_roles = np.array([1, 2], np.int32)  # row 0 switches role at the generated token

    def run(pre_layers, step_layers):
        cache = D.init_decode_cache(CFG, B, T + 1)
        pre, cache = D.forward_cached(dp, CFG, tokens[:, :P], valid, pos, cache, pre_layers, last_only=False)
        step, _ = D.decode_step(dp, CFG, tokens[:, P], jnp.ones((B,), bool), pos[:, -1] + 1, cache, step_layers)
        return pre, step

    ours = layer_values(mor, jnp.asarray(ROLES[:, :P]), cfg)
    got = jax.jit(run)(ours, tuple(m.with_roles(jnp.asarray(step_roles)) for m in ours))
    want = jax.jit(run)(ref_layers(mor, jnp.asarray(ROLES[:, :P]), cfg), ref_layers(mor, jnp.asarray(step_roles), cfg))
    got, want = [np.asarray(g) for g in got], [np.asarray(w) for w in want]
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-4)
    # and the cached path agrees with the training forward over the whole sequence
    roles = np.concatenate([ROLES[:, :P], step_roles[:, None]], axis=1)
    full = logits_of(split_segments(params, 2), tokens, MoRInputs(mor, jnp.asarray(roles), cfg))
    np.testing.assert_allclose(got[1], full[:, -1], rtol=1e-4, atol=1e-4)


def test_role_less_tokens_get_exactly_the_base_output(backbone):
    params, tokens = backbone
    mor = trained(MOR)
    params = split_segments(params, 2)
    base = logits_of(params, tokens, None)
    none = logits_of(params, tokens, MoRInputs(mor, jnp.full((B, T), -1, jnp.int32), MOR))
    np.testing.assert_array_equal(none, base)
    # causal: row 0's tokens before its first role token are the base model's, bit for bit
    mixed = logits_of(params, tokens, MoRInputs(mor, jnp.asarray(ROLES), MOR))
    np.testing.assert_array_equal(mixed[0, :2], base[0, :2])
    assert np.max(np.abs(mixed[0, 2:] - base[0, 2:])) > 1e-3


def test_untrained_adapter_is_a_no_op_and_router_logits_come_back(backbone):
    params, tokens = backbone
    mor = init_mor_params(jax.random.PRNGKey(3), CFG, MOR)
    params = split_segments(params, 2)
    base = logits_of(params, tokens, None)
    got, _, aux = jax.jit(lambda p, m: forward(p, CFG, tokens, lora=MoRInputs(m, jnp.asarray(ROLES), MOR),
                                               with_aux=True))(params, mor)
    np.testing.assert_array_equal(np.asarray(got), base)  # B = 0
    assert sorted(aux) == sorted(MOR.targets)
    for t, lg in aux.items():
        assert lg.shape == (2, B, T, sum(MOR.routed)) and lg.dtype == jnp.float32, t
