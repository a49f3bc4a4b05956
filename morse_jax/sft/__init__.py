"""Supervised fine-tuning for role-tagged data (MoRAgent).

* ``data``: multi-role trajectories rendered with the chat template (tokens, role ids, loss mask).
* ``batching``: rendered examples -> ``SFTBatch`` steps by length bucketing; deterministic
  per-epoch order from (seed, epoch); too-long and target-less examples dropped and counted.
* ``config``: ``SFTConfig`` (lr 5e-5, warmup + cosine, epochs, micro-batch, accumulation, buckets,
  eval / checkpoint cadence).
* ``state``: ``SFTState`` (step, trainable params, optimiser state, PRNG key), AdamW + schedule.
* ``step``: the pure ``train_step(state, frozen, batch)`` (gradient accumulation over micro-batches
  in one jit) and ``eval_step``, generic over ``loss_fn(trainable, frozen, batch)``.
* ``objective``: ``mor_objective``, MoR's ``sft_loss`` bound to its settings (ablations included).
* ``trainer``: ``SFTTrainer``, the host loop: epochs, held-out per-role CE, orbax checkpoints with
  exact resume, a metrics sink (JSON Lines + TensorBoard via ``run.metrics_log``), tqdm.
"""
