"""Logical-axis sharding rules for backbone params, KV caches, batches and activations.

Every array dimension gets a *logical* name; :data:`RULES` maps names to mesh axes:

================  ==========================  =============================================
logical axis      mesh axes (first that fits)  where
================  ==========================  =============================================
``batch``         (data, fsdp), data, fsdp     batch rows of inputs, caches, activations
``batch_kv``      (data, fsdp, tensor), ...    the sampler's fused [B*K] cache axis
``vocab``         tensor                       embedding rows, LM head columns, logits
``embed``         fsdp                         hidden dimension of every weight matrix
``heads``         tensor                       q output / o input (H*D)
``kv_heads``      tensor                       k, v output (K*D); cache kv-head axis
``mlp``           tensor                       MLP width f
``qkv`` / ``gu``  tensor                       the sampler's fused q|k|v and gate|up rows
``layers``, None  replicated                   stacked layer axis, norms, sequence, head_dim
================  ==========================  =============================================

A dimension the chosen mesh axes do not divide falls back to the next candidate and finally to
replication: a mesh never makes a model fail, it only changes how much each device holds.
When a :class:`ModelConfig` is given, ``heads`` / ``kv_heads`` also require the head *counts*
to divide, so that no head is split across devices.

The expert bank, the router and optimizer states are replicated (they are small: megabytes).
MoR's adapter (``morse_jax.mor.params``: 0.16 B parameters on a 1B backbone) is not:
:func:`mor_param_specs` splits each factor's model-width axis as the backbone splits the same
projection's kernel (A's d_in and a router's d_in like the kernel's input, B's d_out like its
output), so a LoRA delta comes out sharded like the frozen output it is added to; the layer,
LoRA and rank axes are replicated. Optimizer states of the adapter take the same specs.

Param trees understood: the backbone's (``models.transformer.param_shapes``: stacked segments
``[L, ...]`` or unrolled per-layer dicts) and the sampler's fused ``decode_params``. Cache trees:
``models.transformer.init_cache`` and ``sampling.decode.init_decode_cache``.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from morse_jax.models.config import ModelConfig

RULES: dict[str, tuple[tuple[str, ...], ...]] = {
    "batch": (("data", "fsdp"), ("data",), ("fsdp",)),
    "batch_kv": (("data", "fsdp", "tensor"), ("data", "fsdp"), ("data",), ("fsdp",)),
    "vocab": (("tensor",),),
    "embed": (("fsdp",),),
    "heads": (("tensor",),),
    "kv_heads": (("tensor",),),
    "mlp": (("tensor",),),
    "qkv": (("tensor",),),
    "gu": (("tensor",),),
}

# Logical axes of each backbone weight, without the stacked layer axis.
_KERNELS = {
    "q": ("embed", "heads"), "k": ("embed", "kv_heads"), "v": ("embed", "kv_heads"), "o": ("heads", "embed"),
    "gate": ("embed", "mlp"), "up": ("embed", "mlp"), "down": ("mlp", "embed"),
}
_BIASES = {"q": ("heads",), "k": ("kv_heads",), "v": ("kv_heads",), "o": (None,), "gate": ("mlp",),
           "up": ("mlp",), "down": (None,)}
# decode_params: weights stored [d_out, d_in].
_FUSED_W = {"qkv": ("qkv", "embed"), "o": ("embed", "heads"), "gu": ("gu", "embed"), "down": ("embed", "mlp")}
_FUSED_B = {"qkv": ("qkv",), "o": (None,), "gu": ("gu",), "down": (None,)}
_TOP = {"embed": ("vocab", "embed"), "lm_head": ("embed", "vocab"), "head": ("vocab", "embed")}


def _name(k) -> str | int:
    for attr in ("key", "idx", "name"):
        if hasattr(k, attr):
            return getattr(k, attr)
    return str(k)


def _count_ok(logical: str, n_shards: int, cfg: ModelConfig | None, size: int) -> bool:
    """Head-aligned sharding: with a config, head counts (not just widths) must divide. Layers
    may differ (Gemma 4: 16 kv heads of 256 on sliding layers, 4 of 512 on full ones), so the
    count is that of every layer whose projection has this width."""
    if cfg is None or logical not in ("heads", "kv_heads"):
        return True
    counts = set()
    for i in range(cfg.num_layers):
        n_heads = cfg.num_heads if logical == "heads" else cfg.layer_kv_heads(i)
        if n_heads * cfg.layer_head_dim(i) == size:
            counts.add(n_heads)
    if not counts:  # a width no layer has: fall back to the model-wide count
        counts.add(cfg.num_heads if logical == "heads" else cfg.num_kv_heads)
    return all(c % n_shards == 0 for c in counts)


def mesh_axes_for(mesh: Mesh, logical: str | None, size: int, cfg: ModelConfig | None = None,
                  used: Sequence[str] = ()) -> tuple[str, ...] | None:
    """Mesh axes one dimension of ``size`` is split over (None: replicated).

    Candidates from :data:`RULES` are tried in order; axes of size 1 are dropped, axes already
    used by another dimension of the same array are skipped, and a candidate is taken only if its
    shard count divides ``size``.
    """
    if logical is None:
        return None
    if logical not in RULES:
        raise ValueError(f"unknown logical axis {logical!r}; known: {sorted(RULES)}")
    for cand in RULES[logical]:
        axes = tuple(a for a in cand if mesh.shape.get(a, 1) > 1 and a not in used)
        if not axes:
            continue
        n = math.prod(mesh.shape[a] for a in axes)
        if size % n == 0 and _count_ok(logical, n, cfg, size):
            return axes
    return None


def logical_spec(mesh: Mesh, logical: Sequence[str | None], shape: Sequence[int],
                 cfg: ModelConfig | None = None) -> P:
    """PartitionSpec for an array of ``shape`` whose dimensions have the ``logical`` names."""
    if len(logical) != len(shape):
        raise ValueError(f"logical axes {tuple(logical)} do not match shape {tuple(shape)}")
    used: list[str] = []
    out = []
    for name, size in zip(logical, shape):
        axes = mesh_axes_for(mesh, name, int(size), cfg, used)
        if axes:
            used.extend(axes)
        out.append(None if not axes else axes[0] if len(axes) == 1 else axes)
    while out and out[-1] is None:
        out.pop()
    return P(*out)


def param_logical_axes(path: tuple, ndim: int) -> tuple[str | None, ...]:
    """Logical axes of one backbone / decode-params leaf, from its pytree path and rank.

    A leaf with one more dimension than its rule is a stacked segment: the leading layer axis is
    replicated. Norms, unknown leaves and scalars are replicated.
    """
    names = [_name(k) for k in path]
    rule: tuple | None = None
    if len(names) == 1 and names[0] in _TOP:
        rule = _TOP[names[0]]
    elif names and names[0] == "layers":
        strs = [n for n in names if isinstance(n, str)]
        if len(strs) >= 3:
            leaf, parent = strs[-1], strs[-2]
            if leaf == "kernel":
                rule = _KERNELS.get(parent)
            elif leaf == "w":
                rule = _FUSED_W.get(parent)
            elif leaf == "bias":
                rule = _BIASES.get(parent, _FUSED_B.get(parent))
    if rule is None:
        return (None,) * ndim
    if ndim == len(rule) + 1:
        return (None, *rule)
    if ndim != len(rule):
        return (None,) * ndim
    return rule


# MoR adapter leaves (without the layer axis): which kernel axis (0 = d_in, 1 = d_out) each width follows.
_MOR = {"a": (None, 0, None), "b": (None, None, 1), "router": (0, None), "gate": (0, None)}


def mor_logical_axes(path: tuple, ndim: int) -> tuple[str | None, ...]:
    """Logical axes of one MoR adapter leaf ({"a"|"b"|"router"|"gate": {target: [L, ...]}})."""
    names = [_name(k) for k in path]
    rule = _MOR.get(names[0]) if len(names) == 2 else None
    if rule is None or names[1] not in _KERNELS or ndim != len(rule) + 1:
        return (None,) * ndim
    return (None, *(None if i is None else _KERNELS[names[1]][i] for i in rule))


def _tree_specs(mesh: Mesh, params: Any, cfg: ModelConfig | None, logical_axes) -> Any:
    """PartitionSpec per leaf from ``logical_axes(path, ndim)`` (arrays or ShapeDtypeStructs)."""
    return jax.tree_util.tree_map_with_path(
        lambda p, x: logical_spec(mesh, logical_axes(p, len(shape_of(x))), shape_of(x), cfg), params)


def _named(mesh: Mesh, specs: Any) -> Any:
    return jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda x: isinstance(x, P))


def mor_param_specs(mesh: Mesh, params: Any, cfg: ModelConfig | None = None) -> Any:
    """PartitionSpec per leaf of a MoR adapter tree (arrays or ShapeDtypeStructs)."""
    return _tree_specs(mesh, params, cfg, mor_logical_axes)


def mor_param_shardings(mesh: Mesh, params: Any, cfg: ModelConfig | None = None) -> Any:
    """NamedSharding per leaf of a MoR adapter tree (place it with :func:`to_global`)."""
    return _named(mesh, mor_param_specs(mesh, params, cfg))


def shape_of(x) -> tuple[int, ...]:
    """Shape of an array, ShapeDtypeStruct, typed PRNG key or Python scalar."""
    return tuple(x.shape) if hasattr(x, "shape") else tuple(np.shape(x))


def param_specs(mesh: Mesh, params: Any, cfg: ModelConfig | None = None) -> Any:
    """PartitionSpec per leaf of a backbone (or decode-params) tree."""
    return _tree_specs(mesh, params, cfg, param_logical_axes)


def param_shardings(mesh: Mesh, params: Any, cfg: ModelConfig | None = None) -> Any:
    """NamedSharding per leaf of a backbone (or decode-params) tree."""
    return _named(mesh, param_specs(mesh, params, cfg))


def shard_params(mesh: Mesh, params: Any, cfg: ModelConfig | None = None) -> Any:
    """Place a backbone (or decode-params) tree on the mesh; host arrays become global arrays."""
    return to_global(params, param_shardings(mesh, params, cfg))


def cache_logical_axes(path: tuple, ndim: int) -> tuple[str | None, ...]:
    """Logical axes of one KV-cache leaf (model cache or the sampler's decode cache)."""
    names = [_name(k) for k in path]
    top = names[0] if names else None
    if top == "valid":
        return ("batch", None)
    if top == "index" or ndim == 0:
        return (None,) * ndim
    if top in ("k", "v") and ndim in (3, 4):  # decode cache: keys [B*K, S/T, D, T], values [B*K, S, D]
        return ("batch_kv",) + (None,) * (ndim - 1)
    if top == "layers":  # model cache: [(L,) B, S, K, D]
        rule = ("batch", None, "kv_heads", None)
        return (None, *rule) if ndim == 5 else rule if ndim == 4 else (None,) * ndim
    return (None,) * ndim


def cache_shardings(mesh: Mesh, cache: Any, cfg: ModelConfig | None = None) -> Any:
    """NamedSharding per leaf of a KV cache (arrays or ShapeDtypeStructs)."""
    return jax.tree_util.tree_map_with_path(
        lambda p, x: NamedSharding(mesh, logical_spec(mesh, cache_logical_axes(p, len(shape_of(x))), shape_of(x), cfg)),
        cache)


def batch_sharding(mesh: Mesh, batch_size: int | None = None, ndim: int = 1) -> NamedSharding:
    """Rows split over (data, fsdp); with ``batch_size``, the best split that divides it."""
    if batch_size is None:
        axes = tuple(a for a in ("data", "fsdp") if mesh.shape[a] > 1)
        spec = P(axes if len(axes) > 1 else axes[0]) if axes else P()
        return NamedSharding(mesh, spec)
    return NamedSharding(mesh, logical_spec(mesh, ("batch",) + (None,) * (ndim - 1), (batch_size,) + (1,) * (ndim - 1)))


def batch_shardings(mesh: Mesh, tree: Any) -> Any:
    """Every leaf's leading axis is the batch (scalars replicated)."""
    def one(x):
        shape = shape_of(x)
        if not shape:
            return replicated(mesh)
        return NamedSharding(mesh, logical_spec(mesh, ("batch",) + (None,) * (len(shape) - 1), shape))

    return jax.tree.map(one, tree)


def activation_sharding(mesh: Mesh, logical: Sequence[str | None], shape: Sequence[int],
                        cfg: ModelConfig | None = None) -> NamedSharding:
    """Sharding of an activation, e.g. logits ``("batch", None, "vocab")``."""
    return NamedSharding(mesh, logical_spec(mesh, logical, shape, cfg))


def constrain(x: jax.Array, mesh: Mesh, logical: Sequence[str | None], cfg: ModelConfig | None = None) -> jax.Array:
    """``with_sharding_constraint`` by logical axes (inside jit)."""
    return jax.lax.with_sharding_constraint(x, activation_sharding(mesh, logical, x.shape, cfg))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


# --------------------------------------------------------------------------- placing host data


def _from_host(x: np.ndarray, sharding: NamedSharding) -> jax.Array:
    if jax.process_count() == 1:
        return jax.device_put(x, sharding)
    # Multi-controller: every process holds the same global value; each places its own shards.
    return jax.make_array_from_callback(x.shape, sharding, lambda idx: x[idx])


def _place(x, sharding: NamedSharding):
    if isinstance(x, jax.ShapeDtypeStruct):
        return x
    if isinstance(x, jax.Array):
        if x.sharding.is_equivalent_to(sharding, x.ndim):
            return x
        if jax.process_count() == 1 or not x.is_fully_addressable:
            return jax.device_put(x, sharding)  # on-device (global) reshard
        if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            data = _from_host(np.asarray(jax.random.key_data(x)),
                              NamedSharding(sharding.mesh, P(*sharding.spec)))
            return jax.random.wrap_key_data(data, impl=jax.random.key_impl(x))
        return _from_host(np.asarray(x), sharding)
    return _from_host(np.asarray(x), sharding)


def to_global(tree: Any, shardings: Any) -> Any:
    """Put every leaf of ``tree`` on the mesh with its sharding (a matching tree, or one sharding
    for all). Host arrays and single-device arrays become global arrays, in one process or many
    (each process must then pass the same values); arrays already placed so are returned as is."""
    # A leaf shared by two paths (the sampler's tied "head" is its "embed") is placed once.
    done: dict = {}

    def place(x, sharding):
        key = (id(x), sharding)
        if key not in done:
            done[key] = (x, _place(x, sharding))  # keep x alive: its id must not be reused
        return done[key][1]

    if isinstance(shardings, NamedSharding):
        return jax.tree.map(lambda x: place(x, shardings), tree)
    return jax.tree.map(place, tree, shardings)
