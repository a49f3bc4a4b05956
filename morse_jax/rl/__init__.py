"""morse_jax.rl."""
