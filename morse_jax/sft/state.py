"""The SFT training state (one typed pytree) and its optimiser: AdamW, linear warmup + cosine decay.

As on the RL side (``morse_jax.rl.update.TrainState``), the state holds only what an update changes:
the trainable (adapter) params and the optimiser state; the frozen backbone is a separate
argument of every step, never differentiated, updated or checkpointed.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax
from flax import struct

from morse_jax.sft.config import SFTConfig


@struct.dataclass
class SFTState:
    """Everything one SFT step changes.

    Attributes:
      step: int32[] optimiser steps taken (also the schedule's position and the data cursor:
        epoch = step // steps_per_epoch).
      params: the trainable (adapter) pytree, the only differentiated tree.
      opt_state: ``make_optimizer``'s state over ``params``.
      rng: a typed PRNG key, split once per step, so that a stochastic objective (dropout) gets a
        fresh key per step and a resumed run the same keys as an uninterrupted one.
    """

    step: jax.Array
    params: Any
    opt_state: Any
    rng: jax.Array

    @classmethod
    def create(cls, params, tx: optax.GradientTransformation, rng: jax.Array) -> "SFTState":
        return cls(step=jnp.zeros((), jnp.int32), params=params, opt_state=tx.init(params), rng=rng)


def lr_schedule(cfg: SFTConfig, total_steps: int) -> Callable[[jax.Array], jax.Array]:
    """Learning rate at optimiser step s (0-based: the rate the (s+1)-th update uses).

    Linear warmup 0 -> peak over ``w = max(1, round(warmup_fraction * total_steps))`` steps when
    warmup_fraction > 0 (lr(s) = peak * s / w for s < w), then a cosine from the peak at s = w to
    ``peak * final_lr_fraction`` at s = total_steps.
    """
    if total_steps < 1:
        raise ValueError(f"total_steps must be >= 1, got {total_steps}")
    w = max(1, round(cfg.warmup_fraction * total_steps)) if cfg.warmup_fraction > 0 else 0
    w = min(w, total_steps - 1) if total_steps > 1 else 0
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=cfg.learning_rate, warmup_steps=w, decay_steps=total_steps,
        end_value=cfg.learning_rate * cfg.final_lr_fraction) if w else optax.cosine_decay_schedule(
        cfg.learning_rate, total_steps, alpha=cfg.final_lr_fraction)


def make_optimizer(cfg: SFTConfig, total_steps: int) -> optax.GradientTransformation:
    """AdamW on :func:`lr_schedule`, after global-norm clipping when ``max_grad_norm`` is set."""
    adamw = optax.adamw(lr_schedule(cfg, total_steps), b1=cfg.b1, b2=cfg.b2, eps=cfg.eps,
                        weight_decay=cfg.weight_decay)
    return optax.chain(optax.clip_by_global_norm(cfg.max_grad_norm), adamw) if cfg.max_grad_norm else adamw
