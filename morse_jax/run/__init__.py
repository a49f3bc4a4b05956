"""Wiring and driving a job: build (was job.py), train loop, evaluation, describe, diagnose, reports."""
