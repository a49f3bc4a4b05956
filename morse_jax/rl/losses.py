"""HGRPO loss terms as pure functions over arrays.

Sign convention: every ``*_loss`` returns a scalar to MINIMISE (the negated
surrogate objective). Regularisers (``routing_entropy``, ``prototype_orthogonality``,
``kl_to_base``) return the raw quantity; the caller applies the weights and
signs (entropy is a bonus: subtract ``0.02 * entropy``; orthogonality is a
penalty: add ``0.05 * penalty``; KL: add ``beta * kl``).

Aggregation over a candidate's tokens (``normalisation``, config
``train.loss_normalisation``), then summed over candidates, so a node's loss is
sum_{b,m} A[b,m] * (aggregated surrogate of candidate (b,m)) as in the sum over
candidates of paper Eq. 7 and the flat sum over routes of Eq. 8:

* ``"sequence_mean"`` (default): the mean over the candidate's generated tokens,
  (1/|y|) sum_t; what the authors' code does (``logp_sum / gen_len``) and the
  GRPO objective the paper says it follows ("Following GRPO [28]"). Every
  candidate weighs the same whatever its length.
* ``"sequence_sum"``: the sum over its tokens, sum_t = log p(y) at ratio 1; Eq. 7
  as written (``A * log p(y | ...)``). Long candidates weigh more.

Invalid (skipped) groups carry zero advantages and therefore contribute nothing.

All log-probabilities are computed in float32 regardless of the input dtype.
Metrics are stop-gradient'ed. Nothing here is jitted: the functions run inside the jitted update
step (``rl.update``), which is compiled once; jit them yourself to call them alone.
"""

from __future__ import annotations

from typing import Optional

import chex
import jax
import jax.numpy as jnp

# The regularisers live with the router they regularise; re-exported as part of the loss API.
from morse_jax.mole.router import prototype_orthogonality, routing_entropy  # noqa: F401

NORMALISATIONS = ("sequence_mean", "sequence_sum")

__all__ = [
    "NORMALISATIONS",
    "masked_sequence_mean",
    "ppo_clip_token_loss",
    "router_loss",
    "routing_entropy",
    "prototype_orthogonality",
    "kl_to_base",
]


def _f32(x) -> jax.Array:
    return jnp.asarray(x, jnp.float32)


def _check_eps(name: str, value) -> None:
    if isinstance(value, jax.core.Tracer):
        return
    if not (jnp.ndim(value) == 0 and 0 < value):
        raise ValueError(f"{name}: must be a scalar > 0, got {value!r}")


def masked_sequence_mean(x, mask) -> jax.Array:
    """float[N] per-sequence mean of x[N, T] over positions where mask[N, T] != 0.

    A sequence with no generated tokens has mean 0 (it contributes nothing)."""
    chex.assert_rank([x, mask], 2)
    chex.assert_equal_shape([x, mask])
    m = _f32(mask)
    count = jnp.sum(m, axis=-1)
    return jnp.sum(_f32(x) * m, axis=-1) / jnp.maximum(count, 1.0)


def _check_normalisation(normalisation) -> None:
    if normalisation not in NORMALISATIONS:
        raise ValueError(f"normalisation: must be one of {NORMALISATIONS}, got {normalisation!r}")


def _per_sequence(x, mask, normalisation: str) -> jax.Array:
    """float[N]: x[N, T] aggregated over each sequence's masked positions (see module docstring)."""
    if normalisation == "sequence_sum":
        return jnp.sum(_f32(x) * _f32(mask), axis=-1)
    return masked_sequence_mean(x, mask)


def _masked_token_mean(x, mask) -> jax.Array:
    m = _f32(mask)
    return jnp.sum(_f32(x) * m) / jnp.maximum(jnp.sum(m), 1.0)


def _k3(log_ratio) -> jax.Array:
    # k3 = r - 1 - log r with log r = log_ratio (Schulman's low-variance, always >= 0 estimator).
    # For tokens drawn from q and r = p / q: E_q[r] = 1, so E_q[k3] = E_q[log q - log p] = KL(q || p).
    return jnp.expm1(log_ratio) - log_ratio


def ppo_clip_token_loss(new_logp, old_logp, mask, advantages, *, eps: float = 0.2,
                        eps_high: Optional[float] = None, normalisation: str = "sequence_mean"):
    """Token-level PPO-clip loss for candidates with per-sequence advantages.

    Args:
      new_logp: float[N, T] log p(token) under the current parameters
        (differentiated).
      old_logp: float[N, T] log p(token) under the sampling (behaviour) policy;
        treated as a constant.
      mask: [N, T] 1 (or True) on generated tokens, 0 on prompt/padding.
      advantages: float[N] one advantage per sequence (e.g. HGRPO ``within``
        flattened), broadcast over its tokens; treated as a constant.
      eps: lower clip range, ratio >= 1 - eps.
      eps_high: upper clip range, ratio <= 1 + eps_high (defaults to eps).
      normalisation: static; "sequence_mean" or "sequence_sum" (module docstring).

    Returns:
      (loss, metrics): loss = -sum_n agg_{t in mask_n} min(r A_n, clip(r) A_n)
      with r = exp(new - old) and agg the token mean (or sum) of sequence n, a
      float32 scalar to minimise. metrics (float32 scalars, token means over the
      mask): ``clip_fraction`` (tokens whose gradient is zeroed by clipping),
      ``approx_kl`` (k3 estimate of KL(old || new): the tokens were drawn from
      the old policy, so r - 1 - log r with r = p_new / p_old is unbiased for
      it), ``ratio_mean``.
    """
    eps_high = eps if eps_high is None else eps_high
    _check_eps("eps", eps)
    _check_eps("eps_high", eps_high)
    _check_normalisation(normalisation)
    return _ppo_core(new_logp, old_logp, mask, advantages, eps, eps_high, normalisation)


