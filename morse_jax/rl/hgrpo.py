"""Group-relative advantages: hierarchical (HGRPO, paper Eq. 6) and flat GRPO.

All functions are pure, jittable and vmappable. Rewards may carry any number of
leading axes (e.g. ``[nodes, B, M]``); the group statistics are taken over the
trailing axes only.

Statistics follow the paper and DESIGN §2/§5: population standard deviations
(ddof=0), ``eps`` added to the std in the denominator, advantages clipped to
``±clip`` after normalisation, and a group whose reward std is below
``min_std`` yields zero advantages and is reported invalid ("skipped").

Non-finite rewards cannot be detected inside a trace without changing the
computation, so the public functions validate concrete (host or device) arrays
eagerly and skip the check on tracers. Host code that jits or vmaps these
functions should call :func:`check_rewards` on the rewards before the call.
"""

from __future__ import annotations

from typing import Callable, NamedTuple, Optional

import chex
import jax
import jax.numpy as jnp
import numpy as np

__all__ = [
    "HGRPOAdvantages",
    "ADVANTAGE_FNS",
    "check_rewards",
    "hgrpo_advantages",
    "grpo_advantages",
    "grpo_valid",
    "flat_grpo_hierarchical",
    "get_advantage_fn",
]


class HGRPOAdvantages(NamedTuple):
    """Advantages of one (or a batch of) HGRPO node(s).

    Attributes (``...`` = any leading axes of the rewards):
      within: float[..., B, M] within-route advantages (train the LoRA experts).
      cross: float[..., B] cross-route advantages (train the router).
      within_valid: bool[..., B] False where the route's reward std < min_std
        (its ``within`` row is all zeros; the route is counted as skipped).
      cross_valid: bool[...] False where the std of the route means < min_std
        (``cross`` is all zeros; the router gets no update from this node).
      A group containing NaN/inf (possible only when the eager finiteness check
      was bypassed by tracing) is reported valid and yields NaN advantages, so
      the problem surfaces in the loss rather than as a silent skip.
    """

    within: jax.Array
    cross: jax.Array
    within_valid: jax.Array
    cross_valid: jax.Array


def _is_tracer(x) -> bool:
    return isinstance(x, jax.core.Tracer)


def check_rewards(rewards, *, name: str = "rewards", min_ndim: int = 1) -> None:
    """Raises ValueError unless ``rewards`` is a finite real array of rank >= min_ndim.

    Call this on the host before handing rewards to a jitted/vmapped step: inside
    a trace the values are unknown and the public functions skip the check.
    Tracers are accepted silently (only their rank and dtype are checked).
    """
    if _is_tracer(rewards):
        arr_ndim, dtype = rewards.ndim, rewards.dtype
    else:
        try:
            host = np.asarray(rewards)
        except Exception as exc:  # e.g. ragged lists
            raise ValueError(f"{name}: cannot convert to an array ({exc})") from exc
        arr_ndim, dtype = host.ndim, host.dtype
    if not (jnp.issubdtype(dtype, jnp.floating) or jnp.issubdtype(dtype, jnp.integer)
            or jnp.issubdtype(dtype, jnp.bool_)):
        raise ValueError(f"{name}: expected a real numeric array, got dtype {dtype}")
    if arr_ndim < min_ndim:
        raise ValueError(f"{name}: expected at least {min_ndim} axes, got shape "
                         f"{tuple(np.shape(rewards))}")
    if _is_tracer(rewards):
        return
    if host.size and jnp.issubdtype(dtype, jnp.floating):
        bad = ~np.isfinite(host)
        if bad.any():
            idx = [tuple(int(i) for i in ix) for ix in np.argwhere(bad)[:5]]
            raise ValueError(
                f"{name}: {int(bad.sum())} non-finite value(s) (NaN/inf) at index "
                f"{idx}{' ...' if bad.sum() > 5 else ''}; fix the verifier output "
                "rather than training on it")


