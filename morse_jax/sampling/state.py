"""Typed pytrees that flow through the sampler's jitted prefill and decode loop.

B: batch rows (a batch bucket), P: prompt bucket, N: new-token bucket, A: expert slots per row
(``SamplerConfig.max_active``), V: vocabulary, d: hidden size, S = P + N: KV-cache slots.
Every field is an array (or a pytree of arrays, or None for an absent optional part), so these
pass through ``jax.jit``, ``lax.while_loop`` and sharding rules as ordinary pytrees; shapes are
the compile keys, values never are.
"""

from __future__ import annotations

from typing import Any

import chex
import jax
import jax.numpy as jnp
from flax import struct


@struct.dataclass
class PromptBatch:
    """Left-padded prompts of one micro-batch.

    tokens: int32[B, P] (0 in padding). valid: bool[B, P] (True on prompt tokens). Every row's
    prompt ends at the same slot (``requests.BatchShape.prompt_end``), so the first new token of
    every row lands at one cache slot. roles: int32[B, P] each prompt token's role id for a role
    adapter (``loop.RoleAdapter``; NO_ROLE = -1 in padding and on tokens of no role), or None
    (the sampler has no role adapter).
    """

    tokens: Any
    valid: Any
    roles: Any = None


@struct.dataclass
class ExpertSlots:
    """Each row's adapter selection: for an expert bank, the active set, ids int32[B, A] into the
    bank and weights float32[B, A] (unused slots: id 0, weight 0); for a role adapter
    (``loop.RoleAdapter``), roles int32[B]: the role id of the tokens the row generates (None
    without a role adapter)."""

    ids: Any
    weights: Any
    roles: Any = None


@struct.dataclass
class DecodeSettings:
    """Per-row sampling settings (arrays, so one compiled loop serves any mix).

    temperature float32[B] (0 = greedy); top_k int32[B] (0 = no limit); top_p float32[B] in
    (0, 1]; max_new int32[B] (the row's new-token budget, <= N); stop_ids int32[B, MAX_STOP_IDS]
    (-1 = unused slot).
    """

    temperature: Any
    top_k: Any
    top_p: Any
    max_new: Any
    stop_ids: Any


@struct.dataclass
class PrefillOutput:
    """What the prefill hands the decode loop.

    logits float32[B, V] at each row's last prompt token; cache: the KV cache (the decode path's
    layout, ``models.decode.init_decode_cache`` or ``models.transformer.init_cache``) filled for
    the prompt; pos int32[B]: each row's prompt length (the next token's position);
    prefix_states: the residual entering the capture layer at every prompt slot [B, P, d] (model
    dtype), or None when the sampler does not capture.
    """

    logits: Any
    cache: Any
    pos: Any
    prefix_states: Any = None


# reason codes (int32) in SamplingState.reason; 0 = still running (read as "length" at the end)
REASON_EOS, REASON_LENGTH = 1, 3


@struct.dataclass
class SamplingState:
    """The decode loop's carry (donated to the loop, so the cache is updated in place).

    key: each row's request key ([B] typed or uint32[B, 2] raw PRNG keys): a row's k-th token is
    drawn with ``fold_in(key[row], k)``, so its randomness depends on its request and token index
    only, not on its slot, step or batch. logits float32[B, V]: next-token logits. cache: the KV
    cache (S slots). pos int32[B]: position of each row's next token. step int32[]: decode steps
    done. tokens int32[B, N] / logps float32[B, N]: drawn tokens and their temperature-1
    log-probs, row b's k-th token in column k (0 past a row's end). n_gen int32[B]: tokens each
    row generated (the row's next column). reason int32[B]: why a row finished (``REASON_EOS``: a stop token,
    ``REASON_LENGTH``: its budget, 0: not finished by the loop). done bool[B]: row finished
    (padding rows start done; the host also sets it on a stop string). states: the residual
    entering the capture layer at each generated token [B, N, d] (model dtype), or None.
    """

    key: Any
    logits: Any
    cache: Any
    pos: Any
    step: Any
    tokens: Any
    logps: Any
    n_gen: Any
    reason: Any
    done: Any
    states: Any = None


def initial_state(key: jax.Array, prefill: PrefillOutput, done: Any, new_tokens: int,
                  hidden_size: int | None = None, states_dtype: Any = None) -> SamplingState:
    """The decode loop's state after the prefill: nothing generated yet.

    key: one PRNG key per row (``SamplingState.key``). done: bool[B] (padding rows True). new_tokens: N. With ``hidden_size``, room for the
    generated tokens' captured residuals [B, N, hidden_size] of ``states_dtype``.
    """
    B = prefill.logits.shape[0]
    chex.assert_shape(done, (B,))
    states = None
    if hidden_size is not None:
        states = jnp.zeros((B, new_tokens, hidden_size), states_dtype)
    return SamplingState(key=key, logits=prefill.logits, cache=prefill.cache, pos=prefill.pos,
                         step=jnp.zeros((), jnp.int32), tokens=jnp.zeros((B, new_tokens), jnp.int32),
                         logps=jnp.zeros((B, new_tokens), jnp.float32), n_gen=jnp.zeros(B, jnp.int32),
                         reason=jnp.zeros(B, jnp.int32), done=jnp.asarray(done), states=states)


def record_tokens(state: SamplingState, key: jax.Array, tok: jax.Array, logp: jax.Array,
                  settings: DecodeSettings) -> tuple[SamplingState, jax.Array]:
    """Write one drawn token per row and settle which rows finish (pure; inside the loop).

    tok int32[B], logp float32[B]: this step's draws, written at each row's own next column
    (``n_gen``: rows may have started at different steps, ``sampling.refill``). Rows already done
    record nothing and do not count. A row finishes on a stop id (``REASON_EOS``; the token is kept) or when it reaches its
    ``max_new`` budget (``REASON_LENGTH``); a stop id takes precedence. Returns (the state with
    key, tokens, logps, n_gen, reason and done advanced — logits, cache, pos, step untouched —,
    active bool[B]: the rows that drew this step, i.e. that the model must now consume).
    """
    active = ~state.done
    rows = jnp.arange(tok.shape[0])
    col = jnp.where(active, state.n_gen, state.tokens.shape[1])  # out of range: dropped
    tokens = state.tokens.at[rows, col].set(tok, mode="drop")
    logps = state.logps.at[rows, col].set(logp, mode="drop")
    n_gen = state.n_gen + active
    hit_stop = jnp.any(tok[:, None] == settings.stop_ids, axis=-1) & active
    hit_len = (n_gen >= settings.max_new) & active
    reason = jnp.where(hit_stop, REASON_EOS, jnp.where(hit_len, REASON_LENGTH, state.reason))
    done = state.done | hit_stop | hit_len
    return state.replace(key=key, tokens=tokens, logps=logps, n_gen=n_gen, reason=reason, done=done), active
