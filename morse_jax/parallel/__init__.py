"""morse_jax.parallel: device mesh, sharding rules, sharded jit, multi-host set-up, memory plan.

Typical use (``main``)::

    info = initialize(cfg.parallel.coordinator, cfg.parallel.num_processes, cfg.parallel.process_id)
    mesh = make_mesh(cfg.parallel.mesh)
    backbone = shard_backbone(mesh, backbone)
    sampler = Sampler(backbone, spec, sampler_cfg, mesh=mesh)
    trainer = Trainer(model_cfg, backbone.params, spec, train_cfg, mesh=mesh)
    trainable = replicate(mesh, trainable)

Importing this package does not touch a device (``initialize`` must come first).
"""

from morse_jax.parallel.distributed import (
    ProcessInfo,
    barrier,
    broadcast_from_coordinator,
    initialize,
    is_coordinator,
    process_allgather,
    run_on_coordinator,
    slurm_settings,
)
from morse_jax.parallel.memory import PRESETS, MemoryPlan, max_micro_batch, memory_plan, memory_table
from morse_jax.parallel.mesh import AXES, BATCH_AXES, describe, make_mesh, resolve_mesh_shape
from morse_jax.parallel.jit import (
    ShapeKeyedJit,
    replicate,
    replicated_jit,
    shard_backbone,
    sharded_logits,
)
from morse_jax.parallel.sharding import (
    RULES,
    activation_sharding,
    batch_sharding,
    batch_shardings,
    cache_shardings,
    constrain,
    logical_spec,
    mor_param_shardings,
    mor_param_specs,
    param_shardings,
    param_specs,
    replicated,
    shard_params,
    to_global,
)

__all__ = [
    "AXES", "BATCH_AXES", "MemoryPlan", "PRESETS", "ProcessInfo", "RULES", "ShapeKeyedJit", "activation_sharding",
    "barrier", "batch_sharding", "batch_shardings", "broadcast_from_coordinator", "cache_shardings", "constrain",
    "describe", "initialize", "is_coordinator", "logical_spec", "make_mesh", "max_micro_batch", "memory_plan",
    "memory_table", "mor_param_shardings", "mor_param_specs", "param_shardings", "param_specs", "process_allgather",
    "replicate", "replicated", "replicated_jit",
    "resolve_mesh_shape", "run_on_coordinator", "shard_backbone", "shard_params", "sharded_logits", "slurm_settings",
    "to_global",
]
