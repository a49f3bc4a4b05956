"""morse_jax.mole."""
