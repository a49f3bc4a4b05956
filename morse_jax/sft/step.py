"""The pure SFT step: gradient accumulation over micro-batches, AdamW, and the held-out eval step.

Generic over the objective: ``loss_fn(trainable, frozen, batch: SFTBatch[B, T]) -> (loss, metrics)``,
a token-mean loss over the batch's targets with float32 scalar (or fixed-shape) metrics, e.g.
MoR's ``sft_loss`` or :func:`morse_jax.sft.objective.lora_objective`. The trainer never looks inside it.

Accumulation: a step's batch is ``SFTBatch[M, B, T]`` (M micro-batches of one length bucket,
``morse_jax.sft.batching``), scanned in one jit. Micro-batch m has n_m target tokens (loss mask
and valid, from position 1: the CE of token t is predicted at t - 1); its gradient enters with
weight n_m / Σ n, so for a token-mean objective the step's gradient is that of the mean loss
over all the step's target tokens, as if the M micro-batches were one batch (the tests check
this against one batch of all rows). Metrics combine the same way (:func:`combine_metrics`).
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Mapping

import jax
import jax.numpy as jnp
import optax

from morse_jax.mor.batch import SFTBatch
from morse_jax.sft.state import SFTState

LossFn = Callable[[Any, Any, SFTBatch], tuple[jax.Array, dict]]


def target_counts(batch: SFTBatch) -> jax.Array:
    """float32[...] target tokens per row group: sums ``loss_mask & valid`` from position 1 over the
    last two axes ([M, B, T] -> [M]; [B, T] -> [])."""
    t = batch.loss_mask[..., 1:] & batch.valid[..., 1:]
    return jnp.sum(t, axis=(-2, -1)).astype(jnp.float32)


def combine_metrics(parts: Mapping[str, jax.Array], weights: jax.Array) -> dict:
    """Metrics of N parts (each value stacked on a leading axis [N, ...]) -> one set.

    * ``tokens`` and ``tokens/<x>``: summed (counts);
    * ``<name>/<x>`` when ``tokens/<x>`` is present (per-role CE, accuracy): mean weighted by
      ``tokens/<x>`` (so per-role CE over several batches is the CE over all that role's tokens);
    * anything else: mean weighted by ``weights`` [N] (the parts' target tokens), 0 when all are 0.
    Works on device arrays (inside jit) and host numpy alike.
    """
    def wmean(x, w):
        w = jnp.asarray(w, jnp.float32)
        x = jnp.asarray(x, jnp.float32)
        wb = w.reshape(w.shape + (1,) * (x.ndim - 1))
        return jnp.sum(x * wb, axis=0) / jnp.maximum(jnp.sum(w), 1e-30) * (jnp.sum(w) > 0)

    out = {}
    for k, v in parts.items():
        suffix = k.split("/", 1)[1] if "/" in k else None
        if k == "tokens" or k.startswith("tokens/"):
            out[k] = jnp.sum(jnp.asarray(v, jnp.float32), axis=0)
        elif suffix is not None and f"tokens/{suffix}" in parts:
            out[k] = wmean(v, parts[f"tokens/{suffix}"])
        else:
            out[k] = wmean(v, weights)
    return out


def accumulate_gradients(params, frozen, batch: SFTBatch, *, loss_fn: LossFn) -> tuple[Any, dict]:
    """Gradient of the step's loss w.r.t. ``params`` over ``batch`` [M, B, T] (module docstring) and
    the combined metrics (the objective's, plus ``loss``)."""
    counts = target_counts(batch)  # [M]
    total = jnp.maximum(jnp.sum(counts), 1.0)

    def micro(g_sum, xs):
        mb, n = xs
        (loss, m), g = jax.value_and_grad(loss_fn, has_aux=True)(params, frozen, mb.check())
        w = n / total
        return jax.tree.map(lambda s, x: s + w.astype(x.dtype) * x, g_sum, g), {**m, "loss": loss}

    grads, parts = jax.lax.scan(micro, jax.tree.map(jnp.zeros_like, params), (batch, counts))
    return grads, combine_metrics(parts, counts)


def train_step(state: SFTState, frozen, batch: SFTBatch, *, loss_fn: LossFn, tx: optax.GradientTransformation,
               schedule: Callable[[jax.Array], jax.Array] | None = None) -> tuple[SFTState, dict]:
    """One optimiser step on ``batch`` [M, B, T] (M micro-batches).

    Returns the new state and float32 metrics: the objective's (combined over micro-batches),
    ``loss``, ``grad_norm`` (before clipping), ``lr`` (the rate this step used; with ``schedule``).
    """
    grads, metrics = accumulate_gradients(state.params, frozen, batch, loss_fn=loss_fn)
    updates, opt_state = tx.update(grads, state.opt_state, state.params)
    metrics = {**metrics, "grad_norm": optax.global_norm(grads)}
    if schedule is not None:
        metrics["lr"] = jnp.asarray(schedule(state.step), jnp.float32)
    rng, _ = jax.random.split(state.rng)
    new = SFTState(step=state.step + 1, params=optax.apply_updates(state.params, updates), opt_state=opt_state,
                   rng=rng)
    return new, metrics


def eval_step(params, frozen, batch: SFTBatch, *, loss_fn: LossFn) -> dict:
    """The objective's metrics (and ``loss``) on one held-out batch [B, T]; no gradient. Combine
    several batches' results with :func:`combine_metrics` and :func:`target_counts` as weights."""
    loss, metrics = loss_fn(params, frozen, batch.check())
    return {**jax.lax.stop_gradient(metrics), "loss": jax.lax.stop_gradient(loss)}


def make_train_step(loss_fn: LossFn, tx: optax.GradientTransformation, schedule=None):
    """``train_step`` jitted for ``loss_fn`` and ``tx``; the state is donated, the frozen tree is not.
    One compile per batch shape (length bucket)."""
    return jax.jit(functools.partial(train_step, loss_fn=loss_fn, tx=tx, schedule=schedule), donate_argnums=(0,))


def make_eval_step(loss_fn: LossFn):
    return jax.jit(functools.partial(eval_step, loss_fn=loss_fn))
