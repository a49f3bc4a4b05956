"""Orbax checkpoints of the trainable state plus JSON run metadata.

What is written: exactly the pytree handed to :meth:`Checkpointer.save` (expert bank, router
params, optimizer states, step, RNG key, ... as the training code assembles it) and a JSON
document (data cursor, resolved config, run info). The frozen backbone is never written: the
caller passes only the trainable state, and ``Checkpointer(frozen=backbone_params)`` makes
``save`` refuse any leaf that *is* a backbone array.

Layout: one orbax ``CheckpointManager`` step directory per saved step with two items,
``state`` (``PyTreeSave`` of a flat ``{name: array}`` dict) and ``metadata`` (``JsonSave``).
The flat dict makes the on-disk form independent of pytree node classes (optax states, flax
structs, namedtuples); the structure is rebuilt from the restore *target*, and the JSON keeps,
per leaf, its key path, shape, dtype, PRNG implementation (typed keys are stored as
``key_data`` and re-wrapped) and a content checksum.

Validity. Orbax writes a step into ``<step>.orbax-checkpoint-tmp-<ts>`` and renames it when
complete, so a crash mid-write leaves a tmp directory; those are reported and moved aside.
A finalised directory can still be damaged (files deleted, truncated, overwritten): restoring
reads the JSON, every array, and compares the checksums, which also catches the silent
bit flips tensorstore would otherwise return as data. :meth:`Checkpointer.restore_latest_valid`
walks back from the newest step to the newest one that passes, warning about each it skips.

A restore target that disagrees with the checkpoint (structure, shape, dtype, key impl) is a
caller error, raised as :class:`CheckpointMismatchError` and never treated as corruption.
"""

from __future__ import annotations

import datetime
import logging
import os
import re
import time
import warnings
from pathlib import Path
from typing import Any, Mapping, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

__all__ = [
    "Checkpointer",
    "Restored",
    "CheckpointCorruptError",
    "CheckpointMismatchError",
    "CheckpointWarning",
    "tree_checksums",
]

log = logging.getLogger(__name__)

FORMAT = "morse_jax.checkpoint"
VERSION = 1
_KEY_IMPLS = ("threefry2x32", "rbg", "unsafe_rbg")
INVALID_DIR = "_invalid"  # not a step name to orbax: skipped when listing steps
_TMP_RE = re.compile(r"^(\d+)\.orbax-checkpoint-tmp")


class CheckpointCorruptError(RuntimeError):
    """A checkpoint step cannot be read back intact (partial, damaged or not ours)."""


class CheckpointMismatchError(ValueError):
    """The restore target does not describe the state stored in the checkpoint."""


class CheckpointWriteError(RuntimeError):
    """Writing a step failed (a full disk, an I/O error); the message names the newest complete
    step, which a resumed run restarts from (the partial write is skipped then)."""


class CheckpointWarning(UserWarning):
    """An unusable checkpoint (or partial write) was skipped."""


class Restored(NamedTuple):
    step: int
    state: Any
    metadata: dict


def _warn(msg: str) -> None:
    log.warning(msg)
    warnings.warn(msg, CheckpointWarning, stacklevel=3)


# --------------------------------------------------------------------------- checksums
# Per leaf two 32-bit sums over the leaf's 32-bit words w_i with odd, index-dependent weights,
# modulo 2**32. Integer sums are order-independent, so the value is the same whichever device
# layout or reduction order computed it, and a change to any single word always changes both
# sums (odd weights are invertible mod 2**32).

_UINT = {8: jnp.uint8, 16: jnp.uint16, 32: jnp.uint32, 64: jnp.uint64}
_GOLD = 0x9E3779B1


def _dtype_bits(dtype) -> int:
    dtype = jnp.dtype(dtype)
    if dtype == jnp.bool_:
        return 8
    if jnp.issubdtype(dtype, jnp.floating):
        return int(jnp.finfo(dtype).bits)
    if jnp.issubdtype(dtype, jnp.integer):
        return int(jnp.iinfo(dtype).bits)
    return -1


def _words_jnp(x: jax.Array) -> jax.Array:
    x = jnp.ravel(x)
    if x.dtype == jnp.bool_:
        x = x.astype(jnp.uint8)
    bits = _dtype_bits(x.dtype)
    u = jax.lax.bitcast_convert_type(x, _UINT[bits])
    if bits == 64:  # [n] -> [n, 2] little-endian words, as numpy's view gives
        return jax.lax.bitcast_convert_type(u, jnp.uint32).reshape(-1)
    return u.astype(jnp.uint32)


