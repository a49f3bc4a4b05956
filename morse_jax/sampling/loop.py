"""The sampler's device side: pure prefill and decode-loop functions (jitted by the caller).

Both take a static :class:`LoopConfig` first (bind it with ``functools.partial``), then arrays:
backbone params in the decode path's layout, the expert bank (or None), and the typed pytrees
of ``sampling.state``. ``Sampler`` jits them plainly, or hands them to
``sampling.sharded.shard_sampler_functions`` for explicit shardings over a mesh.

The model maths run through ``morse_jax.models.decode`` (fused, transposed weights and a
decode-friendly cache layout; ``decode_path="fused"``) or through the backbone's own forward
with per-layer caches (``decode_path="model"``, the reference path).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol

import jax
import jax.numpy as jnp

from morse_jax.models.config import ModelConfig
from morse_jax.models.decode import (
    decode_step,
    forward_cached,
    init_decode_cache,
    positions_from_valid,
    prepare_lora,
    rope_tables_for,
)
from morse_jax.models.transformer import forward, init_cache
from morse_jax.mole.experts import ExpertBankSpec, gather_lora
from morse_jax.sampling.sample import select_tokens
from morse_jax.sampling.state import (
    DecodeSettings,
    ExpertSlots,
    PrefillOutput,
    PromptBatch,
    SamplingState,
    record_tokens,
)


class RoleAdapter(Protocol):
    """An adapter whose per-layer values depend on each token's role (MoRAgent's role groups).

    The sampler hands it the adapter's parameters (``Sampler.generate``'s ``bank`` argument) and
    the role ids of the tokens about to run; it returns one adapter value per adapted layer (the
    last ``len(...)`` layers; each value has the ``deltas`` method of ``models.adapters``):
    role_ids int32[B, T] for a prefill chunk (activations [B, T, d]) or int32[B] for a decode step
    (activations [d, B], ``columns``). NO_ROLE (-1) tokens must get no delta.
    """

    num_roles: int

    def layers(self, params: Any, role_ids: jax.Array) -> tuple:
        ...


@dataclasses.dataclass(frozen=True)
class LoopConfig:
    """Static settings of the jitted prefill and decode (fixed per Sampler).

    cfg: the backbone's config. spec: the expert bank's layout (None: no adapters).
    decode_path: "fused" or "model". lora_compose: "auto", "gather" or "onehot".
    capture_layer: layer whose input residual is returned (None: none). native: decode steps
    (and their token selection's top-k) on the native CPU kernels. k_cap: top-k candidates for
    top-p. barrier: the optimization barrier around top-k in token selection (off under a mesh: see ``select_tokens``). cache_dtype: KV
    cache dtype (None: the params' dtype). role_adapter: a :class:`RoleAdapter` (then ``bank`` is
    its parameters and the role ids of ``PromptBatch.roles`` / ``ExpertSlots.roles`` choose each
    token's adapter), or None. prefill_min_rows: see :func:`prefill_chunk_sizes`.
    """

    cfg: ModelConfig
    spec: ExpertBankSpec | None
    decode_path: str
    lora_compose: str
    capture_layer: int | None
    native: bool
    k_cap: int
    barrier: bool
    cache_dtype: Any = None
    role_adapter: Any = None
    prefill_min_rows: int = 128  # the fewest token rows of a prefill chunk's GEMMs (prefill_chunk_sizes)

    @property
    def fused(self) -> bool:
        return self.decode_path == "fused"

    def cache_dtype_for(self, params) -> Any:
        return self.cache_dtype or params["embed"].dtype


def empty_cache(lc: LoopConfig, params, batch: int, cache_len: int) -> Any:
    """A zeroed KV cache of the decode path's layout for ``batch`` rows and ``cache_len`` slots."""
    dtype = lc.cache_dtype_for(params)
    if lc.fused:
        return init_decode_cache(lc.cfg, batch, cache_len, dtype)
    return init_cache(lc.cfg, params, batch, cache_len, dtype)


def row_lora(lc: LoopConfig, bank, experts: ExpertSlots):
    """Per-row LoRA inputs for a batch (None without a bank); computed once per device call,
    outside the loops. With a role adapter: its layers for the rows' generated-token roles
    (``experts.roles`` int32[B], what the decode steps run)."""
    if lc.role_adapter is not None:
        return lc.role_adapter.layers(bank, experts.roles)
    if lc.spec is None or bank is None:
        return None
    compose = lc.lora_compose
    ids = experts.ids
    if compose == "auto":  # all experts beat per-row gathers unless the bank outgrows the batch's slots
        compose = "onehot" if lc.spec.num_experts <= ids.shape[0] * ids.shape[1] else "gather"
    lora = gather_lora(bank, dataclasses.replace(lc.spec, compose=compose), ids, experts.weights)
    return prepare_lora(lora) if lc.fused else lora


def _forward(lc: LoopConfig, params, tokens, valid, positions, cache, lora, rope=None):
    """Logits at the last new position [B, V] and the updated cache (and, with
    ``capture_layer``, the residual entering it [B, T, d])."""
    if lc.fused:
        return forward_cached(params, lc.cfg, tokens, valid, positions, cache, lora, rope,
                              capture_layer=lc.capture_layer)
    return forward(params, lc.cfg, tokens, positions=positions, valid=valid, cache=cache, lora=lora,
                   logits_mode="last")


def _step(lc: LoopConfig, params, tokens, active, positions, cache, lora, rope):
    """One token per row: logits [B, V] and the updated cache (and the captured residual [B, d])."""
    if lc.fused:
        return decode_step(params, lc.cfg, tokens, active, positions, cache, lora, rope,
                           capture_layer=lc.capture_layer, native=lc.native)
    return _forward(lc, params, tokens[:, None], active[:, None], positions[:, None], cache, lora)


def prefill_chunk_sizes(chunk: int, batch: int, min_rows: int) -> tuple[int, ...]:
    """The chunk lengths a prefill runs, ascending, each dividing the next: ``chunk``, and
    ``chunk / 4`` and ``chunk / 16`` where they divide and still make GEMMs of at least
    ``min_rows`` token rows (``batch`` rows per token), so the left padding worked through is
    under the smallest size rather than under ``chunk``.

    The floor because a smaller GEMM is a slower one: at batch 1, 3 x 64 + 16 tokens for a
    200-token prompt took 8 % more CPU time than one padded chunk of 256 (XLA's dot at 16-64 rows
    reads the weights once per chunk at a fraction of its 256-row rate)."""
    sizes = [chunk]
    for _ in range(2):
        if sizes[0] % 4 == 0 and batch * sizes[0] // 4 >= min_rows:
            sizes.insert(0, sizes[0] // 4)
    return tuple(sizes)


def prefill(lc: LoopConfig, params, bank, batch: PromptBatch, experts: ExpertSlots, n_chunks: jax.Array, *,
            cache_len: int, chunk: int) -> PrefillOutput:
    """Prompts (left-padded to end at slot ``n_chunks * chunk``) into a fresh cache of ``cache_len`` slots.

    Loops, so the work is dynamic: it follows the batch's longest prompt, not its bucket, and the
    attention scores of a chunk stay [B, heads, chunk, filled slots] however long the prompt.
    The slots before the longest prompt's start are skipped (left empty, never attended to) down
    to a multiple of the smallest of :func:`prefill_chunk_sizes`; the rest runs as at most 3
    chunks of each smaller size, then chunks of ``chunk`` (at batch 16, 200-token prompts in
    chunks of 32 were 224 token rows of work; now 8 + 6 x 32 = 200). n_chunks: int32[] (chunks
    of ``chunk`` covering the prompts' end slot).
    """
    tokens, valid = batch.tokens, batch.valid
    B, P = tokens.shape
    cache = empty_cache(lc, params, B, cache_len)
    lora = row_lora(lc, bank, experts) if lc.role_adapter is None else None
    positions = positions_from_valid(valid)
    rope = rope_tables_for(lc.cfg, cache_len, lc.cache_dtype_for(params)) if lc.fused else None
    capture = lc.capture_layer is not None
    sizes = prefill_chunk_sizes(chunk, B, lc.prefill_min_rows)
    end = n_chunks * chunk
    first = jnp.min(jnp.where(jnp.any(valid, axis=0), jnp.arange(P), end))  # the longest prompt's start
    slot = first // sizes[0] * sizes[0]
    cache["index"] = slot

    def run(size):
        def body(_, carry):
            slot = carry[-1]

            def part(a):
                return jax.lax.dynamic_slice_in_dim(a, slot, size, axis=1)

            chunk_lora = lora
            if lc.role_adapter is not None:  # each prompt token under its own role
                chunk_lora = lc.role_adapter.layers(bank, part(batch.roles))
            out = _forward(lc, params, part(tokens), part(valid), part(positions), carry[1], chunk_lora, rope)
            if capture:
                out = (*out[:2], jax.lax.dynamic_update_slice_in_dim(carry[2], out[2], slot, axis=1))
            return (*out, slot + size)
        return body

    carry = (jnp.zeros((B, lc.cfg.vocab_size), jnp.float32), cache)
    if capture:
        carry += (jnp.zeros((*tokens.shape, lc.cfg.hidden_size), params["embed"].dtype),)
    carry += (slot,)
    for k, size in enumerate(sizes):  # smallest first: each ends aligned to the next size
        left = end - carry[-1]
        count = left // size if k + 1 == len(sizes) else left % sizes[k + 1] // size
        carry = jax.lax.fori_loop(0, count, run(size), carry)
    return PrefillOutput(logits=carry[0], cache=carry[1], pos=jnp.sum(valid, axis=1, dtype=jnp.int32),
                         prefix_states=carry[2] if capture else None)


def decode(lc: LoopConfig, params, bank, state: SamplingState, experts: ExpertSlots, settings: DecodeSettings,
           stop_end: jax.Array, done_limit: jax.Array | None = None) -> SamplingState:
    """Decode steps until ``stop_end`` (int32[]) steps are done or every row is done (or, with
    ``done_limit`` int32[], until that many rows are done: ``sampling.refill`` stops at the first
    finished row to give its slot the next request).

    Each step draws a token per row from ``state.logits`` (``select_tokens``, with the row's key
    folded with its token index: ``SamplingState.key``), records it and the rows that finish
    (``record_tokens``), and runs the model on it for the next logits.
    """
    lora = row_lora(lc, bank, experts)
    rope = None
    if lc.fused:  # loop-invariant tables, built once per call
        rope = rope_tables_for(lc.cfg, state.cache["valid"].shape[1], params["embed"].dtype)

    def cond(s):
        go = (s.step < stop_end) & ~jnp.all(s.done)
        return go if done_limit is None else go & (jnp.sum(s.done) < done_limit)

    def body(s):
        draw = jax.vmap(jax.random.fold_in)(s.key, s.n_gen)  # row's key, its token index
        tok, lp = select_tokens(draw, s.logits, settings.temperature, settings.top_k, settings.top_p,
                                k_cap=lc.k_cap, barrier=lc.barrier, native_top_k=lc.native)
        s, active = record_tokens(s, s.key, tok, lp, settings)
        out = _step(lc, params, tok, active, s.pos, s.cache, lora, rope)
        states = s.states
        if lc.capture_layer is not None:  # the consumed token's column: n_gen - 1 (inactive rows: dropped)
            col = jnp.where(active, s.n_gen - 1, states.shape[1])
            states = states.at[jnp.arange(states.shape[0]), col].set(out[2].astype(states.dtype), mode="drop")
        return s.replace(logits=out[0], cache=out[1], pos=s.pos + active, step=s.step + 1, states=states)

    return jax.lax.while_loop(cond, body, state)
