"""Orbax checkpoints of the trainable state plus JSON run metadata.

What is written: exactly the pytree handed to :meth:`Checkpointer.save` (expert bank, router
params, optimizer states, step, RNG key, ... as the training code assembles it) and a JSON
document (data cursor, resolved config, run info). The frozen backbone is never written: the
caller passes only the trainable state, and ``Checkpointer(frozen=backbone_params)`` makes
``save`` refuse any leaf that *is* a backbone array.

Layout: one orbax ``CheckpointManager`` step directory per saved step with two items,
``state`` (``PyTreeSave`` of a flat ``{name: array}`` dict) and ``metadata`` (``JsonSave``).
The flat dict makes the on-disk form independent of pytree node classes (optax states, flax
structs, namedtuples); the structure is rebuilt from the restore *target*, and the JSON keeps,
per leaf, its key path, shape, dtype, PRNG implementation (typed keys are stored as
``key_data`` and re-wrapped) and a content checksum.

Validity. Orbax writes a step into ``<step>.orbax-checkpoint-tmp-<ts>`` and renames it when
complete, so a crash mid-write leaves a tmp directory; those are reported and moved aside.
A finalised directory can still be damaged (files deleted, truncated, overwritten): restoring
reads the JSON, every array, and compares the checksums, which also catches the silent
bit flips tensorstore would otherwise return as data. :meth:`Checkpointer.restore_latest_valid`
walks back from the newest step to the newest one that passes, warning about each it skips.

Modules: ``checkpointer`` (the Checkpointer), ``layout`` (storage dict, leaf records, target
checks), ``checksums``, ``errors``.

A restore target that disagrees with the checkpoint (structure, shape, dtype, key impl) is a
caller error, raised as :class:`CheckpointMismatchError` and never treated as corruption.
"""

from morse_jax.checkpoint.checkpointer import Checkpointer
from morse_jax.checkpoint.checksums import tree_checksums
from morse_jax.checkpoint.errors import (CheckpointCorruptError, CheckpointMismatchError, CheckpointWarning,
                                         CheckpointWriteError, Restored)
from morse_jax.checkpoint.layout import FORMAT, INVALID_DIR, VERSION

__all__ = [
    "Checkpointer",
    "Restored",
    "CheckpointCorruptError",
    "CheckpointMismatchError",
    "CheckpointWriteError",
    "CheckpointWarning",
    "tree_checksums",
    "FORMAT",
    "VERSION",
    "INVALID_DIR",
]
