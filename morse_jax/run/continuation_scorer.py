"""Log-probabilities of continuations under a MoR adapter (the role loop's ``ScoreFn``), with one
prefill per shared prefix.

The role loop scores closed sets: the two hand-overs of a reasoner turn, the heads and the
function names of a closed thought (``run.closed_thought``). The candidates of one choice share
their episode (hundreds to thousands of tokens) and differ in their last few. So the continuations
of a call are grouped by their shared prefix (the tokens and role ids before ``start``): each
group's prefix runs once, writing a KV cache (``models.transformer.forward`` with ``cache``), the
cache is copied to one row per candidate (``sampling.shared_prefill.take_cache_rows``) and the
candidates' own tokens run on top of it. A continuation's score is

    sum over t >= start of log p(ids[t] | ids[:t]),

the first term read from the prefix's last hidden state and the others from the suffix's, every
token under its role id (-1: no adapter). Same numbers as one full forward per continuation, up to
float rounding (``tests/test_moragent_decision.py`` checks against full logits), at the cost of one
prefix forward per choice instead of one per candidate.
"""

from __future__ import annotations

import functools
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from morse_jax.mor.adapter import MoRInputs
from morse_jax.mor.config import MoRConfig
from morse_jax.models.config import ModelConfig
from morse_jax.models.transformer import forward, init_cache, split_segments
from morse_jax.rl.logprobs import token_logprobs
from morse_jax.run.role_loop import Continuation
from morse_jax.sampling.shared_prefill import cache_row_layout, take_cache_rows


def suffix_logprobs(trainable: dict, frozen: dict, prefix: jax.Array, prefix_roles: jax.Array, n_prefix: jax.Array,
                    suffix: jax.Array, suffix_roles: jax.Array, suffix_valid: jax.Array, *, model_cfg: ModelConfig,
                    mor_cfg: MoRConfig) -> jax.Array:
    """Per suffix row, sum_j log p(suffix[j] | prefix, suffix[:j]) over its valid tokens: float32[B].

    prefix, prefix_roles: int32[1, P], the shared prefix right-padded (its first ``n_prefix``
    tokens are real, 1 <= n_prefix <= P); suffix, suffix_roles: int32[B, C], right-padded
    (``suffix_valid``: bool[B, C]). Role -1: no adapter.
    """
    P, (B, C) = prefix.shape[1], suffix.shape
    prefix_valid = jnp.arange(P)[None, :] < n_prefix
    cache = init_cache(model_cfg, frozen, 1, P + C, dtype=frozen["embed"].dtype)
    h_prefix, cache = forward(frozen, model_cfg, prefix, valid=prefix_valid, cache=cache, logits_mode="hidden",
                              lora=MoRInputs(trainable, jnp.where(prefix_valid, prefix_roles, -1), mor_cfg))
    layout = cache_row_layout(lambda b: init_cache(model_cfg, frozen, b, P + C, dtype=frozen["embed"].dtype))
    cache = take_cache_rows(cache, jnp.zeros((B,), jnp.int32), layout)  # the prefix's cache in every row
    h, _ = forward(frozen, model_cfg, suffix, valid=suffix_valid, cache=cache, logits_mode="hidden",
                   lora=MoRInputs(trainable, jnp.where(suffix_valid, suffix_roles, -1), mor_cfg))  # [B, C, d]
    last = jax.lax.dynamic_index_in_dim(h_prefix[0], n_prefix - 1, axis=0, keepdims=True)  # [1, d]
    before = jnp.concatenate([jnp.broadcast_to(last[None], (B, 1, h.shape[-1])), h[:, :-1]], axis=1)  # [B, C, d]
    lp = token_logprobs(frozen, model_cfg, before, suffix)  # [B, C]: log p(suffix[j] | everything before it)
    return jnp.sum(jnp.where(suffix_valid, lp, 0.0), axis=1)


def _pow2(n: int, lo: int) -> int:
    return max(lo, 1 << (max(n, 1) - 1).bit_length())


def _length_bucket(n: int) -> int:
    """The padded length for n tokens: a power of two or 1.5 times one (at most 1.5x padding, two
    shapes per octave), at least 128."""
    p = _pow2(n, 128)
    return p * 3 // 4 if p > 128 and n <= p * 3 // 4 else p


class ContinuationScorer:
    """``run.role_loop.ScoreFn`` for a MoR adapter: continuations -> their log-probabilities.
    Continuations with the same prefix (tokens and roles before ``start``) share one prefix
    forward; their suffixes run ``max_rows`` at a time. Shapes are padded (prefix length to
    :func:`_length_bucket`, suffix rows and length to powers of two) so that few compile."""

    def __init__(self, backbone, mor_cfg: MoRConfig, max_rows: int = 8):
        n_adapt = mor_cfg.adapted_layers(backbone.config.num_layers)
        self.frozen = backbone.params if n_adapt >= backbone.config.num_layers else split_segments(backbone.params,
                                                                                                  n_adapt)
        self.max_rows = max_rows
        self.fn = jax.jit(functools.partial(suffix_logprobs, model_cfg=backbone.config, mor_cfg=mor_cfg))

    def __call__(self, params: dict, conts: Sequence[Continuation]) -> list[float]:
        groups: dict[tuple, list[int]] = {}
        for i, c in enumerate(conts):
            if not 0 < c.start < len(c.ids):
                raise ValueError(f"continuation {i}: start {c.start} not in (0, {len(c.ids)})")
            groups.setdefault((c.ids[:c.start], c.roles[:c.start]), []).append(i)
        out = np.zeros(len(conts))
        for (ids, roles), members in groups.items():
            for lo in range(0, len(members), self.max_rows):
                rows = members[lo:lo + self.max_rows]
                out[rows] = self._group(params, ids, roles, [conts[i] for i in rows])
        return out.tolist()

    def _group(self, params, ids, roles, conts) -> np.ndarray:
        n = len(ids)
        P, B = _length_bucket(n), _pow2(len(conts), 1)
        C = _pow2(max(len(c.ids) - c.start for c in conts), 8)
        prefix, prefix_roles = np.zeros((1, P), np.int32), np.full((1, P), -1, np.int32)
        prefix[0, :n], prefix_roles[0, :n] = ids, roles
        suffix, suffix_roles = np.zeros((B, C), np.int32), np.full((B, C), -1, np.int32)
        valid = np.zeros((B, C), bool)
        for i, c in enumerate(conts):
            k = len(c.ids) - c.start
            suffix[i, :k], suffix_roles[i, :k], valid[i, :k] = c.ids[c.start:], c.roles[c.start:], True
        res = self.fn(params, self.frozen, prefix, prefix_roles, np.int32(n), suffix, suffix_roles, valid)
        return np.asarray(res, np.float64)[:len(conts)]
