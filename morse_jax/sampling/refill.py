"""Slot refill (continuous batching): a finished row's slot takes the next queued request.

Static micro-batches (``Sampler.generate`` without ``SamplerConfig.refill``) idle a finished row
until the longest row of its batch ends; RL completions are long-tailed, so most rows idle most
of the time. Here the requests of one ``generate`` call share one queue and one decode state of
``rows`` slots: when a row finishes, its slot is given the next request, placed into the
slot's cache rows (:func:`place_row`) between decode calls; the decode loop stops at the first
finished row while requests wait (``loop.decode``'s ``done_limit``).

Prefills are shared and batched, as in static batching (``shared_prefill``): an HGRPO route's M
candidates are one prompt under one expert set, so the first of them to get a slot prefills it
and the others reuse that prefill (kept, one row, until the last queued request of its kind has
a slot; ``SamplerConfig.share_prefill``), and the requests given slots at the same moment (the
first fill, rows that finish together) that need a prefill run as one batch. Without this every
refilled request prefilled alone, and refill spent on prefill what it saved in decode steps
(README, slot refill).

Why a request's output does not depend on its slot or neighbours: its tokens are drawn with its
own key folded with its token index (``SamplingState.key``), its tokens go to its own columns
(``state.record_tokens``), and the model maths depend on rotary positions and the valid mask,
never on which cache slots hold the row. Its prompt is written at the slots that end where
every row's next token goes (the shared ``cache["index"]``), so a row's slots stay contiguous
and in order (slot-based causal and sliding-window masks still hold).

Cache room: the cache has S = P + 2N slots (P, N: the call's prompt and new-token buckets).
Before a decode call that could run past the end, :func:`compact` shifts every row left by the
oldest live row's first slot (or down to P, the room a refilled prompt needs before the index);
the oldest live row spans fewer than P + N slots, so after a shift at least N slots remain.

Outside what this supports (``decode_path="model"`` or a device mesh) the sampler falls back to
static micro-batches.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import time
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from morse_jax.models.key_tiles import tile_keys, untile_keys
from morse_jax.sampling.finish import completions, mark_stop_strings
from morse_jax.sampling.loop import LoopConfig, empty_cache
from morse_jax.sampling.requests import (
    BatchShape,
    Completion,
    Request,
    SamplerConfig,
    bucket,
    pack_requests,
    prefill_chunk,
    prefill_token_rows,
)
from morse_jax.sampling.shared_prefill import prefill_key as prefill_key_of
from morse_jax.sampling.state import PrefillOutput, SamplingState, initial_state

_IDLE = Request(prompt_ids=(0,))  # what mark_stop_strings sees in an empty slot (no stop strings)


# --------------------------------------------------------------------------- pure device programs


def empty_state(lc: LoopConfig, params, key: jax.Array, *, rows: int, cache_len: int, index: int,
                new_tokens: int) -> SamplingState:
    """A decode state of ``rows`` empty slots (every row done, nothing valid in the cache), its
    next token slot at ``index`` (the room a refilled prompt needs before it). key: any PRNG key
    (the slots get their requests' keys when filled)."""
    cache = dict(empty_cache(lc, params, rows, cache_len), index=jnp.int32(index))
    pre = PrefillOutput(logits=jnp.zeros((rows, lc.cfg.vocab_size), jnp.float32), cache=cache,
                        pos=jnp.zeros(rows, jnp.int32))
    capture = {} if lc.capture_layer is None else dict(hidden_size=lc.cfg.hidden_size,
                                                       states_dtype=params["embed"].dtype)
    return initial_state(jax.random.split(key, rows), pre, jnp.ones(rows, bool), new_tokens, **capture)


def _shifted(small: jax.Array, S: int, shift: jax.Array, axis: int, dtype) -> jax.Array:
    """``small`` ([K, ..., Pb] along its slot axis ``axis``) moved ``shift`` slots later into S slots
    (slots it does not reach are zero)."""
    shape = list(small.shape)
    shape[axis] = S + small.shape[axis]  # room for any shift in [0, S] without dynamic_update_slice clamping it
    start = [0] * small.ndim
    start[axis] = shift
    moved = jax.lax.dynamic_update_slice(jnp.zeros(shape, dtype), small.astype(dtype), start)
    return jax.lax.slice_in_dim(moved, 0, S, axis=axis)


def _put_row(big: jax.Array, small: jax.Array, row: jax.Array, rows: int, shift: jax.Array, axis: int) -> jax.Array:
    """``big`` (a fused cache leaf [rows*K, ..., S] with its slot axis ``axis``) with row ``row``'s
    K sub-rows replaced by ``small`` ([K, ..., Pb], one row) moved ``shift`` slots later; slots
    ``small`` does not reach are zero."""
    moved = _shifted(small, big.shape[axis], shift, axis, big.dtype)
    return jax.lax.dynamic_update_slice(big, moved, (row * (big.shape[0] // rows),) + (0,) * (big.ndim - 1))


def _put_key_row(big: jax.Array, small: jax.Array, row: jax.Array, rows: int, shift: jax.Array) -> jax.Array:
    """:func:`_put_row` for keys in the cache's tiles ([rows*K, S/T, D, T], ``models.decode``): the
    row is shifted in slot order, then tiled again (one row's keys: a small copy)."""
    moved = tile_keys(_shifted(untile_keys(small), big.shape[1] * big.shape[3], shift, 2, big.dtype))
    return jax.lax.dynamic_update_slice(big, moved, (row * (big.shape[0] // rows), 0, 0, 0))


def place_row(state: SamplingState, row: jax.Array, pre: PrefillOutput, prompt_end: jax.Array,
              key: jax.Array) -> SamplingState:
    """The state with slot ``row`` (int32[]) restarted on a request prefilled alone.

    pre: the sampler's prefill of that one request (logits [1, V], a fused cache of Pb slots
    holding the prompt at slots [prompt_end - L, prompt_end), pos [1] = L). Its keys and values
    move to slots [index - prompt_end, index) of the row (index: the state's next token slot,
    >= prompt_end), so the row's first new token lands at ``index`` with the others; the row's
    other slots become invalid. key: the request's PRNG key. Everything else of the row (tokens,
    log-probs, counts, reason, captured states) restarts empty, ``done`` False.
    """
    B = state.done.shape[0]
    cache = state.cache
    shift = cache["index"] - prompt_end
    k = tuple(None if b is None else _put_key_row(b, s, row, B, shift) for b, s in zip(cache["k"], pre.cache["k"]))
    v = tuple(None if b is None else _put_row(b, s, row, B, shift, 1) for b, s in zip(cache["v"], pre.cache["v"]))
    valid = _put_row(cache["valid"], pre.cache["valid"], row, B, shift, 1)
    states = state.states
    if states is not None:
        states = states.at[row].set(0)
    return state.replace(
        key=state.key.at[row].set(key), logits=state.logits.at[row].set(pre.logits[0]),
        cache=dict(cache, k=k, v=v, valid=valid), pos=state.pos.at[row].set(pre.pos[0]),
        tokens=state.tokens.at[row].set(0), logps=state.logps.at[row].set(0.0), n_gen=state.n_gen.at[row].set(0),
        reason=state.reason.at[row].set(0), done=state.done.at[row].set(False), states=states)


def compact(state: SamplingState, shift: jax.Array) -> SamplingState:
    """Every row's cache moved ``shift`` (int32[]) slots earlier, the next token slot with it.

    The first ``shift`` slots must hold nothing a live row needs; the slots freed at the end are
    invalid. Positions (rotary) are per row and unchanged: only slot order matters to the masks.
    """
    cache = state.cache
    S = cache["valid"].shape[1]

    def roll(a, axis):
        return None if a is None else jnp.roll(a, -shift, axis=axis)

    def roll_keys(a):  # in slot order; slots rolled past S land in padding or invalid slots
        return None if a is None else tile_keys(roll(untile_keys(a), 2))

    valid = roll(cache["valid"], 1) & (jnp.arange(S) < S - shift)[None]
    return state.replace(cache=dict(cache, k=tuple(roll_keys(a) for a in cache["k"]),
                                    v=tuple(roll(a, 1) for a in cache["v"]), valid=valid,
                                    index=cache["index"] - shift))


# --------------------------------------------------------------------------- the host loop


@dataclasses.dataclass(frozen=True)
class RefillPrograms:
    """The jitted programs the refill loop calls (built by the Sampler; params bound where said).

    prefill(bank, prompts, experts, n_chunks, *, cache_len, chunk) -> PrefillOutput (the
    sampler's prefill). take(pre, index int32[n]) -> the prefill of rows ``index`` of ``pre``
    (``shared_prefill.share_rows``). decode(bank, state, experts, settings, stop_end, done_limit=) -> state
    (``loop.decode``, state donated). empty(key, *, rows, cache_len, index, new_tokens) -> state.
    place(state, row, pre, prompt_end, key) -> state and compact(state, shift) -> state (state
    donated). constrain(logits, heals) -> (unconstrained host logits, constrained logits): token
    healing's first-token constraint.
    """

    prefill: Callable
    take: Callable
    decode: Callable
    empty: Callable
    place: Callable
    compact: Callable
    constrain: Callable


@dataclasses.dataclass
class _Slot:
    """What the host keeps of the request in one slot."""

    j: int  # request index
    start: int  # its first cache slot (moves with compact)
    prompt_end: int  # where its prompt ends in its own prefill (for its captured prompt states)
    first_logits: Any = None  # healed: the unconstrained first-token logits [1, V]
    prompt_states: Any = None  # captured residuals of its prefill [1, Pb, d]


def run_refill(progs: RefillPrograms, config: SamplerConfig, tokenizer, reqs: Sequence[Request],
               heals: Sequence[Any], keys: jax.Array, *, roles: bool, on_done: Callable[[int, Completion], None],
               profile=None, stats: dict | None = None) -> None:
    """Generate every request through ``min(len(reqs), max_batch)`` slots (rounded up to a batch
    bucket), calling ``on_done(j, completion)`` as each request finishes.

    keys: each request's PRNG key ([n] typed or uint32[n, 2]). heals[j]: token healing's
    (dropped text, allowed bool[V]) or None. roles: pack role ids (a role adapter).
    stats: prefill_s, decode_s, decode_steps, batches (the decode calls), compactions, prefill_calls
    and prefilled_requests (distinct prompts prefilled) are added to it.
    """
    stats = stats if stats is not None else {}
    rows = bucket(min(len(reqs), config.max_batch), config.batch_buckets, "batch")
    P = bucket(max(len(r.prompt_ids) for r in reqs), config.prompt_buckets, "prompt length")
    N = bucket(max(r.max_new_tokens for r in reqs), config.new_token_buckets, "max_new_tokens")
    S = P + 2 * N
    state = progs.empty(keys[0], rows=rows, cache_len=S, index=P, new_tokens=N)
    _, experts, settings, _ = pack_requests([], BatchShape(rows, 1, 1, 1, N), config.max_active, roles=roles)
    queue = collections.deque(range(len(reqs)))
    slots: list[_Slot | None] = [None] * rows
    stop_at = np.full(rows, -1)
    index, step = P, 0

    # request -> the number of its distinct prefill key, computed once (a key holds the whole prompt,
    # and tuples do not cache their hash: looking keys up per fill would cost O(prompt) each time)
    distinct: dict[tuple, int] = {}
    key_of = [distinct.setdefault(prefill_key_of(r), len(distinct)) if config.share_prefill else j
              for j, r in enumerate(reqs)]
    uses = collections.Counter(key_of)  # queued requests per prefill key
    kept: dict[int, tuple[PrefillOutput, int]] = {}  # prefill key number -> (its one-row prefill, prompt end)

    def prefill_new(js: list[int]):
        """Prefill, as one batch, the distinct requests among ``js`` that have no kept prefill."""
        new = list({key_of[j]: j for j in js if key_of[j] not in kept}.values())
        if not new:
            return
        B = bucket(len(new), config.batch_buckets, "batch")
        longest = max(len(reqs[j].prompt_ids) for j in new)
        Pb = bucket(longest, config.prompt_buckets, "prompt length")
        chunk = prefill_chunk(prefill_token_rows(config), B, Pb)
        end = -(-longest // chunk) * chunk  # every prompt of the batch ends here (left padding)
        prompts, ex, _, _ = pack_requests([reqs[j] for j in new], BatchShape(B, Pb, chunk, end, N),
                                          config.max_active, roles=roles)
        with contextlib.nullcontext() if profile is None else profile.phase("prefill"):
            pre = progs.prefill(prompts, ex, np.int32(end // chunk), cache_len=Pb, chunk=chunk)
            pre.logits.block_until_ready()
        stats["prefill_calls"] = stats.get("prefill_calls", 0) + 1
        stats["prefilled_requests"] = stats.get("prefilled_requests", 0) + len(new)
        for i, j in enumerate(new):
            kept[key_of[j]] = (progs.take(pre, jnp.asarray([i], jnp.int32)), end)

    def fill(r: int, j: int):
        nonlocal state
        req = reqs[j]
        k = key_of[j]
        pre, end = kept[k]
        uses[k] -= 1
        if not uses[k]:  # no queued request needs it any more
            del kept[k]
        L = len(req.prompt_ids)
        _, ex, st, _ = pack_requests([req], BatchShape(1, L, L, L, N), config.max_active, roles=roles)
        first = None
        if heals[j] is not None:
            first, logits = progs.constrain(pre.logits, [heals[j]])
            pre = pre.replace(logits=logits)
        state = progs.place(state, np.int32(r), pre, np.int32(end), keys[j])
        for dst, src in ((experts, ex), (settings, st)):
            for name in dst.__dataclass_fields__:
                if getattr(dst, name) is not None:
                    getattr(dst, name)[r] = getattr(src, name)[0]
        slots[r] = _Slot(j, index - L, end, first, pre.prefix_states)
        stop_at[r] = -1

    def harvest(r: int, arrays: dict):
        s = slots[r]
        slots[r] = None
        gen_states = None if s.prompt_states is None else np.asarray(state.states[r:r + 1])
        prompt_states = None if s.prompt_states is None else np.asarray(s.prompt_states)
        (c,) = completions([reqs[s.j]], tokenizer, **{k: a[r:r + 1] for k, a in arrays.items()},
                           stop_at=stop_at[r:r + 1], heals=[heals[s.j]], first_logits=s.first_logits,
                           prompt_end=s.prompt_end, prompt_states=prompt_states, gen_states=gen_states)
        on_done(s.j, c)

    while True:
        t0 = time.perf_counter()
        free = [r for r in range(rows) if slots[r] is None][:len(queue)]
        if free:
            given = [queue.popleft() for _ in free]
            prefill_new(given)
            for r, j in zip(free, given):
                fill(r, j)
        live = [r for r in range(rows) if slots[r] is not None]
        if not live:
            break
        t1 = time.perf_counter()
        strings = tokenizer is not None and any(reqs[slots[r].j].stop_strings for r in live)
        n = config.chunk if strings else N
        if index + n > S:  # drop the slots before the oldest live row (keeping P before the index)
            shift = min(min(slots[r].start for r in live), index - P)
            if shift > 0:
                state = progs.compact(state, np.int32(shift))
                stats["compactions"] = stats.get("compactions", 0) + 1
                index -= shift
                for r in live:
                    slots[r].start -= shift
        n = min(n, S - index)
        limit = 1 if queue else rows  # with requests waiting, stop at the first finished row
        state = progs.decode(state, jax.tree.map(jnp.asarray, experts), jax.tree.map(jnp.asarray, settings),
                             jnp.int32(step + n), done_limit=jnp.int32(limit))
        new_step = int(state.step)
        index += new_step - step
        step = new_step
        done = np.asarray(state.done)
        arrays = dict(tokens=np.asarray(state.tokens), n_gen=np.asarray(state.n_gen))
        if strings:
            slot_reqs = [reqs[s.j] if s is not None else _IDLE for s in slots]
            newly = mark_stop_strings(tokenizer, slot_reqs, arrays["tokens"], arrays["n_gen"], stop_at)
            if newly:
                done = done.copy()
                done[newly] = True
                state = state.replace(done=jnp.asarray(done))
        finished = [r for r in live if done[r]]
        if finished:
            arrays.update(logps=np.asarray(state.logps), reason=np.asarray(state.reason))
            for r in finished:
                harvest(r, arrays)
        stats["prefill_s"] = stats.get("prefill_s", 0.0) + t1 - t0
        stats["decode_s"] = stats.get("decode_s", 0.0) + time.perf_counter() - t1
        stats["batches"] = stats.get("batches", 0) + 1  # decode calls
    stats["decode_steps"] = stats.get("decode_steps", 0) + step
