"""morse_jax.tomas."""
