"""Multi-controller set-up: ``jax.distributed`` initialisation and coordinator-to-all broadcasts.

JAX runs one Python process per host (or per GPU); every process runs the same program on its
own devices and the jitted functions span all of them. The host-side work that must happen once
(planning, routing draws, sandboxed verification of generated code) runs on the coordinator
(process 0); its results are broadcast so every process feeds the same global batch.

Call :func:`initialize` first thing in ``main``, before anything touches a JAX device.
"""

from __future__ import annotations

import base64
import dataclasses
import io
import json
import logging
import os
import re
from typing import Any, Callable, Mapping

import jax
import numpy as np

log = logging.getLogger("morse_jax.parallel")

_MIN_PAYLOAD = 1024  # bytes; payloads are padded to a power of two (bounded broadcast compiles)


@dataclasses.dataclass(frozen=True)
class ProcessInfo:
    """Where this process stands. ``source``: "explicit", "slurm", "already" or "single"."""

    process_id: int
    num_processes: int
    coordinator: str
    source: str

    @property
    def is_coordinator(self) -> bool:
        return self.process_id == 0


def _first_host(nodelist: str) -> str:
    """First hostname of a SLURM node list: 'node[001-004,9],gpu2' -> 'node001'."""
    m = re.match(r"([^,\[]+)(?:\[([^\]]+)\])?", nodelist.strip())
    if not m or not m.group(1):
        raise ValueError(f"SLURM node list {nodelist!r} cannot be parsed")
    prefix, ranges = m.group(1), m.group(2)
    if ranges is None:
        return prefix
    return prefix + re.split(r"[,-]", ranges)[0]


def slurm_settings(env: Mapping[str, str] | None = None) -> tuple[str, int, int] | None:
    """(coordinator "host:port", num_processes, process_id) from a SLURM job step, or None.

    Needs SLURM_NTASKS > 1 and SLURM_PROCID (set by ``srun``). The coordinator is the first node
    of the step (SLURM_STEP_NODELIST, else SLURM_JOB_NODELIST); the port is MORSE_COORDINATOR_PORT
    or one derived from the job id (as JAX's own SLURM detection does).
    """
    env = os.environ if env is None else env
    if "SLURM_JOB_ID" not in env or "SLURM_PROCID" not in env:
        return None
    n = int(env.get("SLURM_NTASKS", env.get("SLURM_NPROCS", "1")))
    if n <= 1:
        return None
    nodes = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
    if not nodes:
        raise ValueError("SLURM: SLURM_NTASKS > 1 but no SLURM_STEP_NODELIST / SLURM_JOB_NODELIST to find the coordinator")
    port = env.get("MORSE_COORDINATOR_PORT") or str(int(env["SLURM_JOB_ID"]) % 4096 + 61440)
    return f"{_first_host(nodes)}:{port}", n, int(env["SLURM_PROCID"])


def _check_explicit(coordinator: str, num_processes: int, process_id: int) -> None:
    if not coordinator:
        raise ValueError("parallel.coordinator must be set (host:port) when parallel.num_processes or "
                         "parallel.process_id is given")
    if not re.fullmatch(r"[^\s:]+:\d{1,5}", coordinator):
        raise ValueError(f"parallel.coordinator must be host:port, got {coordinator!r}")
    if num_processes < 1:
        raise ValueError(f"parallel.num_processes must be >= 1 with a coordinator, got {num_processes}")
    if not 0 <= process_id < num_processes:
        raise ValueError(f"parallel.process_id must be in [0, {num_processes}), got {process_id}")


def initialize(coordinator: str = "", num_processes: int = 0, process_id: int = -1, *,
               local_device_ids: Any = None, env: Mapping[str, str] | None = None,
               timeout_s: int = 300) -> ProcessInfo:
    """Start JAX's multi-controller runtime, or do nothing for a single process.

    Order: explicit settings (all three of coordinator, num_processes, process_id), else a SLURM
    job step with more than one task, else single process. Calling it again is harmless.
    Must run before any JAX computation (JAX raises otherwise).
    """
    if jax.distributed.is_initialized():
        return ProcessInfo(jax.process_index(), jax.process_count(), coordinator, "already")
    num_processes, process_id = int(num_processes), int(process_id)
    if coordinator or num_processes > 0 or process_id >= 0:
        _check_explicit(coordinator, num_processes, process_id)
        settings, source = (coordinator, num_processes, process_id), "explicit"
    else:
        settings, source = slurm_settings(env), "slurm"
    if settings is None or settings[1] == 1:
        return ProcessInfo(0, 1, "", "single")
    addr, n, pid = settings
    log.info("jax.distributed.initialize(%s, num_processes=%d, process_id=%d) [%s]", addr, n, pid, source)
    jax.distributed.initialize(coordinator_address=addr, num_processes=n, process_id=pid,
                               local_device_ids=local_device_ids, initialization_timeout=timeout_s)
    return ProcessInfo(jax.process_index(), jax.process_count(), addr, source)


def is_coordinator() -> bool:
    """True on process 0 (the one that plans, verifies and writes files)."""
    return jax.process_index() == 0


