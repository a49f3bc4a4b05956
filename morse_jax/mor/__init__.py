"""MoRAgent's Mixture-of-Roles (MoR): role-gated LoRA groups with token routers, trained by SFT on
multi-role trajectories (reasoner / executor / summarizer).

* ``morse_jax.tasks.trajectories``: the multi-role JSON Lines format and its loader;
  ``morse_jax.tasks.bfcl.trajectories``: the converter from function-calling records;
  ``morse_jax.sft.data``: rendering with the chat template into tokens + per-token role ids + loss mask.
* ``morse_jax.mor.losses``: role-masked cross-entropy, the balance and orthogonality losses, router
  statistics (pure functions).
"""