def _ppo_core(new_logp, old_logp, mask, advantages, eps, eps_high, normalisation):
    chex.assert_rank([new_logp, old_logp, mask, advantages], [2, 2, 2, 1])
    chex.assert_equal_shape([new_logp, old_logp, mask])
    chex.assert_equal_shape_prefix([new_logp, advantages], 1)

    new_logp = _f32(new_logp)
    old_logp = jax.lax.stop_gradient(_f32(old_logp))
    adv = jax.lax.stop_gradient(_f32(advantages))[:, None]
    log_ratio = new_logp - old_logp
    ratio = jnp.exp(log_ratio)
    surrogate = jnp.minimum(ratio * adv,
                            jnp.clip(ratio, 1.0 - eps, 1.0 + eps_high) * adv)
    loss = -jnp.sum(_per_sequence(surrogate, mask, normalisation))

    ratio_sg = jax.lax.stop_gradient(ratio)
    clipped = ((ratio_sg > 1.0 + eps_high) & (adv > 0)) | ((ratio_sg < 1.0 - eps) & (adv < 0))
    metrics = {
        "clip_fraction": _masked_token_mean(clipped, mask),
        "approx_kl": _masked_token_mean(_k3(jax.lax.stop_gradient(log_ratio)), mask),
        "ratio_mean": _masked_token_mean(ratio_sg, mask),
    }
    return loss, metrics


def router_loss(new_set_logp, old_set_logp, advantages, *, alpha_pi: float = 0.15,
                eps: float = 0.2, reinforce: bool = False):
    """Router loss on the log-probability of each sampled expert set (Eq. 8).

    Args:
      new_set_logp: float[R] log pi(E_s^(b) | s_i) under the current router
        (differentiated), one per sampled route.
      old_set_logp: float[R] the same under the router that sampled the routes.
      advantages: float[R] cross-route advantages (HGRPO ``cross``).
      alpha_pi: router/LoRA balance weight.
      eps: symmetric PPO clip range.
      reinforce: static bool. True: alpha_pi * sum_b -A_b * log pi_b (plain
        REINFORCE, used on the first epoch); its gradient equals the PPO one at
        ratio 1. False: -alpha_pi * sum_b min(r_b A_b, clip(r_b) A_b), r_b =
        exp(new - old).

    Returns:
      (loss, metrics) with loss a float32 scalar to minimise; metrics
      ``clip_fraction`` and ``ratio_mean`` (means over routes).
    """
    if not isinstance(reinforce, bool):
        raise ValueError(f"reinforce: must be a Python bool, got {reinforce!r}")
    _check_eps("eps", eps)
    if not isinstance(alpha_pi, jax.core.Tracer) and not (jnp.ndim(alpha_pi) == 0
                                                           and alpha_pi >= 0):
        raise ValueError(f"alpha_pi: must be a scalar >= 0, got {alpha_pi!r}")
    return _router_core(new_set_logp, old_set_logp, advantages, alpha_pi, eps, reinforce)


def _router_core(new_set_logp, old_set_logp, advantages, alpha_pi, eps, reinforce):
    chex.assert_rank([new_set_logp, old_set_logp, advantages], 1)
    chex.assert_equal_shape([new_set_logp, old_set_logp, advantages])

    new = _f32(new_set_logp)
    old = jax.lax.stop_gradient(_f32(old_set_logp))
    adv = jax.lax.stop_gradient(_f32(advantages))
    ratio = jnp.exp(new - old)
    if reinforce:
        loss = alpha_pi * jnp.sum(-adv * new)
    else:
        surrogate = jnp.minimum(ratio * adv, jnp.clip(ratio, 1.0 - eps, 1.0 + eps) * adv)
        loss = -alpha_pi * jnp.sum(surrogate)
    ratio_sg = jax.lax.stop_gradient(ratio)
    clipped = ((ratio_sg > 1.0 + eps) & (adv > 0)) | ((ratio_sg < 1.0 - eps) & (adv < 0))
    metrics = {
        "clip_fraction": jnp.mean(clipped.astype(jnp.float32)),
        "ratio_mean": jnp.mean(ratio_sg),
    }
    return loss, metrics


def kl_to_base(new_logp, base_logp, mask, normalisation: str = "sequence_mean") -> jax.Array:
    """k3 estimate of KL(new || base) on sampled tokens, aggregated like the PPO loss.

    Args:
      new_logp: float[N, T] log-probs of the sampled tokens under the current
        parameters (differentiated).
      base_logp: float[N, T] the same under the frozen base model (constant).
      mask: [N, T] generated-token mask.
      normalisation: static, as in :func:`ppo_clip_token_loss`.

    Returns:
      float32 scalar: sum_n agg_{t in mask_n} [exp(b - n) - (b - n) - 1], the
      per-token k3 estimator of DeepSeekMath GRPO (tokens from the current
      policy, r = p_base / p_new), aggregated over each sequence's tokens like
      the PPO loss then summed over sequences, so that
      ``ppo_clip_token_loss(...)[0] + beta * kl_to_base(...)`` is the GRPO
      objective. beta (0 by default) is applied by the caller.
    """
    chex.assert_rank([new_logp, base_logp, mask], 2)
    chex.assert_equal_shape([new_logp, base_logp, mask])
    _check_normalisation(normalisation)
    log_ratio = jax.lax.stop_gradient(_f32(base_logp)) - _f32(new_logp)
    return jnp.sum(_per_sequence(_k3(log_ratio), mask, normalisation))
