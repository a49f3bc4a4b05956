"""Fault injection for the kill -9 tests (tests/test_faults.py).

``MORSE_JAX_KILL_AT="<phase>:<step>"`` kills this process with SIGKILL at that point of that
training step. Phases: sampling (first model call), verification (while the first wave's
candidates are being verified), update (after the update, before its metrics record), metrics
(after the record, before the checkpoint), checkpoint (while the checkpoint is being written).
"""

from __future__ import annotations

import os
import signal

KILL_AT_ENV = "MORSE_JAX_KILL_AT"


def kill_at(phase: str, step: int) -> bool:
    """Whether the environment asks for a kill at ``phase`` of training step ``step`` (1-based)."""
    return os.environ.get(KILL_AT_ENV) == f"{phase}:{step}"


def kill_now() -> None:
    os.kill(os.getpid(), signal.SIGKILL)
