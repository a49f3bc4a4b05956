"""morse_jax.sampling."""
