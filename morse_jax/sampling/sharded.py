"""The sampler's prefill and decode with explicit in/out shardings over a device mesh.

The sampling side states its layout with ``morse_jax.parallel``'s rules and hands its pure
functions (``sampling.loop``) to the generic :class:`~morse_jax.parallel.jit.ShapeKeyedJit`;
``parallel`` knows nothing of the sampler.

Layout: backbone weights by logical axes; the expert bank replicated; prompt, expert-slot and
settings rows split over (data, fsdp); the KV cache over batch (and kv heads); logits over batch
(and vocab). What the host reads back between decode chunks (key, step, tokens, log-probs,
counts, reasons, flags, positions) is replicated, so every process of a multi-controller run
reads it without a gather. A batch the mesh does not divide is replicated rather than split,
which changes where the work runs, never the result.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
from jax.sharding import Mesh

from morse_jax.parallel.jit import ShapeKeyedJit
from morse_jax.parallel.sharding import (
    activation_sharding,
    cache_shardings,
    param_shardings,
    replicated,
    shard_params,
    shape_of,
)
from morse_jax.sampling.loop import LoopConfig, empty_cache
from morse_jax.sampling.state import PrefillOutput, SamplingState


def shard_sampler_functions(mesh: Mesh, lc: LoopConfig, params: Any, prefill: Callable,
                            decode: Callable) -> tuple[Any, ShapeKeyedJit, ShapeKeyedJit]:
    """(params placed on the mesh, sharded prefill, sharded decode).

    ``prefill`` / ``decode``: ``sampling.loop.prefill`` / ``decode`` with ``lc`` bound (the
    Sampler may wrap them, e.g. to count traces); the results keep their call signatures, and the
    decode still donates its state (argument 2).
    """
    cfg = lc.cfg
    params = shard_params(mesh, params, cfg)
    p_sh = param_shardings(mesh, params, cfg)
    rep = replicated(mesh)

    def every(tree):  # one replicated sharding per leaf (None stays an empty subtree)
        return jax.tree.map(lambda _: rep, tree)

    def row(x, *rest_logical):
        return activation_sharding(mesh, ("batch",) + rest_logical, shape_of(x), cfg)

    def rows(tree):  # every leaf split over its leading (batch) axis only
        return jax.tree.map(lambda x: row(x, *(None,) * (len(shape_of(x)) - 1)), tree)

    def prefill_shardings(args, static):
        _, bank, batch, experts, n_chunks = args
        B, P = shape_of(batch.tokens)
        cache = jax.eval_shape(lambda: empty_cache(lc, params, B, static["cache_len"]))
        states = None
        if lc.capture_layer is not None:
            states = activation_sharding(mesh, ("batch", None, None), (B, P, cfg.hidden_size), cfg)
        out_sh = PrefillOutput(logits=activation_sharding(mesh, ("batch", None), (B, cfg.vocab_size), cfg),
                               cache=cache_shardings(mesh, cache, cfg), pos=rep, prefix_states=states)
        return (p_sh, every(bank), rows(batch), rows(experts), rep), out_sh

    def state_shardings(state: SamplingState) -> SamplingState:
        states = None if state.states is None else row(state.states, None, None)
        return SamplingState(key=every(state.key), logits=row(state.logits, None),
                             cache=cache_shardings(mesh, state.cache, cfg), pos=rep, step=rep, tokens=rep,
                             logps=rep, n_gen=rep, reason=rep, done=rep, states=states)

    def decode_shardings(args, static):
        _, bank, state, experts, settings, stop_end = args
        st = state_shardings(state)
        return (p_sh, every(bank), st, rows(experts), rows(settings), rep), st

    return (params, ShapeKeyedJit(prefill, prefill_shardings, static_argnames=("cache_len", "chunk")),
            ShapeKeyedJit(decode, decode_shardings, donate_argnums=(2,)))


__all__ = ["shard_sampler_functions"]
