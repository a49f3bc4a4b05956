"""Supervised fine-tuning for role-tagged data (MoRAgent)."""