def _check_hparams(eps, clip, min_std, normalize=True) -> None:
    if not isinstance(normalize, bool):
        raise ValueError(f"normalize: must be a Python bool, got {normalize!r}")
    for field, value in (("eps", eps), ("min_std", min_std)):
        if not _is_tracer(value) and not (np.ndim(value) == 0 and value >= 0):
            raise ValueError(f"{field}: must be a scalar >= 0, got {value!r}")
    if clip is not None and not _is_tracer(clip) and not (np.ndim(clip) == 0 and clip > 0):
        raise ValueError(f"clip: must be a scalar > 0 or None, got {clip!r}")


def _as_float(rewards) -> jax.Array:
    r = jnp.asarray(rewards)
    if not jnp.issubdtype(r.dtype, jnp.floating):
        r = r.astype(jnp.float32)
    return r


def _standardise(x: jax.Array, *, eps, clip, min_std, normalize: bool):
    """(x - mean) / (std + eps) over the last axis; zero and invalid where std < min_std."""
    axis = -1
    mean = jnp.mean(x, axis=axis, keepdims=True)
    centred = x - mean
    # Population std (ddof=0) as in the authors' code, two-pass for stability.
    # A constant group can still show ~1e-8 of rounding noise (XLA may reduce
    # the mean in another order); min_std is what keeps it from being
    # normalised up to +-1.
    std = jnp.sqrt(jnp.mean(jnp.square(centred), axis=axis, keepdims=True))
    # Written as "not below" so a NaN std (non-finite rewards reaching a trace,
    # where check_rewards cannot look) stays valid and propagates NaN into the
    # loss instead of being silently skipped.
    valid = jnp.logical_not(std < min_std)
    denom = std + eps
    # Guards 0/0 when a caller turns off both eps and min_std.
    adv = centred / jnp.where(denom > 0, denom, 1.0) if normalize else centred
    if clip is not None:
        adv = jnp.clip(adv, -clip, clip)
    adv = jnp.where(valid, adv, jnp.zeros_like(adv))
    return adv, jnp.squeeze(valid, axis=axis)


def _hgrpo_core(u: jax.Array, *, eps, clip, min_std, normalize) -> HGRPOAdvantages:
    within, within_valid = _standardise(u, eps=eps, clip=clip, min_std=min_std,
                                        normalize=normalize)
    route_means = jnp.mean(u, axis=-1)
    cross, cross_valid = _standardise(route_means, eps=eps, clip=clip, min_std=min_std,
                                      normalize=normalize)
    chex.assert_equal_shape([within, u])
    chex.assert_equal_shape([cross, route_means])
    return HGRPOAdvantages(within, cross, within_valid, cross_valid)


_HPARAMS = ("eps", "clip", "min_std", "normalize")
_JITTED = {f: jax.jit(f, static_argnames=_HPARAMS) for f in (_hgrpo_core, _standardise)}


def _call(core, u, **hparams):
    """Runs ``core`` jitted with static hyper-parameters (one compile per shape
    when called eagerly, instead of one dispatch per op); hyper-parameters that
    are arrays or tracers take the plain path."""
    if all(v is None or isinstance(v, (bool, int, float)) for v in hparams.values()):
        return _JITTED[core](u, **hparams)
    return core(u, **hparams)


def hgrpo_advantages(rewards, *, eps: float = 1e-6, clip: Optional[float] = 5.0,
                     min_std: float = 5e-4, normalize: bool = True) -> HGRPOAdvantages:
    """Two-layer HGRPO credit assignment (paper Eq. 6).

    Args:
      rewards: float[..., B, M] verifier rewards u[b, m] of M candidates for each
        of B sampled routes (any leading axes, e.g. nodes).
      eps: added to each std in the denominators.
      clip: advantages are clipped to [-clip, clip] after normalising (None: off).
      min_std: a route whose reward std is below this gets zero within-advantages
        (within_valid False); likewise the cross term when std_b(mu_b) < min_std.
      normalize: divide by (std + eps). False keeps only the centring (the
        unnormalised estimator that Proposition 3.1 is stated for; also the
        "no std normalisation" ablation).

    Returns:
      HGRPOAdvantages(within[..., B, M], cross[..., B], within_valid[..., B],
      cross_valid[...]), float dtype of the rewards (float32 for integer input).

      within[b, m] = (u[b, m] - mu_b) / (sigma_b + eps),  mu_b, sigma_b over m;
      cross[b]     = (mu_b - mean_b mu_b) / (sigma_C + eps), sigma_C = std_b mu_b.
    """
    check_rewards(rewards, min_ndim=2)
    _check_hparams(eps, clip, min_std, normalize)
    return _call(_hgrpo_core, _as_float(rewards), eps=eps, clip=clip, min_std=min_std,
                 normalize=normalize)


