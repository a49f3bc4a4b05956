"""MoR's SFT objective (paper Eq. 8) as one pure, jit-able function of separate trainable and frozen trees.

``sft_loss(trainable, frozen, batch, model_cfg, mor_cfg, *, alpha_balance, alpha_orth)`` runs the
training forward with the MoR adapter (``morse_jax.mor.adapter.MoRInputs``: the batch's per-token
role ids), takes the router logits the adapter hands back through the forward
(``transformer.forward(..., with_aux=True)``: {target: [L, B, T, ΣE_r]}), and combines
``morse_jax.mor.losses``: role-masked CE + α1 · balance + α2 · orthogonality. Aggregation over the
wrapped linears (formulas: ``losses`` docstring): the balance loss stacks every (layer, target)
router of a role on one axis and averages over it; the orthogonality loss averages over layers
within a target, then over targets (every target spans the same layers, so this is the mean over
wrapped linears); both sum over roles.

The backbone enters under ``stop_gradient``: differentiating with respect to ``frozen`` gives
exact zeros, so gradients reach only ``trainable``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from morse_jax.models.config import ModelConfig
from morse_jax.models.transformer import forward, lm_head
from morse_jax.mor.adapter import MoRInputs
from morse_jax.mor.batch import NO_ROLE, SFTBatch
from morse_jax.mor.config import MoRConfig
from morse_jax.mor.losses import (ALPHA_BALANCE, ALPHA_ORTH, balance_loss, orthogonality_loss, role_ce, router_stats,
                                  target_ce)
from morse_jax.mor.params import routed_factors


def role_router_logits(aux: dict, cfg: MoRConfig) -> list[jax.Array | None]:
    """Per role, its routers' logits at every wrapped linear, float32 [L · targets, B, T, E_r]
    (None for a role without routed LoRAs), from the forward's aux {target: [L, B, T, ΣE_r]}."""
    out = []
    for r, e in enumerate(cfg.routed):
        start = cfg.router_offset(r)
        out.append(None if e == 0 else jnp.concatenate([aux[t][..., start:start + e] for t in sorted(aux)]))
    return out


def balance_term(aux: dict, role_ids: jax.Array, cfg: MoRConfig) -> jax.Array:
    """L_aux: per role with routers, ``losses.balance_loss`` on its tokens; summed over roles (as
    ``losses.mor_balance_loss``, which needs every role to have routers)."""
    terms = [balance_loss(lg, role_ids == r, cfg.top_k[r])
             for r, lg in enumerate(role_router_logits(aux, cfg)) if lg is not None]
    return sum(terms, jnp.zeros((), jnp.float32))


def orthogonality_term(params: dict, cfg: MoRConfig) -> jax.Array:
    """L_orth: per role with >= 2 routed LoRAs, the mean over targets of ``losses.orthogonality_loss``
    (itself a mean over layers and pairs); summed over roles."""
    total = jnp.zeros((), jnp.float32)
    for r, e in enumerate(cfg.routed):
        if e >= 2:
            per_target = [orthogonality_loss(a, b) for a, b in routed_factors(params, cfg, r).values()]
            total = total + sum(per_target) / len(per_target)
    return total


def first_adapted_layer(model_cfg: ModelConfig, mor_cfg: MoRConfig) -> int:
    """Index of the first layer the adapter wraps (0 when it wraps every layer)."""
    return model_cfg.num_layers - mor_cfg.adapted_layers(model_cfg.num_layers)


def frozen_prefix(frozen: dict, batch: SFTBatch, model_cfg: ModelConfig, mor_cfg: MoRConfig) -> jax.Array:
    """The residual stream entering the first adapted layer, float[B, T, d]: the frozen layers
    below it, which carry no adapter and see no role ids, run once on the batch's tokens (with its
    positions, padding and packing). ``sft_loss`` on a batch carrying it as ``prefix_hidden``
    equals ``sft_loss`` on the batch without it. ``frozen`` is split as for ``sft_loss``; the
    adapter must leave at least one layer below it (else there is no prefix to keep)."""
    start = first_adapted_layer(model_cfg, mor_cfg)
    if start == 0:
        raise ValueError("frozen_prefix: the adapter wraps every layer, so there is no frozen prefix")
    hidden, _ = forward(frozen, model_cfg, batch.tokens, positions=batch.positions, valid=batch.valid,
                        segment_ids=batch.segment_ids, stop_layer=start)
    return hidden


