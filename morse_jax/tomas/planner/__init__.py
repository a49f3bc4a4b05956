"""Planner: task description -> prompt -> model text -> validated DAG (see loop.py)."""
