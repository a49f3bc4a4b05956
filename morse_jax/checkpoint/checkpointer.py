"""The ``Checkpointer``: saves and restores a run's trainable state through an orbax
``CheckpointManager`` (layout and validity: see the package docstring)."""

from __future__ import annotations

import datetime
import logging
import os
import time
from pathlib import Path
from typing import Any, Mapping, Optional

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

from morse_jax.checkpoint.checksums import tree_checksums
from morse_jax.checkpoint.errors import (CheckpointCorruptError, CheckpointWriteError, Restored, short_message,
                                         warn_skipped)
from morse_jax.checkpoint.layout import (FORMAT, INVALID_DIR, TMP_RE, VERSION, check_json, check_step, check_target,
                                         to_storage)

log = logging.getLogger("morse_jax.checkpoint")


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
        step = check_step(step)
        if not isinstance(metadata, (Mapping, type(None))):
            raise ValueError(f"metadata: expected a dict, got {type(metadata).__name__}")
        user = check_json({} if metadata is None else metadata, "metadata")
        if self._frozen_ids:
            for kp, x in jax.tree_util.tree_flatten_with_path(state)[0]:
                if id(x) in self._frozen_ids:
                    raise ValueError(f"state{jax.tree_util.keystr(kp)}: is a frozen backbone array; "
                                     "backbone weights are never written into checkpoints")
        latest = self.latest_step()
        if latest is not None and step <= latest:
            raise ValueError(f"step: {step} is not newer than the latest checkpoint step {latest}")
        storage, records = to_storage(state)
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
        bad_tmp = sorted(p for p in self.workdir.iterdir() if TMP_RE.match(p.name))
        for p in bad_tmp:
            warn_skipped(f"checkpoint: incomplete write {p} (crash during save?) ignored"
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
                warn_skipped(f"checkpoint: step {bad} in {self.workdir} is unusable ({err}); falling back to "
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
        step = check_step(step)
        if step not in self._manager.all_steps():
            raise FileNotFoundError(f"step: no checkpoint for step {step} in {self.workdir}")
        return step

    def _read_doc(self, step: int) -> dict:
        try:
            doc = self._manager.restore(step, args=ocp.args.Composite(metadata=ocp.args.JsonRestore()))
            doc = doc["metadata"]
        except Exception as e:  # any failure to read our own JSON means the step is damaged
            raise CheckpointCorruptError(f"step {step}: metadata unreadable: {type(e).__name__}: {short_message(e)}") from e
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
                raise CheckpointCorruptError(f"step {step}: malformed leaf record {short_message(repr(rec), 120)}")
        return doc

    def _restore_step(self, step: int, target: Any) -> tuple[Any, dict]:
        doc = self._read_doc(step)
        treedef, specs = check_target(target, doc["leaves"], step)
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
            raise CheckpointCorruptError(f"step {step}: arrays unreadable: {type(e).__name__}: {short_message(e)}") from e
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