def sft_loss(trainable: dict, frozen: dict, batch: SFTBatch, model_cfg: ModelConfig, mor_cfg: MoRConfig, *,
             alpha_balance: float = ALPHA_BALANCE, alpha_orth: float = ALPHA_ORTH) -> tuple[jax.Array, dict]:
    """The SFT loss of one micro-batch and its metrics.

    Args:
      trainable: MoR params (``morse_jax.mor.params.init_mor_params``), over the last
        ``mor_cfg.adapted_layers`` layers.
      frozen: backbone params (``models.transformer``); when only some layers are adapted, their
        segments must already be split off (``models.transformer.split_segments(frozen, L)``).
      batch: the rendered trajectories (role ids, loss mask, packing); with ``prefix_hidden``
        (:func:`frozen_prefix`) only the adapted layers run.
      model_cfg, mor_cfg: static.
      alpha_balance, alpha_orth: α1, α2 (the terms are left out when ``mor_cfg.use_balance`` /
        ``use_orth`` is False, when there are no routers, or for plain LoRA).
    Returns:
      (float32 loss, metrics): {"loss", "ce", "tokens", "ce/<role>", "acc/<role>", "tokens/<role>",
      "balance", "orth", and per routed role "router/<role>/entropy", "router/<role>/load<i>"},
      float32 scalars, stop-gradient'ed.
    """
    batch.check()
    role_ids = jnp.where(batch.valid, batch.role_ids, NO_ROLE)
    frozen = jax.lax.stop_gradient(frozen)
    start = {} if batch.prefix_hidden is None else dict(
        start_layer=first_adapted_layer(model_cfg, mor_cfg), hidden=jax.lax.stop_gradient(batch.prefix_hidden))
    gather = batch.logit_index is not None
    out, _, aux = forward(frozen, model_cfg, batch.tokens, positions=batch.positions, valid=batch.valid,
                          segment_ids=batch.segment_ids, lora=MoRInputs(trainable, role_ids, mor_cfg),
                          with_aux=True, logits_mode="hidden" if gather else "all", **start)
    if gather:  # the LM head at the positions that predict a target only
        idx = batch.logit_index  # [B, C]
        hidden = jnp.take_along_axis(out, idx[..., None], axis=1)  # [B, C, d]
        nxt = idx + 1  # the predicted tokens' positions
        take = lambda a: jnp.take_along_axis(a, nxt, axis=1)  # noqa: E731
        mask = batch.logit_mask & take(batch.loss_mask & batch.valid)
        ce, metrics = target_ce(lm_head(frozen, model_cfg, hidden), take(batch.tokens), mask, take(role_ids),
                                mor_cfg.role_names)
    else:
        ce, metrics = role_ce(out, batch.tokens, batch.loss_mask & batch.valid, role_ids, mor_cfg.role_names)
    zero = jnp.zeros((), jnp.float32)
    balance = balance_term(aux, role_ids, mor_cfg) if aux else zero
    is_mor = mor_cfg.kind == "mor"
    orth = orthogonality_term(trainable, mor_cfg) if is_mor and max(mor_cfg.routed) >= 2 else zero
    loss = ce
    if mor_cfg.use_balance and aux:
        loss = loss + alpha_balance * balance
    if mor_cfg.use_orth and is_mor:
        loss = loss + alpha_orth * orth
    metrics = dict(metrics, loss=loss, balance=balance, orth=orth)
    if aux:
        for r, lg in enumerate(role_router_logits(aux, mor_cfg)):
            if lg is None:
                continue
            name = mor_cfg.role_names[r]
            stats = router_stats(lg, role_ids == r, mor_cfg.top_k[r])
            metrics[f"router/{name}/entropy"] = stats["entropy"]
            for i in range(lg.shape[-1]):
                metrics[f"router/{name}/load{i}"] = stats["load"][i]
    return loss, jax.lax.stop_gradient(metrics)