def _words_np(x: np.ndarray) -> np.ndarray:
    a = np.ascontiguousarray(x).reshape(-1)
    if a.dtype == np.bool_:
        a = a.view(np.uint8)
    bits = _dtype_bits(a.dtype)
    a = a.astype(a.dtype.newbyteorder("<"), copy=False)
    u = a.view(np.dtype(f"<u{bits // 8}"))
    return u.view("<u4").astype(np.uint32) if bits == 64 else u.astype(np.uint32)


def _mix(u, i, xp):
    s1 = xp.sum(u * (i * xp.uint32(2) + xp.uint32(1)), dtype=xp.uint32)
    rot = (u << 13) | (u >> 19)
    s2 = xp.sum(rot * ((i * xp.uint32(_GOLD)) | xp.uint32(1)), dtype=xp.uint32)
    return s1, s2


@jax.jit
def _checksums_jit(leaves: list) -> jax.Array:
    out = []
    for x in leaves:
        u = _words_jnp(x)
        s1, s2 = _mix(u, jax.lax.iota(jnp.uint32, u.shape[0]), jnp)
        out.append(jnp.stack([s1, s2]))
    return jnp.stack(out).reshape(len(leaves), 2)


def _checksum_np(x: np.ndarray) -> list[int]:
    u = _words_np(x)
    with np.errstate(over="ignore"):
        s1, s2 = _mix(u, np.arange(u.size, dtype=np.uint32), np)
    return [int(s1), int(s2)]


def tree_checksums(leaves: list) -> list[list[int]]:
    """``[[s1, s2], ...]`` (Python ints) for a list of jax / numpy arrays, in order.

    Same value for the same bits whether a leaf is a numpy array or a (sharded) jax.Array.
    """
    out: list[Optional[list[int]]] = [None] * len(leaves)
    jax_idx = [i for i, x in enumerate(leaves) if isinstance(x, jax.Array)]
    for i, x in enumerate(leaves):
        if not isinstance(x, jax.Array):
            out[i] = _checksum_np(np.asarray(x))
    if jax_idx:
        sums = _checksums_jit([leaves[i] for i in jax_idx])
        if not sums.is_fully_addressable:  # multi-host: full reductions come back replicated
            assert sums.is_fully_replicated, sums.sharding
            sums = sums.addressable_data(0)
        for i, row in zip(jax_idx, np.asarray(sums).tolist()):
            out[i] = [int(v) for v in row]
    return out  # type: ignore[return-value]


# --------------------------------------------------------------------------- leaves


def _is_key(x) -> bool:
    dtype = getattr(x, "dtype", None)
    return dtype is not None and jnp.issubdtype(dtype, jax.dtypes.prng_key)


def _storage_name(i: int, path: str) -> str:
    slug = re.sub(r"[^A-Za-z0-9]+", "_", path).strip("_")[:80]
    return f"leaf{i:05d}_{slug}" if slug else f"leaf{i:05d}"


def _to_storage(state) -> tuple[dict, list[dict]]:
    """Flatten ``state`` into ``{name: array}`` plus one JSON record per leaf."""
    flat, _ = jax.tree_util.tree_flatten_with_path(state)
    if not flat:
        raise ValueError("state: has no array leaves; nothing to checkpoint")
    storage, records = {}, []
    for i, (kp, x) in enumerate(flat):
        path = jax.tree_util.keystr(kp)
        impl = None
        if isinstance(x, jax.Array):
            if _is_key(x):
                impl, x = str(jax.random.key_impl(x)), jax.random.key_data(x)
        elif isinstance(x, (np.ndarray, np.generic)):
            x = np.asarray(x)
        elif isinstance(x, (bool, int, float)):
            # As jit would see it (int32 / float32 unless x64), so an eval_shape target matches.
            x = np.asarray(x, dtype=jax.dtypes.canonicalize_dtype(np.asarray(x).dtype))
        else:
            raise ValueError(f"state{path}: unsupported leaf type {type(x).__name__}; only jax/numpy "
                             "arrays and Python scalars are checkpointed (put other values in metadata)")
        if _dtype_bits(x.dtype) not in (8, 16, 32, 64):
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
        if _is_key(t):
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


def _check_target(target, records: list[dict], step: int):
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
                raise CheckpointMismatchError(f"target{path}: sharding does not fit shape {shape}: {_short(e)}")
        specs.append((rec, kind, saved_dtype, sharding))
    return treedef, specs


# --------------------------------------------------------------------------- metadata


