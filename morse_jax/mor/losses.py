"""MoR's training losses as pure functions: role-masked cross-entropy, the routers' balance loss, the
orthogonality loss between a group's routed LoRAs, and router statistics.

Total (paper Eq. 8): ``L = L_CE + α1 · L_aux + α2 · L_orth`` with α1 = ALPHA_BALANCE = 1e-3 and
α2 = ALPHA_ORTH = 1e-4 (paper §4.2). The paper gives neither auxiliary formula (nor does the authors'
released layer); the choices below follow the paper's citations and are documented here.

Notation: role r has E_r routed LoRAs and keeps the top k_r router weights per token; its router
sees the input of every wrapped linear ℓ (ℓ runs over layers × target projections, stacked on a
leading axis L); T_r = the tokens whose role id is r, n_r = |T_r|.

* Role-masked CE: next-token cross-entropy (float32 log-softmax) averaged over the target tokens
  (loss mask; in practice the role turns' tokens), one mean over all roles; per-role CE and token
  accuracy are metrics (the paper's Fig. 4 tracks per-role loss).
* Balance, Switch-Transformer style (the paper cites Fedus et al. 2022): per router ℓ and role r,
  p_{t,i} = softmax(router logits)_i before top-k, s_{t,i} = 1 if expert i is among the token's top
  k_r, f_i = Σ_{t∈T_r} s_{t,i} / (n_r k_r) (fraction of routing slots), P_i = Σ_{t∈T_r} p_{t,i} / n_r,
  ``L_aux(ℓ, r) = E_r Σ_i f_i P_i`` (= 1 at perfect balance, up to E_r/k_r when collapsed). Gradient
  flows through P only (f is a count). Only role-r tokens count (the router of role r only acts on
  them). Aggregation: mean over ℓ, sum over roles; a role with no token in the batch adds 0.
* Orthogonality (the paper: "LoRAs of a group learn different directions", Fig. 5 compares the
  products B·A): for routed LoRAs i < j of one group at one wrapped linear, with ΔW_i = A_i B_i
  (layout x @ A @ B: A [d_in, r], B [r, d_out]),
  ``c_ij² = <ΔW_i, ΔW_j>_F² / (‖ΔW_i‖_F² ‖ΔW_j‖_F² + ε)``, ``L_orth(ℓ, r) = mean_{i<j} c_ij²``;
  aggregation: mean over ℓ, sum over roles. ΔW is never materialised:
  ``<A_i B_i, A_j B_j>_F = tr(B_iᵀ A_iᵀ A_j B_j) = Σ_{s,u} (A_iᵀ A_j)_{su} (B_i B_jᵀ)_{su}``, two r×r
  Gram blocks per pair. ε = ORTH_EPS = 1e-12 fades the loss in: at B = 0 (B's initial value) the
  loss and its gradient are 0, and while ‖ΔW_i‖²‖ΔW_j‖² ≲ ε the gradient stays bounded (the exact
  cosine's gradient grows as 1/‖B‖ near B = 0, which would swamp the CE gradient in the first steps);
  trained updates (‖ΔW‖² ~ 1e-4 and up) are far above it. The shared LoRA is excluded (the paper's
  Fig. 5 shows routed LoRAs).
* Router statistics per role: load (fraction of top-k slots per expert, sums to 1), importance (mean
  pre-top-k probability per expert), mean per-token entropy of the router distribution (nats).
"""

from __future__ import annotations

import functools
from typing import Sequence

import chex
import jax
import jax.numpy as jnp

from morse_jax.mor.topk import topk_mask

ALPHA_BALANCE = 1e-3  # α1, paper §4.2
ALPHA_ORTH = 1e-4  # α2, paper §4.2
ORTH_EPS = 1e-12  # ε of the squared cosine's denominator ‖ΔW_i‖²‖ΔW_j‖² + ε (module docstring)


def _f32(x) -> jax.Array:
    return jnp.asarray(x, jnp.float32)


# --------------------------------------------------------------------------- cross-entropy


@functools.partial(jax.jit, static_argnames=("role_names",))
def role_ce(logits, tokens, loss_mask, role_ids, role_names: tuple[str, ...]) -> tuple[jax.Array, dict]:
    """Next-token cross-entropy on the masked target tokens, with per-role metrics.

    Args:
      logits: float[B, T, V]; ``logits[:, t]`` predicts ``tokens[:, t + 1]``.
      tokens: int[B, T].
      loss_mask: bool[B, T], True where the token is a target (its prediction is scored).
      role_ids: int[B, T], index into ``role_names`` of each token's role, -1 for none.
      role_names: the role names, e.g. ("reasoner", "executor", "summarizer").

    Returns:
      (loss, metrics): loss = float32 mean NLL over all target tokens (0 when there are none);
      metrics {"ce", "tokens", "ce/<role>", "acc/<role>", "tokens/<role>"} as float32 scalars
      (a role with no target token reports ce = acc = 0 and tokens = 0), stop-gradient'ed.
    """
    chex.assert_rank(logits, 3)
    chex.assert_rank([tokens, loss_mask, role_ids], 2)
    chex.assert_equal_shape([tokens, loss_mask, role_ids])
    chex.assert_equal_shape_prefix([logits, tokens], 2)
    return target_ce(logits[:, :-1], tokens[:, 1:], loss_mask[:, 1:], role_ids[:, 1:], role_names)


