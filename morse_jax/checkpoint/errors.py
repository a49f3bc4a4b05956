"""The checkpoint's error and warning types, the ``Restored`` record, and how a skipped step is reported."""

from __future__ import annotations

import logging
import warnings
from typing import Any, NamedTuple

log = logging.getLogger("morse_jax.checkpoint")


class CheckpointCorruptError(RuntimeError):
    """A checkpoint step cannot be read back intact (partial, damaged or not ours)."""


class CheckpointMismatchError(ValueError):
    """The restore target does not describe the state stored in the checkpoint."""


class CheckpointWriteError(RuntimeError):
    """Writing a step failed (a full disk, an I/O error); the message names the newest complete
    step, which a resumed run restarts from (the partial write is skipped then)."""


class CheckpointWarning(UserWarning):
    """An unusable checkpoint (or partial write) was skipped."""


class Restored(NamedTuple):
    step: int
    state: Any
    metadata: dict


def warn_skipped(msg: str) -> None:
    """Log and warn (CheckpointWarning) about an unusable step or partial write that is skipped."""
    log.warning(msg)
    warnings.warn(msg, CheckpointWarning, stacklevel=3)


def short_message(e: BaseException, n: int = 240) -> str:
    """An exception's message on one line, cut to ``n`` characters."""
    s = " ".join(str(e).split())
    return s if len(s) <= n else s[: n - 3] + "..."
