"""Layer segments of a backbone's param tree: splitting, merging and unstacking.

``params["layers"]`` is a tuple of segments, each a dict of arrays stacked on a leading layer
axis (run under ``lax.scan``) or a tuple of per-layer dicts (run unrolled); see
``morse_jax.models.transformer``. These helpers regroup layers without touching the maths:
:func:`split_segments` puts the last ``n_adapt`` layers in their own segment(s) so LoRA experts
(and ``forward(start_layer=...)``) meet a segment boundary there; :func:`unstack_segments` turns
stacked segments into per-layer dicts. They work on host (numpy) and device arrays alike, so a
large model can be regrouped before it is placed on devices.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

Params = dict[str, Any]


def split_segments(params: Params, n_adapt: int) -> Params:
    """Regroup layers so that the last ``n_adapt`` form their own (final) segment.

    Layers of different shapes (Gemma 4) cannot share a stacked segment: there every maximal
    run of identically shaped layers is a segment, and a run crossing the cut is split there, so
    the last ``n_adapt`` layers span the final segment(s).
    Works on host (numpy) or device arrays; idempotent when the split already holds.
    """
    layers = params["layers"]
    if isinstance(layers, dict):  # tolerate an unwrapped single segment
        layers = (layers,)
    sizes = [segment_len(s) for s in layers]
    total = sum(sizes)
    if not 0 <= n_adapt <= total:
        raise ValueError(f"n_adapt must be in [0, {total}], got {n_adapt}")
    blocks = _layer_blocks(layers)
    if len({sig for sig, _ in blocks}) > 1:
        return {**params, "layers": _split_heterogeneous(blocks, total - n_adapt)}
    if n_adapt in (0, total):
        want = [total]
    else:
        want = [total - n_adapt, n_adapt]
    if sizes == want:
        return params
    merged = _concat_segments(layers)
    cut = total - n_adapt
    segs = (merged,) if len(want) == 1 else (
        jax.tree.map(lambda a: a[:cut], merged), jax.tree.map(lambda a: a[cut:], merged))
    return {**params, "layers": segs}


def _signature(tree, stacked: bool):
    """Tree structure and per-layer leaf shapes (without the layer axis when stacked)."""
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    return treedef, tuple(tuple(x.shape[1:] if stacked else x.shape) for x in leaves)


def _layer_blocks(segs) -> list[tuple[Any, Any]]:
    """[(signature, stacked segment or per-layer dict)] in layer order (unrolled layers one by one)."""
    blocks = []
    for seg in segs:
        if isinstance(seg, (tuple, list)):
            blocks.extend((_signature(lp, False), lp) for lp in seg)
        else:
            blocks.append((_signature(seg, True), seg))
    return blocks


def _split_heterogeneous(blocks, cut: int) -> tuple:
    """Stacked segments: runs of equal signature, split at layer ``cut``."""
    runs: list[tuple[Any, list]] = []
    for sig, b in blocks:
        stacked = jax.tree.map(lambda a: a[None], b) if _is_layer(b) else b
        if runs and runs[-1][0] == sig:
            runs[-1][1].append(stacked)
        else:
            runs.append((sig, [stacked]))
    out, start = [], 0
    for _, parts in runs:
        seg = parts[0] if len(parts) == 1 else jax.tree.map(lambda *xs: _cat(xs), *parts)
        n = segment_len(seg)
        if start < cut < start + n:
            out += [jax.tree.map(lambda a: a[:cut - start], seg), jax.tree.map(lambda a: a[cut - start:], seg)]
        else:
            out.append(seg)
        start += n
    return tuple(out)


def _is_layer(b) -> bool:
    """A per-layer dict (from an unrolled segment) rather than a stacked segment."""
    return np.ndim(b["attn_norm"]) == 1


def unstack_segments(params: Params) -> Params:
    """Turn every stacked segment into a tuple of per-layer dicts (unrolled execution)."""
    segs = []
    for seg in params["layers"]:
        if isinstance(seg, dict):
            n = segment_len(seg)
            seg = tuple(jax.tree.map(lambda a, i=i: a[i], seg) for i in range(n))
        segs.append(seg)
    return {**params, "layers": tuple(segs)}


def segment_len(seg) -> int:
    """Number of layers in a segment (stacked dict or tuple of per-layer dicts)."""
    if isinstance(seg, (tuple, list)):
        return len(seg)
    return int(seg["attn_norm"].shape[0])


def _concat_segments(segs):
    stacked = []
    for s in segs:
        if isinstance(s, (tuple, list)):
            s = jax.tree.map(lambda *xs: _stack(xs), *s)
        stacked.append(s)
    if len(stacked) == 1:
        return stacked[0]
    return jax.tree.map(lambda *xs: _cat(xs), *stacked)


def _stack(xs):
    return np.stack(xs) if isinstance(xs[0], np.ndarray) else jnp.stack(xs)


def _cat(xs):
    return np.concatenate(xs) if isinstance(xs[0], np.ndarray) else jnp.concatenate(xs)