@functools.partial(jax.jit, static_argnames=("role_names",))
def target_ce(logits, targets, mask, roles, role_names: tuple[str, ...]) -> tuple[jax.Array, dict]:
    """:func:`role_ce` on predictions already aligned with their targets: ``logits[b, c]``
    (float[B, C, V]) predicts ``targets[b, c]`` (int[B, C]); ``mask`` bool[B, C] says which entries
    count; ``roles`` int[B, C] is each target token's role. C may be every position (``role_ce``)
    or only the positions that predict a target (``SFTBatch.logit_index``): the LM head then runs
    on those alone. Same returns as :func:`role_ce`."""
    chex.assert_rank(logits, 3)
    chex.assert_equal_shape([targets, mask, roles])
    chex.assert_equal_shape_prefix([logits, targets], 2)
    logp = jax.nn.log_softmax(_f32(logits), axis=-1)
    nll = -jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
    mask = _f32(mask)
    count = jnp.sum(mask)
    loss = jnp.sum(nll * mask) / jnp.maximum(count, 1.0)
    correct = _f32(jnp.argmax(logp, axis=-1) == targets)
    metrics = {"ce": loss, "tokens": count}
    for i, name in enumerate(role_names):
        m = mask * _f32(roles == i)
        n = jnp.sum(m)
        metrics[f"ce/{name}"] = jnp.sum(nll * m) / jnp.maximum(n, 1.0)
        metrics[f"acc/{name}"] = jnp.sum(correct * m) / jnp.maximum(n, 1.0)
        metrics[f"tokens/{name}"] = n
    return loss, jax.lax.stop_gradient(metrics)


# --------------------------------------------------------------------------- routers


def _topk_slots(probs, k: int) -> jax.Array:
    """float[..., E] 1 where the expert is among the token's top k (ties: lowest index first)."""
    return topk_mask(probs, k).astype(jnp.float32)


def _check_router(router_logits, token_mask, k: int) -> None:
    chex.assert_rank(router_logits, 4)
    chex.assert_rank(token_mask, 2)
    chex.assert_equal_shape_prefix([router_logits[0], token_mask], 2)
    if not 1 <= k <= router_logits.shape[-1]:
        raise ValueError(f"top_k must be in [1, {router_logits.shape[-1]}] (the group's routed LoRAs), got {k}")


@functools.partial(jax.jit, static_argnames=("k",))
def balance_loss(router_logits, token_mask, k: int) -> jax.Array:
    """Switch-style load-balance loss of one role's routers (formula in the module docstring).

    Args:
      router_logits: float[L, B, T, E] logits of the role's router at each of L wrapped linears.
      token_mask: bool[B, T], True on the role's tokens.
      k: routed LoRAs kept per token.
    Returns: float32 scalar, mean over L of ``E Σ_i f_i P_i``; 0 when the mask is empty.
    """
    _check_router(router_logits, token_mask, k)
    probs = jax.nn.softmax(_f32(router_logits), axis=-1)
    m = _f32(token_mask)[None, ..., None]
    n = jnp.maximum(jnp.sum(_f32(token_mask)), 1.0)
    f = jax.lax.stop_gradient(jnp.sum(_topk_slots(probs, k) * m, axis=(1, 2)) / (n * k))  # [L, E]
    p = jnp.sum(probs * m, axis=(1, 2)) / n  # [L, E]
    return jnp.mean(router_logits.shape[-1] * jnp.sum(f * p, axis=-1))


def mor_balance_loss(router_logits: Sequence, role_ids, top_k: Sequence[int]) -> jax.Array:
    """L_aux: sum over roles of ``balance_loss`` on each role's tokens.

    Args:
      router_logits: per role r, float[L, B, T, E_r] (every router sees every token; only role-r
        tokens count for role r).
      role_ids: int[B, T], the role index of each token, -1 for none.
      top_k: per role, the routed LoRAs kept per token.
    """
    if len(router_logits) != len(top_k):
        raise ValueError(f"one top_k per role: {len(router_logits)} routers, {len(top_k)} top_k values")
    return sum(balance_loss(lg, role_ids == r, k) for r, (lg, k) in enumerate(zip(router_logits, top_k)))


