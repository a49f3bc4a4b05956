"""The SFT trainer's settings (one frozen record; the main job builds it from its config).

Defaults follow MoRAgent where the paper states them (lr 5e-5, 4 epochs, §4.2) and common SFT
practice where it does not (the paper gives no optimiser, batch, schedule, warmup or length:
AdamW with linear warmup then cosine decay, as the issue asks).
"""

from __future__ import annotations

import dataclasses

DEFAULT_BUCKETS = (128, 256, 384, 512, 768, 1024, 1536, 2048)


@dataclasses.dataclass(frozen=True)
class SFTConfig:
    """SFT hyper-parameters.

    Attributes:
      learning_rate: peak AdamW learning rate (paper: 5e-5).
      warmup_fraction: linear warmup from 0 over this fraction of all optimiser steps (at least one
        step), then cosine decay to ``learning_rate * final_lr_fraction`` at the last step.
      final_lr_fraction: the cosine's end value as a fraction of the peak.
      weight_decay: AdamW's decoupled weight decay.
      b1, b2, eps: Adam moments.
      max_grad_norm: clip the step's (accumulated) gradient to this global norm; None or 0: off.
      epochs: passes over the training set (paper: 4).
      micro_batch: rows per micro-batch (one forward/backward).
      accum_steps: micro-batches per optimiser step (gradient accumulation); a step holds
        ``micro_batch * accum_steps`` rows of one length bucket.
      length_buckets: the padded lengths a batch can have (jit compiles one shape per bucket used);
        an example longer than the largest is dropped and counted, never silently.
      seed: data order (per epoch: ``(seed, epoch)``) and the state's PRNG key.
      eval_every: evaluate the held-out set every N optimiser steps (0: only at each epoch's end).
      checkpoint_every: save every N steps (0: only at each epoch's end); the last step is always saved.
      keep_checkpoints: newest checkpoints kept on disk.
    """

    learning_rate: float = 5e-5
    warmup_fraction: float = 0.03
    final_lr_fraction: float = 0.0
    weight_decay: float = 0.0
    b1: float = 0.9
    b2: float = 0.999
    eps: float = 1e-8
    max_grad_norm: float | None = 1.0
    epochs: int = 4
    micro_batch: int = 4
    accum_steps: int = 1
    length_buckets: tuple[int, ...] = DEFAULT_BUCKETS
    seed: int = 0
    eval_every: int = 0
    checkpoint_every: int = 0
    keep_checkpoints: int = 2

    def __post_init__(self):
        object.__setattr__(self, "length_buckets", tuple(sorted(int(b) for b in self.length_buckets)))
        for name in ("learning_rate", "epochs", "micro_batch", "accum_steps", "keep_checkpoints"):
            if not getattr(self, name) > 0:
                raise ValueError(f"sft.{name} must be positive, got {getattr(self, name)}")
        for name in ("eval_every", "checkpoint_every", "weight_decay"):
            if getattr(self, name) < 0:
                raise ValueError(f"sft.{name} must be >= 0, got {getattr(self, name)}")
        if not 0.0 <= self.warmup_fraction < 1.0:
            raise ValueError(f"sft.warmup_fraction must be in [0, 1), got {self.warmup_fraction}")
        if not 0.0 <= self.final_lr_fraction <= 1.0:
            raise ValueError(f"sft.final_lr_fraction must be in [0, 1], got {self.final_lr_fraction}")
        if self.max_grad_norm is not None and self.max_grad_norm < 0:
            raise ValueError(f"sft.max_grad_norm must be >= 0 (0: off), got {self.max_grad_norm}")
        if not self.length_buckets or self.length_buckets[0] < 2:
            raise ValueError(f"sft.length_buckets must be lengths >= 2, got {self.length_buckets}")

    @property
    def rows_per_step(self) -> int:
        return self.micro_batch * self.accum_steps

    @property
    def max_len(self) -> int:
        return self.length_buckets[-1]
