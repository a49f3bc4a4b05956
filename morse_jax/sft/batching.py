"""Rendered trajectories -> SFT batches by length bucketing, in a deterministic order per epoch.

Each example (``morse_jax.sft.data.Rendered``) is assigned the smallest bucket length that holds it
and right-padded to it, so jit compiles one shape per bucket in use. An optimiser step holds
``micro_batch * accum_steps`` examples of one bucket, laid out ``[accum_steps, micro_batch, T]``;
the last step of a bucket is filled with padding rows (``valid`` all False: no target, no effect).

Order: in epoch e, each bucket's examples are shuffled and cut into steps, and the steps of all
buckets are shuffled, both by ``numpy.random.default_rng([seed, e])``; the plan is a pure function
of (data, seed, epoch), so a resumed run replays exactly the steps an uninterrupted run would take.
The number of steps per epoch does not depend on the order.

Dropped, and counted (never silent): examples longer than the largest bucket, and examples with
no target token (nothing to learn from; the CE of token t is predicted at t - 1, so a target at
position 0 does not count).

Frozen-prefix states (:meth:`BucketedData.compute_prefix_states`): when the adapter wraps only the
last layers, the residual stream entering them is a fixed function of the tokens; it is computed
once per kept example (trimmed to the example's length, host memory: tokens x d floats) and every
later batch carries it as ``prefix_hidden``, so each step and held-out evaluation runs the adapted
layers only. Padding rows and positions get zeros (never attended to, never a target).

Target positions (``gather_targets``, default on): each batch also says, per row, which positions
predict a target token (``SFTBatch.logit_index``), so the objective runs the LM head there only;
a rendered trajectory's targets are about a quarter of its tokens.

Packing is not implemented here (the forward and MoR's objective accept ``segment_ids`` for
packed rows, so it could be added as another plan); every row is one trajectory, with
``segment_ids`` = 0 and ``positions`` = 0..T-1.
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Callable, Sequence

import numpy as np

from morse_jax.mor.batch import NO_ROLE, SFTBatch
from morse_jax.sft.data import Rendered


TARGET_COLUMNS_MULTIPLE = 32  # C of a bucket's logit_index is rounded up to this


def bucket_length(n: int, buckets: Sequence[int]) -> int | None:
    """The smallest bucket >= n (buckets sorted ascending), None when n exceeds them all."""
    for b in buckets:
        if n <= b:
            return int(b)
    return None


@dataclasses.dataclass(frozen=True)
class StepPlan:
    """One batch: its padded length and the example indices it holds (in row order)."""

    length: int
    rows: tuple[int, ...]


class BucketedData:
    """Rendered examples assigned to length buckets.

    Args:
      examples: the rendered trajectories.
      buckets: padded lengths, ascending.
      gather_targets: batches carry ``logit_index`` / ``logit_mask`` (``SFTBatch``), so the
        objective runs the LM head only where a target is predicted; False: at every position.

    Attributes:
      examples: the input, unchanged (indices in plans refer to it).
      kept: indices of the examples that fit a bucket and have a target.
      too_long: how many examples exceed the largest bucket (dropped).
      no_target: how many have no target token (dropped).
      target_columns: per bucket length, C of its batches' ``logit_index``.
    """

    def __init__(self, examples: Sequence[Rendered], buckets: Sequence[int], *, gather_targets: bool = True):
        self.examples = tuple(examples)
        self.buckets = tuple(sorted(int(b) for b in buckets))
        self._bucket: dict[int, int] = {}
        self.too_long = self.no_target = 0
        for i, ex in enumerate(self.examples):
            n = len(ex.tokens)
            if not (len(ex.role_ids) == len(ex.loss_mask) == n):
                raise ValueError(f"example {i}: tokens, role_ids and loss_mask differ in length")
            b = bucket_length(n, self.buckets)
            if b is None:
                self.too_long += 1
            elif not np.asarray(ex.loss_mask)[1:].any():
                self.no_target += 1
            else:
                self._bucket[i] = b
        self.kept = tuple(sorted(self._bucket))
        self.gather_targets = gather_targets
        # per bucket, the target columns C of its batches: the most targets of one of its examples,
        # rounded up to TARGET_COLUMNS_MULTIPLE (one compile per bucket, as for the length)
        most: dict[int, int] = {}
        for i, b in self._bucket.items():
            most[b] = max(most.get(b, 0), int(np.asarray(self.examples[i].loss_mask, bool)[1:].sum()))
        m = TARGET_COLUMNS_MULTIPLE
        self.target_columns = {b: min(b - 1, -(-n // m) * m) for b, n in most.items()}
        self.prefix_states: dict[int, np.ndarray] | None = None  # example index -> float[n, d]

    @property
    def dropped(self) -> int:
        return self.too_long + self.no_target

    def describe_dropped(self) -> str:
        """One line saying what was dropped and why ("" when nothing was)."""
        if not self.dropped:
            return ""
        return (f"{self.dropped} of {len(self.examples)} examples dropped: {self.too_long} longer than "
                f"{self.buckets[-1]} tokens (the largest length bucket), {self.no_target} without a target token")

    def _members(self) -> dict[int, list[int]]:
        out: dict[int, list[int]] = {}
        for i in self.kept:
            out.setdefault(self._bucket[i], []).append(i)
        return dict(sorted(out.items()))

    def steps_per_epoch(self, rows_per_step: int) -> int:
        return sum(-(-len(m) // rows_per_step) for m in self._members().values())

    def epoch_plan(self, rows_per_step: int, *, seed: int, epoch: int) -> list[StepPlan]:
        """The shuffled steps of ``epoch`` (see the module docstring); every kept example once."""
        rng = np.random.default_rng([int(seed), int(epoch)])
        steps = []
        for length, members in self._members().items():
            order = [members[j] for j in rng.permutation(len(members))]
            steps += [StepPlan(length, tuple(order[s:s + rows_per_step])) for s in range(0, len(order), rows_per_step)]
        return [steps[j] for j in rng.permutation(len(steps))]

    def eval_plan(self, rows: int) -> list[StepPlan]:
        """Every kept example once, in index order within each bucket (no shuffling)."""
        return [StepPlan(length, tuple(m[s:s + rows])) for length, m in self._members().items()
                for s in range(0, len(m), rows)]

    def fingerprint(self) -> str:
        """sha256 over the kept examples' arrays and the buckets: a resumed run checks its data is the same."""
        h = hashlib.sha256(repr(self.buckets).encode())
        for i in self.kept:
            ex = self.examples[i]
            for a, dt in ((ex.tokens, np.int32), (ex.role_ids, np.int32), (ex.loss_mask, np.bool_)):
                h.update(np.ascontiguousarray(a, dt).tobytes())
        return h.hexdigest()

    def compute_prefix_states(self, compute: Callable[[SFTBatch], np.ndarray], rows: int,
                              progress: Callable[[int], None] | None = None) -> int:
        """Compute and keep every kept example's frozen-prefix states (module docstring).

        Args:
          compute: SFTBatch [rows, T] -> float[rows, T, d] (``mor.objective.frozen_prefix`` bound
            to the backbone, jitted); called once per batch of the eval plan.
          rows: rows per call.
          progress: called with the number of examples done after each call.
        Returns:
          the bytes kept. A second call does nothing (the states depend only on the data and the
          frozen backbone).
        """
        if self.prefix_states is not None:
            return self.prefix_bytes
        states = {}
        for plan in self.eval_plan(rows):
            hidden = np.asarray(compute(self.batch(plan, rows)))
            for r, i in enumerate(plan.rows):
                states[i] = hidden[r, :len(self.examples[i].tokens)].copy()
            if progress is not None:
                progress(len(plan.rows))
        self.prefix_states = states
        return self.prefix_bytes

    @property
    def prefix_bytes(self) -> int:
        return sum(a.nbytes for a in (self.prefix_states or {}).values())

    def batch(self, plan: StepPlan, micro_batch: int, accum_steps: int | None = None) -> SFTBatch:
        """The padded arrays of ``plan``: [accum_steps, micro_batch, T] (or [micro_batch, T] when
        ``accum_steps`` is None); rows beyond ``plan.rows`` are padding. numpy arrays. With
        prefix states computed, ``prefix_hidden`` [..., T, d] holds them (zeros at padding)."""
        rows = micro_batch * (1 if accum_steps is None else accum_steps)
        if len(plan.rows) > rows:
            raise ValueError(f"a step of {len(plan.rows)} examples does not fit {rows} rows")
        T = plan.length
        tokens = np.zeros((rows, T), np.int32)
        role_ids = np.full((rows, T), NO_ROLE, np.int32)
        loss_mask = np.zeros((rows, T), bool)
        valid = np.zeros((rows, T), bool)
        for r, i in enumerate(plan.rows):
            ex = self.examples[i]
            n = len(ex.tokens)
            tokens[r, :n] = ex.tokens
            role_ids[r, :n] = ex.role_ids
            loss_mask[r, :n] = ex.loss_mask
            valid[r, :n] = True
        positions = np.broadcast_to(np.arange(T, dtype=np.int32), (rows, T)).copy()
        lead = (micro_batch,) if accum_steps is None else (accum_steps, micro_batch)
        fields = dict(tokens=tokens, role_ids=role_ids, loss_mask=loss_mask, valid=valid, positions=positions,
                      segment_ids=np.zeros((rows, T), np.int32))
        if self.prefix_states is not None:
            first = self.prefix_states[plan.rows[0]]
            hidden = np.zeros((rows, T, first.shape[-1]), first.dtype)
            for r, i in enumerate(plan.rows):
                hidden[r, :len(self.prefix_states[i])] = self.prefix_states[i]
            fields["prefix_hidden"] = hidden
        if self.gather_targets:
            fields["logit_index"], fields["logit_mask"] = self._logit_index(plan, rows)
        return SFTBatch(**{k: v.reshape(lead + v.shape[1:]) for k, v in fields.items()})

    def _logit_index(self, plan: StepPlan, rows: int) -> tuple[np.ndarray, np.ndarray]:
        """``SFTBatch.logit_index`` / ``logit_mask`` [rows, C] of ``plan`` (C: its bucket's)."""
        C = self.target_columns[plan.length]
        index = np.zeros((rows, C), np.int32)
        mask = np.zeros((rows, C), bool)
        for r, i in enumerate(plan.rows):
            at = np.flatnonzero(np.asarray(self.examples[i].loss_mask, bool)[1:])  # t: token t + 1 is a target
            index[r, :len(at)], index[r, len(at):] = at, at[-1]
            mask[r, :len(at)] = True
        return index, mask
