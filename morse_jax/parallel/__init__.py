"""morse_jax.parallel."""
