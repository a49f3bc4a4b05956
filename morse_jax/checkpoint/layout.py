"""The on-disk layout of a step: the flat ``{name: array}`` storage dict, one JSON record per leaf,
and the checks that match a restore target to the records (structure, shape, dtype, key impl)."""

from __future__ import annotations

import re
from typing import Any, Mapping, Optional

import jax
import jax.numpy as jnp
import numpy as np

from morse_jax.checkpoint.checksums import dtype_bits
from morse_jax.checkpoint.errors import CheckpointMismatchError, short_message

FORMAT = "morse_jax.checkpoint"
VERSION = 1
_KEY_IMPLS = ("threefry2x32", "rbg", "unsafe_rbg")
INVALID_DIR = "_invalid"  # not a step name to orbax: skipped when listing steps
TMP_RE = re.compile(r"^(\d+)\.orbax-checkpoint-tmp")  # orbax's in-progress step directories


def is_key(x) -> bool:
    """Whether ``x`` is a typed PRNG key array (stored as its key data)."""
    dtype = getattr(x, "dtype", None)
    return dtype is not None and jnp.issubdtype(dtype, jax.dtypes.prng_key)


def _storage_name(i: int, path: str) -> str:
    slug = re.sub(r"[^A-Za-z0-9]+", "_", path).strip("_")[:80]
    return f"leaf{i:05d}_{slug}" if slug else f"leaf{i:05d}"


def to_storage(state) -> tuple[dict, list[dict]]:
    """Flatten ``state`` into ``{name: array}`` plus one JSON record per leaf."""
    flat, _ = jax.tree_util.tree_flatten_with_path(state)
    if not flat:
        raise ValueError("state: has no array leaves; nothing to checkpoint")
    storage, records = {}, []
    for i, (kp, x) in enumerate(flat):
        path = jax.tree_util.keystr(kp)
        impl = None
        if isinstance(x, jax.Array):
            if is_key(x):
                impl, x = str(jax.random.key_impl(x)), jax.random.key_data(x)
        elif isinstance(x, (np.ndarray, np.generic)):
            x = np.asarray(x)
        elif isinstance(x, (bool, int, float)):
            # As jit would see it (int32 / float32 unless x64), so an eval_shape target matches.
            x = np.asarray(x, dtype=jax.dtypes.canonicalize_dtype(np.asarray(x).dtype))
        else:
            raise ValueError(f"state{path}: unsupported leaf type {type(x).__name__}; only jax/numpy "
                             "arrays and Python scalars are checkpointed (put other values in metadata)")
        if dtype_bits(x.dtype) not in (8, 16, 32, 64):
            raise ValueError(f"state{path}: unsupported dtype {x.dtype}")
        name = _storage_name(i, path)
        storage[name] = x
        records.append({"name": name, "path": path, "shape": list(x.shape),
                        "dtype": jnp.dtype(x.dtype).name, "key_impl": impl})
    return storage, records


def _target_spec(path: str, t) -> tuple[str, tuple, Any, Optional[str], Any]:
    """(kind, storage shape, storage dtype, key impl, sharding) for one target leaf."""
    if isinstance(t, (jax.Array, jax.ShapeDtypeStruct)):
        sharding = getattr(t, "sharding", None) or jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
        if is_key(t):
            data = jax.eval_shape(jax.random.key_data, jax.ShapeDtypeStruct(t.shape, t.dtype))
            if isinstance(t, jax.Array):
                sharding = jax.random.key_data(t).sharding
            elif not isinstance(sharding, (jax.sharding.NamedSharding, jax.sharding.SingleDeviceSharding)):
                raise ValueError(f"target{path}: a typed-key ShapeDtypeStruct needs a NamedSharding or "
                                 f"SingleDeviceSharding (got {type(sharding).__name__}); pass a key array")
            impl = str(jax.random.key_impl(t)) if isinstance(t, jax.Array) else _impl_of_dtype(t.dtype)
            return "jax", tuple(data.shape), jnp.dtype(data.dtype), impl, sharding
        return "jax", tuple(t.shape), jnp.dtype(t.dtype), None, sharding
    if isinstance(t, (np.ndarray, np.generic)):
        return ("numpy" if isinstance(t, np.ndarray) else "npscalar"), t.shape, t.dtype, None, None
    if isinstance(t, (bool, int, float)):
        return type(t).__name__, (), np.asarray(t).dtype, None, None
    raise ValueError(f"target{path}: unsupported leaf type {type(t).__name__}")