def grpo_advantages(rewards, *, eps: float = 1e-6, clip: Optional[float] = 5.0,
                    min_std: float = 5e-4, normalize: bool = True) -> jax.Array:
    """Flat GRPO advantages: one credit group over the last axis.

    Args:
      rewards: float[..., N] rewards of N candidates in one group.
      eps, clip, min_std, normalize: as in :func:`hgrpo_advantages`.

    Returns:
      float[..., N]: (u - mean) / (std + eps), clipped; all zeros for a group
      whose std < min_std. Use :func:`grpo_valid` for the per-group flag.
    """
    check_rewards(rewards, min_ndim=1)
    _check_hparams(eps, clip, min_std, normalize)
    adv, _ = _call(_standardise, _as_float(rewards), eps=eps, clip=clip,
                   min_std=min_std, normalize=normalize)
    return adv


def grpo_valid(rewards, *, min_std: float = 5e-4) -> jax.Array:
    """bool[...] for rewards float[..., N]: True where the group's std >= min_std,
    i.e. where :func:`grpo_advantages` is not all zeros by the skip rule."""
    check_rewards(rewards, min_ndim=1)
    _check_hparams(0.0, None, min_std)
    _, valid = _call(_standardise, _as_float(rewards), eps=0.0, clip=None,
                     min_std=min_std, normalize=False)
    return valid


def flat_grpo_hierarchical(rewards, *, eps: float = 1e-6, clip: Optional[float] = 5.0,
                           min_std: float = 5e-4, normalize: bool = True
                           ) -> HGRPOAdvantages:
    """Flat GRPO in the HGRPO output layout (ablations B and C).

    All B*M candidates of a node form a single credit group, and the same
    per-candidate advantage drives both the experts and the router, as in the
    paper's "standard GRPO" baseline. Because the router's set log-probability
    is constant over a route's candidates, sum_{b,m} A[b,m] log pi(E_b) equals
    sum_b (sum_m A[b,m]) log pi(E_b), so ``cross[b] = sum_m within[b, m]``;
    with one candidate per route (ablation C: M=1) this is each candidate's own
    advantage.

    Args/returns as :func:`hgrpo_advantages`; within_valid[..., B] and
    cross_valid[...] both carry the single group's flag.
    """
    check_rewards(rewards, min_ndim=2)
    u = _as_float(rewards)
    flat = u.reshape(u.shape[:-2] + (u.shape[-2] * u.shape[-1],))
    adv = grpo_advantages(flat, eps=eps, clip=clip, min_std=min_std, normalize=normalize)
    valid = grpo_valid(flat, min_std=min_std)
    within = adv.reshape(u.shape)
    cross = jnp.sum(within, axis=-1)
    within_valid = jnp.broadcast_to(valid[..., None], cross.shape)
    return HGRPOAdvantages(within, cross, within_valid, valid)


AdvantageFn = Callable[..., HGRPOAdvantages]

# Uniform interface for the train step: fn(rewards[..., B, M], *, eps, clip,
# min_std, normalize) -> HGRPOAdvantages.
ADVANTAGE_FNS: dict[str, AdvantageFn] = {
    "hgrpo": hgrpo_advantages,
    "grpo": flat_grpo_hierarchical,
}


def get_advantage_fn(name: str) -> AdvantageFn:
    """Looks up an advantage estimator by config name ("hgrpo" or "grpo")."""
    try:
        return ADVANTAGE_FNS[name]
    except (KeyError, TypeError):
        raise ValueError(f"advantage: unknown estimator {name!r}; choose one of "
                         f"{sorted(ADVANTAGE_FNS)}") from None
