"""Jit with explicit in/out shardings over a mesh: generic wrappers and backbone logits.

:class:`ShapeKeyedJit` and :func:`replicated_jit` are generic: callers hand them pure functions
and a rule that gives shardings per argument shapes (``sampling.sharded`` builds the sampler's
this way, ``rl.update.make_sharded_train_step`` the update step's). :func:`sharded_logits` is
the mesh version of ``models.logits``.

Layout (see ``sharding.py`` for the rules): backbone weights by logical axes; the expert bank,
router and optimizer states replicated; batch rows split over (data, fsdp); KV caches split over
batch (and kv heads). Values the host reads back (generated tokens, log-probs, flags, gradients,
metrics) come out replicated, so every process of a multi-controller run can read them without a
gather. A batch the mesh does not divide is replicated rather than split, which changes where the
work runs, never the result.

Shardings depend on shapes, so :class:`ShapeKeyedJit` keeps one ``jax.jit`` per argument
signature; signatures come from the sampler's and trainer's buckets, so the count stays bounded
and equals the number of compiles either way.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from typing import Any, Callable, Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding

from morse_jax.models.config import ModelConfig
from morse_jax.models.transformer import forward
from morse_jax.parallel.sharding import (
    activation_sharding,
    batch_shardings,
    param_shardings,
    replicated,
    shard_params,
    shape_of,
    to_global,
)

ShardingFn = Callable[[tuple, dict], tuple[Any, Any]]


def _signature(tree) -> tuple:
    leaves, treedef = jax.tree.flatten(tree)
    return treedef, tuple((tuple(shape_of(x)), str(getattr(x, "dtype", type(x).__name__))) for x in leaves)


class ShapeKeyedJit:
    """``jax.jit(fn, in_shardings, out_shardings)`` with shardings computed per argument shapes.

    ``shardings(args, static)`` returns (in_shardings per positional arg, out_shardings). Keyword
    arguments that are not static are bound to their positions. Calls place their arguments on
    the mesh first (:func:`to_global`), so host arrays work in one process and in many.
    """

    def __init__(self, fn: Callable, shardings: ShardingFn, *, static_argnames: Sequence[str] = (),
                 donate_argnums: Sequence[int] = ()):
        self.fn, self.shardings = fn, shardings
        self.static_argnames = tuple(static_argnames)
        self.donate_argnums = tuple(donate_argnums)
        self._sig = inspect.signature(fn)
        self._jits: dict = {}

    def _bind(self, args, kwargs):
        static = {k: v for k, v in kwargs.items() if k in self.static_argnames}
        dynamic = {k: v for k, v in kwargs.items() if k not in self.static_argnames}
        if dynamic:
            bound = self._sig.bind_partial(*args, **dynamic)
            names = [p for p in self._sig.parameters if p not in self.static_argnames]
            args = tuple(bound.arguments[n] for n in names if n in bound.arguments)
        return tuple(args), static

    def _get(self, args, static):
        key = (_signature(args), tuple(sorted(static.items())))
        if key not in self._jits:
            in_sh, out_sh = self.shardings(args, static)
            # jit takes no keyword arguments alongside in_shardings: static values are bound here
            # (they are part of the key, so this is the same one program per value jit would make).
            fn = functools.partial(self.fn, **static) if static else self.fn
            self._jits[key] = (jax.jit(fn, in_shardings=tuple(in_sh), out_shardings=out_sh,
                                       donate_argnums=self.donate_argnums), tuple(in_sh))
        return self._jits[key]

    def __call__(self, *args, **kwargs):
        args, static = self._bind(args, kwargs)
        jitted, in_sh = self._get(args, static)
        return jitted(*to_global(args, in_sh))

    def lower(self, *args, **kwargs):
        args, static = self._bind(args, kwargs)
        jitted, _ = self._get(args, static)
        return jitted.lower(*args)

    @property
    def num_programs(self) -> int:
        return len(self._jits)


def _like(sharding: NamedSharding, tree) -> Any:
    """One sharding for every leaf of ``tree`` (None stays an empty subtree)."""
    return jax.tree.map(lambda _: sharding, tree)


# --------------------------------------------------------------------------- backbone logits


def sharded_logits(mesh: Mesh, backbone) -> Callable:
    """Mesh version of ``morse_jax.models.logits``: returns ``fn(tokens, valid=None)`` giving
    float32 [batch, seq, vocab] logits split over batch (and vocab over ``tensor``).

    The backbone's params are placed on the mesh once, here.
    """
    cfg: ModelConfig = backbone.config
    params = shard_params(mesh, backbone.params, cfg)
    p_sh = param_shardings(mesh, params, cfg)

    def impl(params, tokens, valid):
        return forward(params, cfg, tokens, valid=valid)[0]

    def shardings(args, static):
        _, tokens, valid = args
        B, T = shape_of(tokens)
        bs = batch_shardings(mesh, (tokens, valid))
        return (p_sh, *bs), activation_sharding(mesh, ("batch", None, "vocab"), (B, T, cfg.vocab_size), cfg)

    jitted = ShapeKeyedJit(impl, shardings)

    def fn(tokens, valid=None):
        tokens = np.asarray(tokens, np.int32)
        if tokens.ndim == 1:
            tokens = tokens[None]
        valid = np.ones(tokens.shape, bool) if valid is None else np.asarray(valid, bool)
        return jitted(params, tokens, valid)

    fn.params = params  # type: ignore[attr-defined]
    fn.jit = jitted  # type: ignore[attr-defined]
    return fn


def shard_backbone(mesh: Mesh, backbone):
    """The backbone with its params placed on the mesh (a new ``Backbone``; same config/tokenizer)."""
    return dataclasses.replace(backbone, params=shard_params(mesh, backbone.params, backbone.config))




def replicated_jit(mesh: Mesh, fn: Callable, *, static_argnames: Sequence[str] = ()) -> ShapeKeyedJit:
    """jit for small host-facing computations (routing draws, metrics) in a mesh run.

    Arguments already placed on ``mesh`` keep their sharding (no gather of a sharded embedding);
    everything else (host arrays, keys, single-device arrays) goes in replicated, and every output
    comes out replicated, so each process can read the result without a gather.
    """
    rep = replicated(mesh)

    def keep_or_rep(x):
        s = getattr(x, "sharding", None)
        if isinstance(s, NamedSharding) and s.mesh == mesh:
            return s
        return rep

    def shardings(args, static):
        return tuple(jax.tree.map(keep_or_rep, a) for a in args), rep

    return ShapeKeyedJit(fn, shardings, static_argnames=static_argnames)


def replicate(mesh: Mesh, tree: Any) -> Any:
    """Place a tree (trainable params, optimizer state) replicated on every device of the mesh."""
    return to_global(tree, replicated(mesh))


__all__ = ["ShapeKeyedJit", "replicate", "replicated_jit", "shard_backbone", "sharded_logits"]
