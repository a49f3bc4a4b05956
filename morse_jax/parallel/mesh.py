"""The device mesh: axes ``data``, ``fsdp``, ``tensor`` over all devices of all processes.

* ``data``: replicas of the backbone; the batch is split over it.
* ``fsdp``: the batch is split over it too, and the backbone's hidden (``embed``) dimension is
  sharded over it (weights are all-gathered where used).
* ``tensor``: attention heads, MLP width and vocabulary are sharded over it (Megatron-style).

On several processes the mesh is laid out so that the outer factors of each axis span processes
(hosts) and the inner ones stay on one host: ``tensor`` is kept inside a host when it fits, then
``fsdp``, and ``data`` takes the cross-host factor first, since its traffic (one gradient
all-reduce per step) tolerates the slower links best.
"""

from __future__ import annotations

import math
from typing import Sequence

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

AXES = ("data", "fsdp", "tensor")
BATCH_AXES = ("data", "fsdp")


def resolve_mesh_shape(shape: Sequence[int], n_devices: int, *, field: str = "parallel.mesh") -> tuple[int, int, int]:
    """Replace a ``-1`` entry by what fills ``n_devices``; check the product equals the device count.

    Raises ValueError naming ``field`` when the shape has the wrong length, a non-positive entry
    other than one ``-1``, a product that does not divide the device count, or one that uses only
    part of the devices (a silently idle accelerator is a bug, not a configuration).
    """
    shape = tuple(shape)
    if len(shape) != len(AXES):
        raise ValueError(f"{field} must have {len(AXES)} entries {AXES}, got {shape}")
    try:
        shape = tuple(int(s) for s in shape)
    except (TypeError, ValueError):
        raise ValueError(f"{field} entries must be integers, got {shape}") from None
    fills = [i for i, s in enumerate(shape) if s == -1]
    if len(fills) > 1:
        raise ValueError(f"{field}={shape}: at most one entry may be -1 (fill)")
    bad = [(AXES[i], s) for i, s in enumerate(shape) if s != -1 and s < 1]
    if bad:
        raise ValueError(f"{field}={shape}: axis sizes must be >= 1 or -1 (fill), got {bad}")
    fixed = math.prod(s for s in shape if s != -1)
    if fills:
        if n_devices % fixed:
            raise ValueError(
                f"{field}={shape}: the fixed axes multiply to {fixed}, which does not divide the "
                f"{n_devices} available devices")
        shape = tuple(n_devices // fixed if s == -1 else s for s in shape)
    elif fixed != n_devices:
        hint = "does not divide" if n_devices % fixed else "uses only part of"
        raise ValueError(
            f"{field}={shape} needs {fixed} devices and {hint} the {n_devices} available; "
            f"set one axis to -1 to fill")
    return shape  # type: ignore[return-value]


def _split_over_processes(shape: tuple[int, ...], n_proc: int, field: str) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Factor each axis as (across processes) x (within a process), data first, tensor last."""
    dcn = [1] * len(shape)
    left = n_proc
    for i in range(len(shape)):  # data, then fsdp, then tensor take cross-process factors
        g = math.gcd(shape[i], left)
        dcn[i], left = g, left // g
    if left != 1:
        raise ValueError(
            f"{field}={shape} cannot be laid out over {n_proc} processes with equal local device "
            f"counts; choose axis sizes whose product with the per-process count matches")
    ici = tuple(s // d for s, d in zip(shape, dcn))
    return tuple(dcn), ici


def device_grid(shape: tuple[int, int, int], devices: Sequence) -> np.ndarray:
    """Devices as an array of ``shape``; process-major so each axis' outer factor spans processes."""
    devices = sorted(devices, key=lambda d: (d.process_index, d.id))
    procs = sorted({d.process_index for d in devices})
    if len(procs) == 1:
        return np.asarray(devices, dtype=object).reshape(shape)
    per = len(devices) // len(procs)
    counts = {p: sum(d.process_index == p for d in devices) for p in procs}
    if set(counts.values()) != {per}:
        raise ValueError(f"parallel.mesh: processes hold different device counts {counts}")
    dcn, ici = _split_over_processes(shape, len(procs), "parallel.mesh")
    grid = np.asarray(devices, dtype=object).reshape(*dcn, *ici)
    n = len(shape)
    order = [x for i in range(n) for x in (i, n + i)]  # interleave (dcn_i, ici_i)
    return grid.transpose(order).reshape(shape)


def make_mesh(shape: Sequence[int] = (-1, 1, 1), devices: Sequence | None = None) -> Mesh:
    """A mesh with axes ("data", "fsdp", "tensor") over ``devices`` (default: all devices of all
    processes). One entry of ``shape`` may be -1: it takes whatever fills the device count.

    Axis types are ``Auto``: code inside ``jit`` needs no annotations; XLA's partitioner
    propagates the input/output shardings given by ``morse_jax.parallel.sharding``.
    """
    devices = list(jax.devices() if devices is None else devices)
    if not devices:
        raise ValueError("make_mesh: no devices")
    resolved = resolve_mesh_shape(shape, len(devices))
    grid = device_grid(resolved, devices)
    return Mesh(grid, AXES, axis_types=(AxisType.Auto,) * len(AXES))


def batch_size_divisor(mesh: Mesh) -> int:
    """Number of batch shards (data x fsdp): global batches divisible by it are split evenly."""
    return int(mesh.shape["data"] * mesh.shape["fsdp"])


def describe(mesh: Mesh) -> str:
    """One line: axis sizes, device kind, process count."""
    d = mesh.devices.flat[0]
    sizes = " x ".join(f"{a}={mesh.shape[a]}" for a in AXES)
    return (f"mesh {sizes} over {mesh.devices.size} {d.platform} devices "
            f"({getattr(d, 'device_kind', '?')}) in {len({x.process_index for x in mesh.devices.flat})} process(es)")