def _check_json(value, where: str):
    """A JSON-ready copy of ``value``; numpy scalars become Python numbers, tuples lists."""
    if isinstance(value, Mapping):
        out = {}
        for k, v in value.items():
            if not isinstance(k, str):
                raise ValueError(f"{where}: key {k!r} is not a string (JSON object keys must be)")
            out[k] = _check_json(v, f"{where}[{k!r}]")
        return out
    if isinstance(value, (list, tuple)):
        return [_check_json(v, f"{where}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, np.generic) and not isinstance(value, (np.void, np.object_)):
        value = value.item()
    if value is None or isinstance(value, (str, bool, int, float)):
        return value
    raise ValueError(f"{where}: type {type(value).__name__} is not JSON-serialisable")


def _check_step(step) -> int:
    if isinstance(step, bool) or not isinstance(step, (int, np.integer)) or step < 0:
        raise ValueError(f"step: expected a non-negative int, got {step!r}")
    return int(step)


# --------------------------------------------------------------------------- checkpointer


class Checkpointer:
    """Saves / restores the trainable state of a run under ``workdir``.

    Args:
      workdir: directory holding the step directories (created if missing). The training code
        typically passes ``<run workdir>/checkpoints``.
      max_to_keep: keep the newest N finalised checkpoints (``None``: keep all).
      async_save: ``save`` returns once arrays are copied to host; files are written in the
        background. Call :meth:`wait` (or :meth:`close`) before relying on them.
      frozen: optional pytree of backbone params. ``save`` raises if any state leaf is one of
        these arrays (identity), so the frozen backbone cannot be written by mistake.

    Not thread-safe; every process of a multi-host job must make the same calls.
    """

    def __init__(self, workdir, *, max_to_keep: Optional[int] = 3, async_save: bool = True,
                 frozen: Any = None):
        if max_to_keep is not None and (type(max_to_keep) is not int or max_to_keep < 1):
            raise ValueError(f"max_to_keep: expected a positive int or None, got {max_to_keep!r}")
        if not isinstance(workdir, (str, os.PathLike)):
            raise ValueError(f"workdir: expected a path, got {type(workdir).__name__}")
        self.workdir = Path(workdir).expanduser().resolve()
        self.workdir.mkdir(parents=True, exist_ok=True)
        self._frozen = frozen  # held so the ids below stay those of live arrays
        self._frozen_ids = {id(x) for x in jax.tree.leaves(frozen)}
        self._issued: list[int] = []  # steps handed to orbax, in order
        self._manager = ocp.CheckpointManager(
            self.workdir,
            options=ocp.CheckpointManagerOptions(
                max_to_keep=max_to_keep, enable_async_checkpointing=async_save, create=True),
        )

    # ---------------------------------------------------------------- save
    def save(self, step: int, state: Any, *, metadata: Optional[Mapping[str, Any]] = None) -> None:
        """Write ``state`` (a pytree of arrays / scalars) and ``metadata`` (JSON-able dict) as ``step``.

        ``step`` must be newer than every existing checkpoint. Only ``state`` is written; the
        backbone is never part of it. Typed PRNG keys (``jax.random.key``) and raw ``uint32`` keys
        are both supported. Asynchronous when the checkpointer was built with ``async_save``.
        """
        step = _check_step(step)
        if not isinstance(metadata, (Mapping, type(None))):
            raise ValueError(f"metadata: expected a dict, got {type(metadata).__name__}")
        user = _check_json({} if metadata is None else metadata, "metadata")
        if self._frozen_ids:
            for kp, x in jax.tree_util.tree_flatten_with_path(state)[0]:
                if id(x) in self._frozen_ids:
                    raise ValueError(f"state{jax.tree_util.keystr(kp)}: is a frozen backbone array; "
                                     "backbone weights are never written into checkpoints")
        latest = self.latest_step()
        if latest is not None and step <= latest:
            raise ValueError(f"step: {step} is not newer than the latest checkpoint step {latest}")
        storage, records = _to_storage(state)
        for rec, cs in zip(records, tree_checksums(list(storage.values()))):
            rec["checksum"] = cs
        doc = {
            "format": FORMAT, "version": VERSION, "step": step,
            "saved_at": datetime.datetime.now(datetime.timezone.utc).isoformat(),
            "jax_version": jax.__version__, "orbax_version": getattr(ocp, "__version__", "?"),
            "process_count": jax.process_count(), "leaves": records, "user": user,
        }
        self._issued.append(step)
        try:
            saved = self._manager.save(step, args=ocp.args.Composite(
                state=ocp.args.PyTreeSave(storage), metadata=ocp.args.JsonSave(doc)))
        except Exception as e:  # noqa: BLE001 -- this step's (or a pending async step's) write failed
            raise self._write_error(e) from e
        if not saved:
            raise RuntimeError(f"orbax declined to save step {step} (read-only or save policy)")

    # ---------------------------------------------------------------- queries
    def all_steps(self) -> list[int]:
        """Finalised (renamed) step directories, oldest first; validity is not checked."""
        return sorted(self._manager.all_steps())

    def latest_step(self) -> Optional[int]:
        """Newest finalised step (or the one an async save is writing), ``None`` when empty."""
        return self._manager.latest_step()

    def metadata(self, step: Optional[int] = None) -> dict:
        """The user metadata saved with ``step`` (default: latest) without reading arrays."""
        self.wait()
        return self._read_doc(self._resolve_step(step))["user"]

    # ---------------------------------------------------------------- restore
    def restore(self, step: Optional[int] = None, *, target: Any) -> tuple[Any, dict]:
        """Restore ``step`` (default: latest) into the structure of ``target``.

        ``target`` is a pytree like the saved state: concrete arrays or ``jax.ShapeDtypeStruct``
        (e.g. from ``jax.eval_shape``). jax leaves come back as ``jax.Array`` with the target's
        sharding (a ShapeDtypeStruct without one: the first local device); numpy leaves as numpy,
        Python scalars as Python scalars. Returns ``(state, metadata)``.

        Raises CheckpointMismatchError if target and checkpoint disagree, CheckpointCorruptError
        if the step cannot be read intact, FileNotFoundError if there is no checkpoint.
        """
        self.wait()
        step = self._resolve_step(step)
        state, doc = self._restore_step(step, target)
        return state, doc["user"]

    def restore_latest_valid(self, target: Any, *, quarantine: bool = True) -> Optional[Restored]:
        """Restore the newest checkpoint that reads back intact; ``None`` if there is none.

        Partial writes (orbax tmp directories) and damaged steps newer than the one restored are
        reported with a :class:`CheckpointWarning` (and the log) and, with ``quarantine``, moved to
        ``workdir/_invalid/`` so later saves can reuse their step numbers. If checkpoints exist but
        none is readable, raises CheckpointCorruptError and moves nothing (a systematic failure
        should not look like a fresh start). Target mismatches propagate as
        CheckpointMismatchError.
        """
        self.wait()
        bad_tmp = sorted(p for p in self.workdir.iterdir() if _TMP_RE.match(p.name))
        for p in bad_tmp:
            _warn(f"checkpoint: incomplete write {p} (crash during save?) ignored"
                  + ("; moving it to " + INVALID_DIR if quarantine else ""))
        if quarantine:
            self._quarantine(bad_tmp)
        self._manager.reload()
        steps = self.all_steps()
        failures = []
        for step in reversed(steps):
            try:
                state, doc = self._restore_step(step, target)
            except CheckpointCorruptError as e:
                failures.append((step, e))
                continue
            for bad, err in failures:
                _warn(f"checkpoint: step {bad} in {self.workdir} is unusable ({err}); falling back to "
                      f"step {step}" + (f"; moving it to {INVALID_DIR}" if quarantine else ""))
            if quarantine and failures:
                self._quarantine([self.workdir / str(s) for s, _ in failures])
            return Restored(step, state, doc["user"])
        if failures:
            detail = "; ".join(f"step {s}: {e}" for s, e in failures)
            raise CheckpointCorruptError(f"no readable checkpoint in {self.workdir}: {detail}")
        return None

    def wait(self) -> None:
        """Block until pending asynchronous saves are on disk (re-raises their errors as
        :class:`CheckpointWriteError`)."""
        try:
            self._manager.wait_until_finished()
        except Exception as e:  # noqa: BLE001
            raise self._write_error(e) from e

    def _write_error(self, e: BaseException) -> CheckpointWriteError:
        steps = set(self._manager.all_steps())
        done = max(steps) if steps else None
        failed = [s for s in self._issued[-2:] if s not in steps]  # this save, or the async one before it
        what = f"step {' or '.join(map(str, failed))}" if failed else "a checkpoint"
        cause = " ".join(str(e).split())[:400]
        keep = (f"the newest complete checkpoint is step {done}; a resumed run restarts from it" if done is not None
                else "there is no complete checkpoint yet; a resumed run starts from scratch")
        msg = f"checkpoint: writing {what} in {self.workdir} failed; {keep} (cause: {type(e).__name__}: {cause})"
        log.error(msg)
        return CheckpointWriteError(msg)

    def close(self) -> None:
        self._manager.close()

    def __enter__(self) -> "Checkpointer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---------------------------------------------------------------- internals
    def _resolve_step(self, step: Optional[int]) -> int:
        self._manager.reload()  # another process may have written steps since we listed them
        if step is None:
            step = self.latest_step()
            if step is None:
                raise FileNotFoundError(f"no checkpoint in {self.workdir}")
            return step
        step = _check_step(step)
        if step not in self._manager.all_steps():
            raise FileNotFoundError(f"step: no checkpoint for step {step} in {self.workdir}")
        return step

    def _read_doc(self, step: int) -> dict:
        try:
            doc = self._manager.restore(step, args=ocp.args.Composite(metadata=ocp.args.JsonRestore()))
            doc = doc["metadata"]
        except Exception as e:  # any failure to read our own JSON means the step is damaged
            raise CheckpointCorruptError(f"step {step}: metadata unreadable: {type(e).__name__}: {_short(e)}") from e
        if not isinstance(doc, dict) or doc.get("format") != FORMAT or not isinstance(doc.get("leaves"), list):
            raise CheckpointCorruptError(f"step {step} is not a {FORMAT} checkpoint (metadata malformed)")
        if doc.get("version") != VERSION:
            raise CheckpointCorruptError(f"step {step}: unsupported format version {doc.get('version')!r}")
        for rec in doc["leaves"]:
            try:
                ok = (isinstance(rec["name"], str) and isinstance(rec["path"], str)
                      and all(type(d) is int for d in rec["shape"]) and jnp.dtype(rec["dtype"]) is not None
                      and isinstance(rec["key_impl"], (str, type(None))) and len(rec["checksum"]) == 2)
            except (KeyError, TypeError, ValueError):
                ok = False
            if not ok:
                raise CheckpointCorruptError(f"step {step}: malformed leaf record {_short(repr(rec), 120)}")
        return doc

    def _restore_step(self, step: int, target: Any) -> tuple[Any, dict]:
        doc = self._read_doc(step)
        treedef, specs = _check_target(target, doc["leaves"], step)
        item, args = {}, {}
        for rec, kind, dtype, sharding in specs:
            shape = tuple(rec["shape"])
            if kind == "jax":
                item[rec["name"]] = jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)
                args[rec["name"]] = ocp.ArrayRestoreArgs(sharding=sharding, global_shape=shape, dtype=dtype)
            else:
                item[rec["name"]] = np.zeros(shape, dtype)
                args[rec["name"]] = ocp.RestoreArgs(restore_type=np.ndarray, dtype=dtype)
        try:
            raw = self._manager.restore(step, args=ocp.args.Composite(
                state=ocp.args.PyTreeRestore(item, restore_args=args)))["state"]
            arrays = [raw[rec["name"]] for rec, *_ in specs]
        except Exception as e:
            raise CheckpointCorruptError(f"step {step}: arrays unreadable: {type(e).__name__}: {_short(e)}") from e
        for (rec, *_), x, cs in zip(specs, arrays, tree_checksums(arrays)):
            if tuple(np.shape(x)) != tuple(rec["shape"]) or cs != rec["checksum"]:
                raise CheckpointCorruptError(f"step {step}: {rec['path']}: content does not match its "
                                             "checksum (data damaged)")
        leaves = []
        for (rec, kind, _, _), x in zip(specs, arrays):
            if rec["key_impl"] is not None:
                x = jax.random.wrap_key_data(x, impl=rec["key_impl"])
            elif kind == "npscalar":
                x = np.asarray(x)[()]
            elif kind in ("bool", "int", "float"):
                x = {"bool": bool, "int": int, "float": float}[kind](np.asarray(x).item())
            leaves.append(x)
        return jax.tree_util.tree_unflatten(treedef, leaves), doc

    def _quarantine(self, paths: list[Path]) -> None:
        """Move unusable step directories under ``workdir/_invalid`` (primary host only)."""
        if not paths:
            return
        if jax.process_index() == 0:
            dest = self.workdir / INVALID_DIR
            dest.mkdir(exist_ok=True)
            for p in paths:
                if p.exists():
                    p.rename(dest / f"{p.name}.{time.time_ns()}")
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils
            multihost_utils.sync_global_devices("morse_jax.checkpoint.quarantine")
        self._manager.reload()


def _short(e: BaseException, n: int = 240) -> str:
    s = " ".join(str(e).split())
    return s if len(s) <= n else s[: n - 3] + "..."
