"""MoRAgent's Mixture-of-Roles (MoR): role-gated LoRA groups with token routers, trained by SFT on
multi-role trajectories (reasoner / executor / summarizer).

* ``morse_jax.tasks.trajectories``: the multi-role JSON Lines format and its loader;
  ``morse_jax.tasks.bfcl.trajectories``: the converter from function-calling records;
  ``morse_jax.sft.data``: rendering with the chat template into tokens + per-token role ids + loss mask.
* ``morse_jax.mor.losses``: role-masked cross-entropy, the balance and orthogonality losses, router
  statistics (pure functions).
* ``morse_jax.mor.topk``: the routers' top-k mask (``lax.top_k``'s tie rule, without a sort).
* ``morse_jax.mor.config: ``MoRConfig`` (groups, top-k, rank, targets, layers, shared-LoRA gate,
  scale; the ablations: plain LoRA, uniform routing, no balance / orthogonality loss).
* ``morse_jax.mor.params``: the trainable tree stacked [layers, LoRAs, ...], its init and count,
  ``plain_lora_config`` (same budget), the Llama-3.2-1B-Instruct preset and ``PAPER``.
* ``morse_jax.mor.adapter``: the adapter through ``models.adapters.project`` (``MoRInputs`` for the
  training forward, ``layer_values`` for prefill / decode step), per-token role ids.
* ``morse_jax.mor.objective``: ``sft_loss(trainable, frozen, batch, model_cfg, mor_cfg, *,
  alpha_balance, alpha_orth) -> (loss, metrics)``, the SFT trainer's objective.
* ``morse_jax.mor.batch``: ``SFTBatch``, what the objective and the trainer exchange.

Sharding rules for the adapter: ``morse_jax.parallel.mor_param_specs``.
"""