@functools.partial(jax.jit, static_argnames=("k",))
def router_stats(router_logits, token_mask, k: int) -> dict:
    """Statistics of one role's routers over its tokens, averaged over the L wrapped linears.

    Returns {"load": float[E] (fraction of top-k slots, sums to 1 when the mask is non-empty),
    "importance": float[E] (mean probability), "entropy": float scalar (mean per-token entropy of
    the router distribution, nats), "tokens": float scalar}, stop-gradient'ed.
    """
    _check_router(router_logits, token_mask, k)
    probs = jax.nn.softmax(_f32(router_logits), axis=-1)
    m = _f32(token_mask)
    n = jnp.maximum(jnp.sum(m), 1.0)
    mm = m[None, ..., None]
    load = jnp.sum(_topk_slots(probs, k) * mm, axis=(1, 2)) / (n * k)
    importance = jnp.sum(probs * mm, axis=(1, 2)) / n
    ent = -jnp.sum(probs * jnp.log(jnp.maximum(probs, 1e-30)), axis=-1)  # [L, B, T]
    entropy = jnp.sum(ent * m[None], axis=(1, 2)) / n
    return jax.lax.stop_gradient({"load": jnp.mean(load, 0), "importance": jnp.mean(importance, 0),
                                  "entropy": jnp.mean(entropy), "tokens": jnp.sum(m)})


# --------------------------------------------------------------------------- orthogonality


@jax.custom_vjp
def gram_blocks(x) -> jax.Array:
    """The r×r blocks of the Gram matrix of E stacked factors: ``G[..., i, j] = X_iᵀ X_j``.

    x: float[..., E, n, r] -> float[..., E, E, r, r] (n contracted). The gradient is written out
    (``dX_i = Σ_j X_j (dG_ji + dG_ijᵀ)``: one product) because autodiff treats the two operands
    of ``X_iᵀ X_j`` as distinct and spends two products of the forward's size; this is the
    orthogonality loss's dominant cost (n = d_in or d_out, E·r columns).
    """
    return jnp.einsum("...idr,...jds->...ijrs", x, x)


def _gram_fwd(x):
    return gram_blocks(x), x


def _gram_bwd(x, g):
    sym = g + jnp.swapaxes(jnp.swapaxes(g, -4, -3), -2, -1)  # dG_kjts + dG_jkst
    return (jnp.einsum("...kjts,...jds->...kdt", sym, x),)


gram_blocks.defvjp(_gram_fwd, _gram_bwd)


@jax.jit
def lora_cosine_sq(a, b, eps: float = ORTH_EPS) -> jax.Array:
    """Squared cosine similarity between the LoRA updates ΔW_i = A_i B_i of E LoRAs.

    Args:
      a: float[..., E, d_in, r]; b: float[..., E, r, d_out] (leading axes: e.g. layers, targets).
      eps: ε of the denominator (module docstring).
    Returns: float32[..., E, E], ``<ΔW_i, ΔW_j>² / (‖ΔW_i‖² ‖ΔW_j‖² + eps)`` from r×r Gram blocks.
    """
    chex.assert_rank(a, b.ndim)
    if a.ndim < 3 or a.shape[:-2] != b.shape[:-2] or a.shape[-1] != b.shape[-2]:
        raise ValueError(f"lora_cosine_sq: expected a [..., E, d_in, r] and b [..., E, r, d_out], got "
                         f"{a.shape} and {b.shape}")
    a, b = _f32(a), _f32(b)
    gram_a = gram_blocks(a)  # A_iᵀ A_j
    gram_b = gram_blocks(jnp.swapaxes(b, -1, -2))  # B_i B_jᵀ
    inner = jnp.einsum("...ijrs,...ijrs->...ij", gram_a, gram_b)  # <ΔW_i, ΔW_j>_F
    sq = jnp.diagonal(inner, axis1=-2, axis2=-1)  # ‖ΔW_i‖²
    return inner ** 2 / (sq[..., :, None] * sq[..., None, :] + eps)


@jax.jit
def orthogonality_loss(a, b, eps: float = ORTH_EPS) -> jax.Array:
    """One group's L_orth: mean over pairs i < j of c_ij², averaged over the leading axes.

    Args: a float[..., E, d_in, r], b float[..., E, r, d_out] (the group's routed LoRAs, E >= 2).
    """
    c2 = lora_cosine_sq(a, b, eps)
    e = c2.shape[-1]
    if e < 2:
        raise ValueError(f"orthogonality_loss: needs at least 2 routed LoRAs, got {e}")
    iu = jnp.triu_indices(e, k=1)
    return jnp.mean(c2[..., iu[0], iu[1]])


def mor_orthogonality_loss(groups: Sequence[tuple], eps: float = ORTH_EPS) -> jax.Array:
    """L_orth: sum over role groups of ``orthogonality_loss`` (each a mean over its wrapped linears).

    Args: groups: per role, (a float[L, E_r, d_in, r], b float[L, E_r, r, d_out]) of its routed LoRAs.
    """
    return sum(orthogonality_loss(a, b, eps) for a, b in groups)


def total_loss(ce, aux, orth, *, alpha_balance: float = ALPHA_BALANCE, alpha_orth: float = ALPHA_ORTH):
    """Paper Eq. 8: ``ce + alpha_balance * aux + alpha_orth * orth``."""
    return ce + alpha_balance * aux + alpha_orth * orth
