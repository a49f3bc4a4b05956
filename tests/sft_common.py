"""Shared pieces of the SFT tests: a tiny random backbone, a small MoR (role groups with token
routers, balance and orthogonality losses) on it, and a toy multi-role data set whose role turns
follow per-role rules (learnable, so held-out CE can drop)."""

from __future__ import annotations

import jax
import numpy as np

from morse_jax.models import ModelConfig, init_params
from morse_jax.models.transformer import split_segments
from morse_jax.mor.batch import NO_ROLE
from morse_jax.sft.data import Rendered
from morse_jax.mor.config import MoRConfig
from morse_jax.mor.params import init_mor_params
from morse_jax.sft.objective import mor_objective

VOCAB = 64
CFG = ModelConfig(family="llama", vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_layers=2,
                  num_heads=4, num_kv_heads=2, head_dim=8)
MOR = MoRConfig(routed=(2, 2, 2), top_k=(1, 1, 1), rank=4, n_adapt=2)
END = 1  # end-of-turn token (a target)
HEADERS = (2, 3, 4)  # role-turn header token per role (carries the role, not a target)


def backbone(seed: int = 0, *, cfg: ModelConfig = CFG, mor: MoRConfig = MOR):
    params = init_params(jax.random.key(seed), cfg)
    params["lm_head"] = params["lm_head"] * 10.0  # logits that depend on the hidden state
    return split_segments(params, mor.n_adapt)


OBJECTIVE = mor_objective(CFG, MOR)  # one object: the trainer's jitted steps are cached per objective


def objective():
    return OBJECTIVE


def trainable(seed: int = 1, b_scale: float = 0.0, *, cfg: ModelConfig = CFG, mor: MoRConfig = MOR):
    bank = init_mor_params(jax.random.key(seed), cfg, mor)
    if b_scale:
        keys = iter(jax.random.split(jax.random.key(seed + 1), len(bank["b"])))
        bank["b"] = {t: b_scale * jax.random.normal(next(keys), x.shape) for t, x in bank["b"].items()}
    return bank


def toy_examples(n: int, seed: int, *, min_len: int = 3, max_len: int = 9) -> list[Rendered]:
    """n trajectories: 2-5 context tokens (no role), then a turn per role: header, content, END.
    Role r's content is an arithmetic run of step r + 1 through its own token range."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        toks = list(rng.integers(8, 16, rng.integers(2, 6)))
        roles = [NO_ROLE] * len(toks)
        loss = [False] * len(toks)
        for r, h in enumerate(HEADERS):
            k = int(rng.integers(min_len, max_len + 1))
            lo = 16 + 16 * r
            start = int(rng.integers(0, 16))
            content = [lo + (start + i * (r + 1)) % 16 for i in range(k)]
            toks += [h, *content, END]
            roles += [r] * (k + 2)
            loss += [False] + [True] * (k + 1)
        out.append(Rendered(np.asarray(toks, np.int32), np.asarray(roles, np.int32), np.asarray(loss, bool)))
    return out
