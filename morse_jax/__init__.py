"""morse_jax: MoRSE (mixture of role-subtask LoRA experts + hierarchical GRPO) in JAX."""

__version__ = "0.1.0"
