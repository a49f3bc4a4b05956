"""morse_jax.analysis."""
