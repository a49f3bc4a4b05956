"""Shared pieces of the role-loop scoring tests (hand-over decisions, closed thoughts): a tiny
random llama with a MoR on its last two layers, MoR params whose adapter acts (B != 0), and the
reference log-likelihood of a rendered episode from full logits (the definition)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from morse_jax.models import ModelConfig
from morse_jax.models.transformer import forward
from morse_jax.mor.adapter import MoRInputs
from morse_jax.mor.config import MoRConfig
from morse_jax.mor.params import init_mor_params
from morse_jax.sft.data import render
from morse_jax.tasks.trajectories import Trajectory, Turn

CFG = ModelConfig(family="llama", vocab_size=128, hidden_size=32, intermediate_size=48, num_layers=3, num_heads=4,
                  num_kv_heads=2, head_dim=8)
MOR = MoRConfig(rank=4, n_adapt=2, targets=("q", "v", "o", "down"))


def acting_mor_params(seed: int) -> dict:
    """MoR params with random B (a fresh adapter has B = 0 and changes nothing)."""
    p = init_mor_params(jax.random.PRNGKey(seed), CFG, MOR)
    keys = iter(jax.random.split(jax.random.PRNGKey(seed + 100), 32))
    p["b"] = {t: 0.5 * jax.random.normal(next(keys), b.shape) for t, b in p["b"].items()}
    return p


def episode_logprob(frozen, params, traj: Trajectory, tok, *, reasoner_text: str | None = None,
                    end_of_turn: bool = True) -> float:
    """log p(every token of the rendered episode after the first) from full logits, through the last
    turn's end-of-turn token (``end_of_turn``) or its last content token. ``reasoner_text``: a
    reasoner turn holding it is appended first."""
    if reasoner_text is not None:
        traj = dataclasses.replace(traj, turns=traj.turns + (Turn("reasoner", reasoner_text),))
    r = render(traj, tok)
    end = int(np.flatnonzero(r.loss_mask)[-1]) + int(end_of_turn)
    ids = jnp.asarray(r.tokens[None, :end])
    logits, _ = forward(frozen, CFG, ids, lora=MoRInputs(params, jnp.asarray(r.role_ids[None, :end]), MOR))
    lp = jax.nn.log_softmax(logits[0].astype(jnp.float32), axis=-1)
    return float(sum(lp[t, ids[0, t + 1]] for t in range(end - 1)))