def barrier(name: str) -> None:
    """Wait until every process reaches the barrier ``name`` (no-op for one process)."""
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)


# --------------------------------------------------------------------------- broadcast


def _encode(obj: Any) -> Any:
    if isinstance(obj, (np.ndarray, np.generic)):
        buf = io.BytesIO()
        np.save(buf, np.asarray(obj), allow_pickle=False)
        return {"__ndarray__": base64.b64encode(buf.getvalue()).decode("ascii"), "scalar": isinstance(obj, np.generic)}
    if isinstance(obj, jax.Array):
        raise TypeError("broadcast_from_coordinator: pass host values (np.asarray(x)), not jax.Array")
    if isinstance(obj, dict):
        bad = [k for k in obj if not isinstance(k, str)]
        if bad:
            raise TypeError(f"broadcast_from_coordinator: dict keys must be str, got {bad[:3]}")
        if "__ndarray__" in obj or "__tuple__" in obj:
            raise TypeError("broadcast_from_coordinator: dict keys '__ndarray__' / '__tuple__' are reserved")
        return {k: _encode(v) for k, v in obj.items()}
    if isinstance(obj, tuple):
        return {"__tuple__": [_encode(v) for v in obj]}
    if isinstance(obj, list):
        return [_encode(v) for v in obj]
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    raise TypeError(f"broadcast_from_coordinator: cannot send {type(obj).__name__} (JSON values, tuples, "
                    f"numpy arrays and dicts/lists of them only)")


def _decode(obj: Any) -> Any:
    if isinstance(obj, dict):
        if "__ndarray__" in obj:
            arr = np.load(io.BytesIO(base64.b64decode(obj["__ndarray__"])), allow_pickle=False)
            return arr[()] if obj.get("scalar") else arr
        if "__tuple__" in obj:
            return tuple(_decode(v) for v in obj["__tuple__"])
        return {k: _decode(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_decode(v) for v in obj]
    return obj


def encode_payload(obj: Any) -> bytes:
    """Bytes of a JSON-able / numpy pytree (tuples, arrays, numpy scalars kept); see ``decode_payload``."""
    return json.dumps(_encode(obj), separators=(",", ":"), allow_nan=True).encode("utf-8")


def decode_payload(data: bytes) -> Any:
    return _decode(json.loads(data.decode("utf-8")))


def broadcast_from_coordinator(obj: Any = None) -> Any:
    """Process 0's ``obj`` on every process (others may pass anything, e.g. None).

    For plans, routes, rewards: JSON values, tuples, numpy arrays and scalars, in dicts/lists.
    The value goes through the same encoding in a single process too, so an object that cannot
    be sent fails on a laptop before it fails on a cluster.
    """
    payload = encode_payload(obj) if is_coordinator() else b""
    if jax.process_count() == 1:
        return decode_payload(payload)
    from jax.experimental import multihost_utils

    n = int(multihost_utils.broadcast_one_to_all(np.array(len(payload), np.int32)))
    size = max(_MIN_PAYLOAD, 1 << (n - 1).bit_length())  # pad: one broadcast program per size class
    buf = np.zeros(size, np.uint8)
    buf[:len(payload)] = np.frombuffer(payload, np.uint8)
    out = np.asarray(multihost_utils.broadcast_one_to_all(buf))
    return decode_payload(out[:n].tobytes())


def run_on_coordinator(fn: Callable[..., Any], *args, encode: Callable[[Any], Any] = lambda x: x,
                       decode: Callable[[Any], Any] = lambda x: x, **kwargs) -> Any:
    """``fn(*args, **kwargs)`` on process 0 only (e.g. a wave of sandboxed verifications); its
    result on every process. ``encode`` / ``decode`` turn it into something
    :func:`broadcast_from_coordinator` can send (e.g. ``dataclasses.asdict`` / ``VerifyResult(**d)``).

    A collective: every process calls it, in the same order, from the main thread (not from a
    thread pool, whose order differs between processes). An exception on the coordinator is
    re-raised there and raised as RuntimeError on the others, which would otherwise wait forever.
    One process: just ``fn(*args, **kwargs)``.
    """
    if jax.process_count() == 1:
        return fn(*args, **kwargs)
    error: BaseException | None = None
    payload = None
    if is_coordinator():
        try:
            payload = {"ok": encode(fn(*args, **kwargs))}
        except Exception as e:  # noqa: BLE001 - re-raised below, after telling the peers
            error, payload = e, {"error": f"{type(e).__name__}: {e}"}
    out = broadcast_from_coordinator(payload)
    if "error" in out:
        if error is not None:
            raise error
        raise RuntimeError(f"run_on_coordinator: process 0 failed: {out['error']}")
    return decode(out["ok"])


def process_allgather(x: Any) -> Any:
    """Host copies of (possibly sharded) global arrays, on every process."""
    if jax.process_count() == 1:
        return jax.tree.map(np.asarray, x)
    from jax.experimental import multihost_utils

    return multihost_utils.process_allgather(x, tiled=True)
