"""Prototype-based semantic subtask router (DESIGN §2 "Prototype router"; paper §3.2, App. E).

A subtask description s_i is embedded as the mean of the frozen backbone's input-token
embeddings over its first 64 real tokens, projected by a trainable affine map h_eta to D=128,
L2-normalised and compared by cosine to K_s learnable prototypes:

    z_k = cos(h_eta(s_i), p_k) / temperature,     pi(k | s_i) = softmax(z)_k.

Training draws k experts without replacement (Gumbel-top-k), inference takes the top-k. The
router's log-likelihood of a drawn *unordered* set is exact (Plackett-Luce, summed over the k!
orders); the authors' code sums the members' log-probabilities instead, which is kept here as
the opt-in `approx_set_log_prob`.

Everything is a pure function over explicit arrays, batched over N subtasks, and jittable; the
integer arguments `k` and `max_tokens` and the flags of `route` must be static under jit.

The module is longer than 400 lines because it holds one concept whole (the router's forward
pass, route draws, set likelihoods and regularisers) and each function carries its equation and
shapes.

Params pytree (all leaves of the `dtype` given to `init_router`):
    {"proj": {"kernel": [d_model, D], "bias": [D]}, "prototypes": [K_s, D]}
"""

from __future__ import annotations

import itertools
import math
import numbers
from typing import Any

import chex
import jax
import jax.numpy as jnp
import numpy as np

Array = jax.Array
RouterParams = dict[str, Any]

# Anti-collapse regulariser weights (paper App. J / DESIGN §2).
ENTROPY_WEIGHT = 0.02
ORTHOGONALITY_WEIGHT = 0.05

DEFAULT_NUM_EXPERTS = 4
DEFAULT_DIM = 128
DEFAULT_MAX_TOKENS = 64
# The reference implementation initialises prototypes N(0, 0.02^2); cosine scoring makes the
# scale irrelevant to the forward pass, but it sets the effective step size of the prototypes.
PROTOTYPE_INIT_STD = 0.02
# k! orderings are enumerated at trace time; 6! = 720 is the most we consider "small".
MAX_EXACT_SET_SIZE = 6

_NORM_EPS = 1e-12


