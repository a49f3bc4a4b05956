"""Configuration: defaults, validation, variants, paper settings, derived quantities."""
