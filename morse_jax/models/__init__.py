"""morse_jax.models."""