def _check_positive_int(value: Any, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return int(value)


def check_top_k(k: Any, num_experts: int, name: str = "k", experts_name: str = "K_s") -> int:
    """k as an int, or ValueError unless 1 <= k <= K_s: the one "K <= K_s" rule (a set of k
    distinct experts is drawn from K_s). `name` / `experts_name` name the two in the message
    (config validation passes the config fields)."""
    k = _check_positive_int(k, name)
    if k > num_experts:
        raise ValueError(f"{name}: {k} exceeds {experts_name}={num_experts}")
    return k


def _check_temperature(temperature: Any) -> None:
    # A traced temperature cannot be checked; a concrete one can and should be.
    if isinstance(temperature, numbers.Real) and not (
        math.isfinite(temperature) and temperature > 0
    ):
        raise ValueError(f"temperature must be a finite number > 0, got {temperature!r}")


def _float_dtype(*dtypes: Any) -> Any:
    """At least float32: routing probabilities are tiny tensors, precision is free."""
    return jnp.promote_types(jnp.result_type(*dtypes), jnp.float32)


def _safe_log(probs: Array) -> Array:
    # Clamping keeps log and its gradient finite for exactly-zero probabilities.
    return jnp.log(jnp.maximum(probs, jnp.finfo(probs.dtype).tiny))


def _l2_normalize(x: Array) -> Array:
    sq = jnp.sum(jnp.square(x), axis=-1, keepdims=True)
    return x * jax.lax.rsqrt(jnp.maximum(sq, _NORM_EPS))


# --------------------------------------------------------------------------------------------
# Parameters and forward pass
# --------------------------------------------------------------------------------------------


def init_router(
    key: Array,
    d_model: int,
    *,
    num_experts: int = DEFAULT_NUM_EXPERTS,
    dim: int = DEFAULT_DIM,
    dtype: Any = jnp.float32,
) -> RouterParams:
    """Initialise router parameters.

    Args:
      key: PRNG key.
      d_model: width of the backbone's input embeddings.
      num_experts: K_s, number of subtask experts (prototypes).
      dim: D, width of the projected routing space.
      dtype: floating dtype of every leaf.

    Returns:
      {"proj": {"kernel": dtype[d_model, D], "bias": dtype[D]}, "prototypes": dtype[K_s, D]};
      kernel N(0, 1/d_model) (LeCun normal, untruncated), bias zero, prototypes N(0, 0.02^2).
    """
    d_model = _check_positive_int(d_model, "d_model")
    num_experts = _check_positive_int(num_experts, "num_experts")
    dim = _check_positive_int(dim, "dim")
    if not jnp.issubdtype(dtype, jnp.floating):
        raise ValueError(f"dtype must be a floating dtype, got {dtype!r}")
    # One normal draw for both matrices: random-number kernels dominate compile time on CPU.
    z = jax.random.normal(key, (d_model + num_experts, dim), dtype)
    kernel = z[:d_model] / jnp.sqrt(jnp.asarray(d_model, dtype))
    prototypes = PROTOTYPE_INIT_STD * z[d_model:]
    return {
        "proj": {"kernel": kernel, "bias": jnp.zeros((dim,), dtype)},
        "prototypes": prototypes,
    }


def subtask_embedding(
    embed_table: Array,
    token_ids: Array,
    mask: Array,
    *,
    max_tokens: int = DEFAULT_MAX_TOKENS,
) -> Array:
    """Mean of frozen input-token embeddings over the first `max_tokens` real tokens.

    "Real" tokens are those with mask != 0, wherever they sit (left or right padding both work):
    a real token is kept iff at most `max_tokens` real tokens precede-or-equal it. Rows with no
    real token return zeros. No gradient reaches `embed_table` (the backbone is frozen).

    Args:
      embed_table: float[V, d_model] backbone input-embedding table.
      token_ids: int[N, T] token ids of the subtask descriptions.
      mask: bool or int[N, T], nonzero at real tokens. Ids outside [0, V) are clipped (a
        traced array cannot be checked); pass ids from the backbone's own tokenizer.
      max_tokens: truncation length (static), 64 in the paper.

    Returns:
      float[N, d_model], dtype at least float32 (accumulation in low precision loses bits).
    """
    max_tokens = _check_positive_int(max_tokens, "max_tokens")
    chex.assert_rank(embed_table, 2)
    chex.assert_rank([token_ids, mask], 2)
    chex.assert_equal_shape([token_ids, mask])
    if not jnp.issubdtype(token_ids.dtype, jnp.integer):
        raise ValueError(f"token_ids must be an integer array, got dtype {token_ids.dtype}")
    out_dtype = _float_dtype(embed_table.dtype)

    real = mask != 0
    keep = real & (jnp.cumsum(real.astype(jnp.int32), axis=1) <= max_tokens)
    table = jax.lax.stop_gradient(embed_table)
    emb = jnp.take(table, token_ids, axis=0, mode="clip").astype(out_dtype)  # [N, T, d]
    weights = keep.astype(out_dtype)
    total = jnp.einsum("ntd,nt->nd", emb, weights)
    count = jnp.sum(weights, axis=1, keepdims=True)
    # max(count, 1) makes all-masked rows 0 / 1 = 0 instead of 0 / 0 = NaN.
    return total / jnp.maximum(count, 1.0)


def router_logits(params: RouterParams, emb: Array, *, temperature: float = 1.0) -> Array:
    """Cosine router logits z = cos(h_eta(emb), P) / temperature.

    Args:
      params: router params (see module docstring).
      emb: float[N, d_model] subtask embeddings (from `subtask_embedding`).
      temperature: > 0; scalar, may be traced.

    Returns:
      float[N, K_s] (at least float32), each entry in [-1/temperature, 1/temperature].
    """
    _check_temperature(temperature)
    kernel = params["proj"]["kernel"]
    bias = params["proj"]["bias"]
    prototypes = params["prototypes"]
    chex.assert_rank([emb, kernel, bias, prototypes], [2, 2, 1, 2])
    chex.assert_axis_dimension(emb, 1, kernel.shape[0])
    chex.assert_axis_dimension(bias, 0, kernel.shape[1])
    chex.assert_axis_dimension(prototypes, 1, kernel.shape[1])
    dtype = _float_dtype(emb.dtype, kernel.dtype, prototypes.dtype)

    h = emb.astype(dtype) @ kernel.astype(dtype) + bias.astype(dtype)
    h_hat = _l2_normalize(h)
    p_hat = _l2_normalize(prototypes.astype(dtype))
    return (h_hat @ p_hat.T) / temperature


def router_probs(params: RouterParams, emb: Array, *, temperature: float = 1.0) -> Array:
    """pi(. | s) = softmax(router_logits). float[N, d_model] -> float[N, K_s], rows sum to 1."""
    return jax.nn.softmax(router_logits(params, emb, temperature=temperature), axis=-1)


# --------------------------------------------------------------------------------------------
# Route selection
# --------------------------------------------------------------------------------------------


def sample_route(key: Array, probs: Array, k: int) -> Array:
    """Draw k distinct experts per row without replacement (Gumbel-top-k).

    The top-k of log(probs) + Gumbel noise is distributed as k sequential draws without
    replacement (Plackett-Luce), so `set_log_prob` is the exact likelihood of the result.

    Args:
      key: PRNG key.
      probs: float[N, K_s] routing probabilities.
      k: number of experts (static), 1 <= k <= K_s.

    Returns:
      int32[N, k], distinct within each row, in decreasing perturbed-score order.
    """
    chex.assert_rank(probs, 2)
    k = check_top_k(k, probs.shape[-1])
    gumbel = jax.random.gumbel(key, probs.shape, dtype=_float_dtype(probs.dtype))
    scores = _safe_log(probs.astype(gumbel.dtype)) + gumbel
    _, idx = jax.lax.top_k(jax.lax.stop_gradient(scores), k)
    return idx.astype(jnp.int32)


def greedy_route(probs: Array, k: int) -> Array:
    """The k most probable experts per row. float[N, K_s] -> int32[N, k], descending."""
    chex.assert_rank(probs, 2)
    k = check_top_k(k, probs.shape[-1])
    _, idx = jax.lax.top_k(jax.lax.stop_gradient(probs), k)
    return idx.astype(jnp.int32)


# --------------------------------------------------------------------------------------------
# Set likelihoods
# --------------------------------------------------------------------------------------------


def set_log_prob(probs: Array, members: Array) -> Array:
    """Exact log-probability of drawing the unordered set `members` without replacement.

    With sequential draws (Plackett-Luce) an ordering (m_1..m_k) has probability
    prod_j p_{m_j} / sum_{l not in {m_1..m_{j-1}}} p_l; the set's probability sums that over
    all k! orderings (enumerated at trace time; k is static and small). Denominators are
    log-sum-exps over the not-yet-drawn experts rather than 1 - cumsum, which stays accurate
    when a drawn expert carries almost all the mass.

    Args:
      probs: float[N, K_s] routing probabilities (rows summing to 1; unnormalised rows are
        treated as Plackett-Luce weights).
      members: int[N, k] expert indices, k <= min(K_s, 6).

    Returns:
      float[N] (at least float32). Rows whose members repeat or fall outside [0, K_s) get
      -inf: such a set is never drawn.
    """
    chex.assert_rank([probs, members], 2)
    chex.assert_equal_shape_prefix([probs, members], 1)
    num_experts = probs.shape[-1]
    k = check_top_k(members.shape[-1], num_experts, name="members.shape[-1]")
    if k > MAX_EXACT_SET_SIZE:
        raise ValueError(
            f"members.shape[-1]={k}: the exact set likelihood enumerates k! orderings and is "
            f"limited to k <= {MAX_EXACT_SET_SIZE}; use approx_set_log_prob for larger sets"
        )
    logp = _safe_log(probs.astype(_float_dtype(probs.dtype)))  # [N, K]
    members = members.astype(jnp.int32)
    valid = _valid_members(members, num_experts)
    # Clipping keeps invalid rows finite so their masked-out gradients stay 0, not NaN.
    members = jnp.clip(members, 0, num_experts - 1)

    perms = np.array(list(itertools.permutations(range(k))), dtype=np.int32)  # [P, k]
    ordered = members[:, perms]  # [N, P, k]
    onehot = jax.nn.one_hot(ordered, num_experts, dtype=jnp.bool_)  # [N, P, k, K]
    # drawn_before[..., j, :] marks experts drawn at positions < j of the ordering.
    drawn_before = jnp.cumsum(onehot, axis=2, dtype=jnp.int32) - onehot.astype(jnp.int32)
    remaining = jnp.where(drawn_before > 0, -jnp.inf, logp[:, None, None, :])
    log_denom = jax.nn.logsumexp(remaining, axis=-1)  # [N, P, k]
    log_num = jnp.take_along_axis(logp, ordered.reshape(ordered.shape[0], -1), axis=1)
    log_num = log_num.reshape(ordered.shape)  # [N, P, k]
    log_order = jnp.sum(log_num - log_denom, axis=-1)  # [N, P]
    result = jax.nn.logsumexp(log_order, axis=-1)

    return jnp.where(valid, result, -jnp.inf)


def approx_set_log_prob(probs: Array, members: Array) -> Array:
    """APPROXIMATION of the set log-likelihood: sum_i log p_{m_i} (the authors' PyTorch code).

    This is not the probability of drawing the set without replacement (it ignores the
    renormalisation after each draw and the k! orderings); it equals `set_log_prob` only for
    k = 1. Kept as an opt-in for reproducing the reference implementation.

    Args:
      probs: float[N, K_s]; members: int[N, k].

    Returns:
      float[N] (at least float32). Out-of-range members are clamped, not rejected.
    """
    chex.assert_rank([probs, members], 2)
    chex.assert_equal_shape_prefix([probs, members], 1)
    logp = _safe_log(probs.astype(_float_dtype(probs.dtype)))
    picked = jnp.take_along_axis(logp, members.astype(jnp.int32), axis=1, mode="clip")
    return jnp.sum(picked, axis=-1)


def _valid_members(members: Array, num_experts: int) -> Array:
    """bool[N]: members in range and pairwise distinct."""
    in_range = jnp.all((members >= 0) & (members < num_experts), axis=-1)
    same = members[:, :, None] == members[:, None, :]
    k = members.shape[-1]
    duplicate = jnp.any(same & ~jnp.eye(k, dtype=jnp.bool_), axis=(-2, -1))
    return in_range & ~duplicate


# --------------------------------------------------------------------------------------------
# Anti-collapse regularisers
# --------------------------------------------------------------------------------------------


def routing_entropy(probs: Array) -> Array:
    """Shannon entropy (nats) of each routing distribution. float[..., K_s] -> float[...].

    Zero-probability entries contribute 0 with a zero (finite) gradient.
    """
    probs = jnp.asarray(probs)
    if probs.ndim < 1:
        raise ValueError("probs: expected shape [..., K], got a scalar")
    p = probs.astype(_float_dtype(probs.dtype))
    positive = p > 0
    return -jnp.sum(jnp.where(positive, p * jnp.log(jnp.where(positive, p, 1.0)), 0.0), axis=-1)


def prototype_orthogonality(prototypes: Array) -> Array:
    """||P_hat P_hat^T - I||_F^2 over row-normalised prototypes. float[K_s, D] -> float[].

    Zero iff the prototypes are mutually orthogonal (any scale); needs K_s <= D to reach zero.
    """
    chex.assert_rank(prototypes, 2)
    p_hat = _l2_normalize(prototypes.astype(_float_dtype(prototypes.dtype)))
    gram = p_hat @ p_hat.T
    return jnp.sum(jnp.square(gram - jnp.eye(gram.shape[0], dtype=gram.dtype)))


def router_regularizer(
    params: RouterParams,
    probs: Array,
    *,
    entropy_weight: float = ENTROPY_WEIGHT,
    orthogonality_weight: float = ORTHOGONALITY_WEIGHT,
) -> Array:
    """Loss term to ADD to the router loss: -w_H * mean_n H(pi_n) + w_O * ||P P^T - I||_F^2.

    Args:
      params: router params; probs: float[N, K_s] routing distributions of the batch.

    Returns:
      float[] scalar.
    """
    return -entropy_weight * jnp.mean(routing_entropy(probs)) + (
        orthogonality_weight * prototype_orthogonality(params["prototypes"])
    )


# --------------------------------------------------------------------------------------------
# Drawing routes
# --------------------------------------------------------------------------------------------


def draw_routes(
    params: RouterParams,
    embed_table: Array,
    token_ids: Array,
    mask: Array,
    key: Array | None,
    *,
    k: int,
    num_samples: int = 1,
    greedy: bool = False,
    approx_set_logp: bool = False,
    temperature: float = 1.0,
    max_tokens: int = DEFAULT_MAX_TOKENS,
) -> tuple[Array, Array, Array]:
    """Embed and score N subtasks, then draw `num_samples` expert sets of size k for each.

    Sampling splits `key` into `num_samples` keys, one Gumbel-top-k draw each (the draws of a
    row are independent); `greedy` takes the top-k once (S = 1 whatever `num_samples` is).
    Under jit mark `k`, `num_samples`, `greedy`, `approx_set_logp` and `max_tokens` static.

    Args:
      params: router params; embed_table: float[V, d_model] frozen input embeddings;
      token_ids: int[N, T]; mask: bool/int[N, T] (see `subtask_embedding`).
      key: PRNG key, required unless `greedy`.
      k: experts per subtask (static), 1 <= k <= K_s.
      num_samples: S, independent draws per subtask when sampling (static).
      greedy: top-k (inference) instead of Gumbel-top-k sampling (training).
      approx_set_logp: the authors' sum-of-log-probs instead of the exact set likelihood.
      temperature: softmax temperature (> 0).

    Returns:
      (members int32[N, S, k], set_logp float[N, S], probs float[N, K_s]).
    """
    if not greedy and key is None:
        raise ValueError("key is required when greedy=False (routes are sampled)")
    num_samples = _check_positive_int(num_samples, "num_samples")
    emb = subtask_embedding(embed_table, token_ids, mask, max_tokens=max_tokens)
    probs = router_probs(params, emb, temperature=temperature)
    if greedy:
        members = greedy_route(probs, k)[:, None]
    else:
        members = jnp.stack([sample_route(kk, probs, k) for kk in jax.random.split(key, num_samples)], 1)
    n, s = members.shape[:2]
    set_fn = approx_set_log_prob if approx_set_logp else set_log_prob
    set_logp = set_fn(jnp.repeat(probs, s, axis=0), members.reshape(n * s, k)).reshape(n, s)
    return members, set_logp, probs
