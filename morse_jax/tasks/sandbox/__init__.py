"""Sandbox for untrusted generated code: runner, isolation, process control, records, wire format."""
