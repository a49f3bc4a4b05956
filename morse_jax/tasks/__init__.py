"""morse_jax.tasks."""