def _impl_of_dtype(dtype) -> str:
    """Name of the PRNG implementation of a typed-key dtype (``key<fry>`` -> ``threefry2x32``)."""
    for impl in _KEY_IMPLS:
        if jax.eval_shape(lambda: jax.random.key(0, impl=impl)).dtype == dtype:
            return impl
    raise ValueError(f"unknown PRNG key dtype {dtype}")


def check_target(target, records: list[dict], step: int):
    """Match the target's leaves to the stored records; returns (treedef, per-leaf specs)."""
    flat, treedef = jax.tree_util.tree_flatten_with_path(target)
    paths = [jax.tree_util.keystr(kp) for kp, _ in flat]
    stored = {r["path"]: r for r in records}
    missing = [p for p in paths if p not in stored]
    extra = sorted(set(stored) - set(paths))
    if missing or extra:
        raise CheckpointMismatchError(
            f"checkpoint step {step}: target structure differs from the stored state; "
            f"in target only: {missing[:8]}{'...' if len(missing) > 8 else ''}; "
            f"in checkpoint only: {extra[:8]}{'...' if len(extra) > 8 else ''}")
    specs = []
    for path, (_, t) in zip(paths, flat):
        rec = stored[path]
        kind, shape, dtype, impl, sharding = _target_spec(path, t)
        saved_dtype = jnp.dtype(rec["dtype"])
        if impl != rec["key_impl"]:
            raise CheckpointMismatchError(
                f"target{path}: PRNG key impl {impl!r} but checkpoint step {step} stored {rec['key_impl']!r}")
        if tuple(rec["shape"]) != shape:
            raise CheckpointMismatchError(
                f"target{path}: shape {shape} but checkpoint step {step} stored {tuple(rec['shape'])}")
        # A Python scalar target only fixes the kind of number; keep the stored width.
        same = (saved_dtype.kind == np.dtype(dtype).kind if kind in ("bool", "int", "float")
                else saved_dtype == dtype)
        if not same:
            raise CheckpointMismatchError(
                f"target{path}: dtype {np.dtype(dtype).name} but checkpoint step {step} stored {saved_dtype.name}")
        if sharding is not None:
            try:
                sharding.shard_shape(shape)
            except Exception as e:  # indivisible / wrong rank: the caller's layout, not corruption
                raise CheckpointMismatchError(f"target{path}: sharding does not fit shape {shape}: {short_message(e)}")
        specs.append((rec, kind, saved_dtype, sharding))
    return treedef, specs


# --------------------------------------------------------------------------- metadata documents


def check_json(value, where: str):
    """A JSON-ready copy of ``value``; numpy scalars become Python numbers, tuples lists."""
    if isinstance(value, Mapping):
        out = {}
        for k, v in value.items():
            if not isinstance(k, str):
                raise ValueError(f"{where}: key {k!r} is not a string (JSON object keys must be)")
            out[k] = check_json(v, f"{where}[{k!r}]")
        return out
    if isinstance(value, (list, tuple)):
        return [check_json(v, f"{where}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, np.generic) and not isinstance(value, (np.void, np.object_)):
        value = value.item()
    if value is None or isinstance(value, (str, bool, int, float)):
        return value
    raise ValueError(f"{where}: type {type(value).__name__} is not JSON-serialisable")


def check_step(step) -> int:
    """``step`` as an int, or ValueError unless it is a non-negative integer."""
    if isinstance(step, bool) or not isinstance(step, (int, np.integer)) or step < 0:
        raise ValueError(f"step: expected a non-negative int, got {step!r}")
    return int(step)

