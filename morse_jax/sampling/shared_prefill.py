"""One prefill per distinct prompt: requests that would prefill identically share it.

HGRPO samples M candidates per (node, route): the same prompt under the same expert set, so
their prefills are the same computation M times (the quickstart's M = 2, the learning family's
M = 4, the paper's more). The sampler prefills each distinct request once, in a smaller batch
bucket, and copies the result (last-token logits, KV cache rows, prompt length, captured
residuals) to every row that shares it before decoding; the rows then diverge by sampling.

Two requests share a prefill when everything the prefill reads is equal: prompt tokens, per-token
prompt roles, the active expert set and its weights, and the generated-turn role (kept in the key
although the prefill reads it only through the last prompt tokens' roles, so that a change to
that rule cannot silently merge rows that differ).
"""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from morse_jax.sampling.requests import Request
from morse_jax.sampling.state import PrefillOutput


def prefill_key(r: Request) -> tuple:
    """What a request's prefill reads: requests with equal keys prefill identically."""
    return (tuple(r.prompt_ids), tuple(r.prompt_roles), tuple(r.expert_ids),
            tuple(float(w) for w in r.expert_weights), r.role)


def prefill_groups(reqs: Sequence[Request]) -> list[int]:
    """Per request, the index of the first request whose prefill it can reuse (itself when first)."""
    first: dict[tuple, int] = {}
    return [first.setdefault(prefill_key(r), i) for i, r in enumerate(reqs)]


def cache_row_layout(empty_cache_for_rows) -> tuple:
    """Per leaf of the KV cache (``jax.tree.leaves`` order), ``(axis, entries per row)`` of its
    batch axis, or None for a leaf without one (the slot index).

    ``empty_cache_for_rows(b)`` builds the cache for b rows (only its shapes are evaluated). Why
    "entries per row": the fused decode layout folds batch and kv heads into one axis
    (keys [B*K, S/T, D, T]), so a row is a block of K entries there; the model layout has K = 1.
    """
    one = jax.tree.leaves(jax.eval_shape(lambda: empty_cache_for_rows(1)))
    two = jax.tree.leaves(jax.eval_shape(lambda: empty_cache_for_rows(2)))
    layout = []
    for a, b in zip(one, two):
        diff = [ax for ax, (m, n) in enumerate(zip(a.shape, b.shape)) if m != n]
        layout.append((diff[0], a.shape[diff[0]]) if diff else None)
    return tuple(layout)


def take_cache_rows(cache, index: jax.Array, layout: tuple):
    """The KV cache whose row r is row ``index[r]`` of ``cache`` (int32[B] into its U rows);
    ``layout``: :func:`cache_row_layout` of the cache (static)."""
    B = index.shape[0]
    leaves, treedef = jax.tree.flatten(cache)
    assert len(leaves) == len(layout), "cache layout does not match the cache"
    rows = []
    for x, lay in zip(leaves, layout):
        if lay is None:
            rows.append(x)
            continue
        ax, k = lay
        blocks = x.reshape(x.shape[:ax] + (x.shape[ax] // k, k) + x.shape[ax + 1:])  # [.., U, k, ..]
        taken = jnp.take(blocks, index, axis=ax)  # [.., B, k, ..]
        rows.append(taken.reshape(x.shape[:ax] + (B * k,) + x.shape[ax + 1:]))
    return jax.tree.unflatten(treedef, rows)


def share_rows(pre: PrefillOutput, index: jax.Array, layout: tuple) -> PrefillOutput:
    """Row r of the result is row ``index[r]`` of ``pre``.

    pre: the prefill of U distinct rows (a batch bucket >= U). index: int32[B] into those rows.
    layout: ``cache_row_layout`` of the cache (static). Returns the prefill of B rows.
    """
    take = lambda a: None if a is None else jnp.take(a, index, axis=0)  # noqa: E731
    return PrefillOutput(logits=take(pre.logits), cache=take_cache_rows(pre.cache, index, layout), pos=take(pre.pos),
                         prefix_states=take(pre.prefix_states))


def row_index(groups: Sequence[int], rows: int) -> tuple[list[int], np.ndarray]:
    """(the distinct requests' indices in order, int32[rows]: each row's position among them).
    Rows past ``len(groups)`` are padding (done from the start) and read distinct row 0."""
    distinct = sorted(set(groups))
    where = {g: j for j, g in enumerate(distinct)}
    index = np.zeros(rows, np.int32)
    index[:len(groups)] = [where[g] for g in groups]
    return distinct, index

