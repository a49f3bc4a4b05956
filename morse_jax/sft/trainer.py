"""The SFT host driver: epochs of bucketed batches through the jitted step, held-out evaluation,
orbax checkpoints with exact resume, metrics records, a progress bar.

Exact resume. Everything a step depends on is either in the checkpointed :class:`SFTState` (step,
trainable params, optimiser state, PRNG key) or a pure function of the data and the config (the
batch of step s is ``epoch_plan(seed, s // steps_per_epoch)[s % steps_per_epoch]``), so a run
killed after step k and resumed from its newest checkpoint c <= k re-does steps c+1.. exactly as an
uninterrupted run does: bitwise-identical params, optimiser state and metrics. The checkpoint's
metadata records the data fingerprint and the step layout; resuming with other data or settings
is an error, not a silent restart. Records past c (``sft_train``, ``sft_eval``) are dropped from the
sink before resuming (``drop_after``), so the log equals an uninterrupted run's.

Metrics go to a sink with ``write(metrics, *, step, kind)`` (and optionally ``drop_after(step,
kind)``), e.g. ``morse_jax.run.metrics_log.MetricsWriter`` (JSON Lines + TensorBoard); the sink is
passed in because ``run`` is above ``sft`` in the layer order. Kinds: ``sft_data`` (what was kept
and dropped, once, at step 0), ``sft_train`` (one per optimiser step), ``sft_eval`` (held-out
loss and per-role CE at step 0, every ``eval_every`` steps and at each epoch's end).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from pathlib import Path
from typing import Any, Callable, Mapping, Protocol

import jax
import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from morse_jax.checkpoint import Checkpointer
from morse_jax.sft.batching import BucketedData
from morse_jax.sft.config import SFTConfig
from morse_jax.sft.state import SFTState, lr_schedule, make_optimizer
from morse_jax.sft.step import LossFn, combine_metrics, make_eval_step, make_train_step, target_counts

log = logging.getLogger("morse_jax.sft")

DATA_KIND, TRAIN_KIND, EVAL_KIND = "sft_data", "sft_train", "sft_eval"


class MetricsSink(Protocol):
    def write(self, metrics: Mapping[str, Any], *, step: int, kind: str) -> None: ...


@dataclasses.dataclass
class FitResult:
    """What :meth:`SFTTrainer.fit` did: the final state, the step layout, where it resumed from
    (None: fresh), the held-out metrics of the last evaluation (None without held-out data)."""

    state: SFTState
    steps_per_epoch: int
    total_steps: int
    resumed_from: int | None
    last_eval: dict | None


def host_metrics(metrics: Mapping[str, Any]) -> dict:
    """Device metrics -> Python floats (lists for vectors)."""
    out = {}
    for k, v in jax.device_get(dict(metrics)).items():
        a = np.asarray(v)
        out[k] = float(a) if a.ndim == 0 else a.tolist()
    return out


@functools.lru_cache(maxsize=8)
def compiled_train_step(loss_fn: LossFn, cfg: SFTConfig, total_steps: int):
    """The jitted train step for ``loss_fn`` under ``cfg``'s optimiser over ``total_steps``; cached,
    so fits in one process with the same objective and layout (a test's interrupted and resumed
    runs) compile once."""
    return make_train_step(loss_fn, make_optimizer(cfg, total_steps), lr_schedule(cfg, total_steps))


compiled_eval_step = functools.lru_cache(maxsize=8)(make_eval_step)


class SFTTrainer:
    """Runs SFT of ``loss_fn``'s trainable tree on a frozen backbone.

    Args:
      cfg: settings.
      loss_fn: the objective ``loss_fn(trainable, frozen, batch) -> (loss, metrics)`` (``morse_jax.sft.step``).
      frozen: the backbone params (an argument of every step; never updated or checkpointed).
      workdir: checkpoints go to ``<workdir>/checkpoints``; None: no checkpoints, no resume.
      sink: metrics sink (see the module docstring) or None.
      progress: show a tqdm bar over the optimiser steps.
      prefix_fn: ``prefix_fn(frozen, batch) -> float[B, T, d]``, the residual stream entering the
        first adapted layer (``mor.objective.frozen_prefix`` with its settings bound), or None.
        Given, every data set is first run through it once (``BucketedData.compute_prefix_states``)
        and the steps and evaluations run the adapted layers only; ``loss_fn`` must accept batches
        carrying ``prefix_hidden`` (MoR's ``sft_loss`` does). Same results up to float rounding.
    """

    def __init__(self, cfg: SFTConfig, loss_fn: LossFn, frozen, *, workdir: str | Path | None = None,
                 sink: MetricsSink | None = None, progress: bool = True,
                 prefix_fn: Callable[[Any, Any], jax.Array] | None = None):
        self.cfg, self.loss_fn, self.frozen = cfg, loss_fn, frozen
        self.workdir = None if workdir is None else Path(workdir)
        self.sink, self.progress = sink, progress
        self._eval_step = compiled_eval_step(loss_fn)
        self._prefix = None if prefix_fn is None else jax.jit(prefix_fn)

    def prepare(self, data: BucketedData, name: str = "data") -> None:
        """Compute ``data``'s frozen-prefix states once (with ``prefix_fn``; else nothing)."""
        if self._prefix is None or data.prefix_states is not None:
            return
        bar = tqdm(total=len(data.kept), desc=f"sft prefix ({name})", disable=not self.progress, leave=False)
        kept = data.compute_prefix_states(lambda b: self._prefix(self.frozen, b), self.cfg.micro_batch, bar.update)
        bar.close()
        log.info("sft: frozen-prefix states of %d %s examples computed once (%.0f MB host memory)",
                 len(data.kept), name, kept / 2**20)

    # ------------------------------------------------------------------ evaluation
    def evaluate(self, params, data: BucketedData) -> dict:
        """Held-out metrics over every kept example of ``data`` (token-weighted: ``ce/<role>`` is the
        CE over all that role's target tokens), as host floats; {} when nothing is kept."""
        self.prepare(data, "held-out")
        parts, weights = [], []
        for plan in data.eval_plan(self.cfg.micro_batch):
            batch = data.batch(plan, self.cfg.micro_batch)
            parts.append(jax.device_get(self._eval_step(params, self.frozen, batch)))
            weights.append(float(target_counts(batch)))
        if not parts:
            return {}
        stacked = {k: np.stack([p[k] for p in parts]) for k in parts[0]}
        return host_metrics(combine_metrics(stacked, np.asarray(weights, np.float32)))

    # ------------------------------------------------------------------ training
    def fit(self, init_params, train: BucketedData, held_out: BucketedData | None = None, *,
            on_step: Callable[[int, dict], None] | None = None) -> FitResult:
        """Train for ``cfg.epochs`` epochs over ``train`` from ``init_params``, or resume from the
        newest valid checkpoint under ``workdir``. ``on_step(step, metrics)`` is called after each
        step's records and checkpoint (a test raises in it to simulate a kill)."""
        cfg = self.cfg
        spe = train.steps_per_epoch(cfg.rows_per_step)
        if spe == 0:
            raise ValueError("sft: no training example left (" + (train.describe_dropped() or "empty set") + ")")
        total = spe * cfg.epochs
        for name, d in (("train", train), ("held-out", held_out)):
            if d is not None and d.dropped:
                log.warning("sft %s set: %s", name, d.describe_dropped())
            if d is not None:
                self.prepare(d, name)
        tx = make_optimizer(cfg, total)
        step_fn = compiled_train_step(self.loss_fn, cfg, total)
        # a copy: the step donates its state, and the caller keeps its init tree
        state = SFTState.create(jax.tree.map(jnp.copy, init_params), tx, jax.random.key(cfg.seed))
        meta = {"steps_per_epoch": spe, "total_steps": total, "rows_per_step": cfg.rows_per_step,
                "micro_batch": cfg.micro_batch, "seed": cfg.seed, "data": train.fingerprint()}
        ckpt = None if self.workdir is None else Checkpointer(
            self.workdir / "checkpoints", max_to_keep=cfg.keep_checkpoints, frozen=self.frozen)
        resumed = None
        try:
            if ckpt is not None:
                restored = ckpt.restore_latest_valid(state)
                if restored is not None:
                    self._check_resume(restored.metadata, meta)
                    state, resumed = restored.state, restored.step
            start = int(state.step)
            if resumed is None:
                self._write({"examples": len(train.examples), "kept": len(train.kept), "too_long": train.too_long,
                             "no_target": train.no_target, "steps_per_epoch": spe, "total_steps": total,
                             **({} if held_out is None else {"held_out_kept": len(held_out.kept),
                                                             "held_out_dropped": held_out.dropped})}, 0, DATA_KIND)
            else:
                self._drop_after(start)
                log.info("sft: resumed from step %d of %d", start, total)
            last_eval = None
            if held_out is not None and resumed is None:
                last_eval = self._eval(state, held_out, 0)
            plans: dict[int, list] = {}
            bar = tqdm(total=total, initial=start, desc="sft", disable=not self.progress, leave=False)
            for s in range(start, total):
                epoch, j = divmod(s, spe)
                if epoch not in plans:
                    plans = {epoch: train.epoch_plan(cfg.rows_per_step, seed=cfg.seed, epoch=epoch)}
                batch = train.batch(plans[epoch][j], cfg.micro_batch, cfg.accum_steps)
                state, metrics = step_fn(state, self.frozen, batch)
                done = s + 1
                m = {**host_metrics(metrics), "epoch": epoch}
                self._write(m, done, TRAIN_KIND)
                bar.update(1)
                bar.set_postfix(loss=f"{m['loss']:.4f}", epoch=epoch)
                epoch_end = done % spe == 0
                if held_out is not None and (epoch_end or (cfg.eval_every and done % cfg.eval_every == 0)):
                    last_eval = self._eval(state, held_out, done)
                if ckpt is not None and (epoch_end or done == total or
                                         (cfg.checkpoint_every and done % cfg.checkpoint_every == 0)):
                    ckpt.save(done, state, metadata={**meta, "epoch": epoch})
                if on_step is not None:
                    on_step(done, m)
            bar.close()
            if held_out is not None and last_eval is None:  # resumed after the last step: evaluate again
                last_eval = self.evaluate(state.params, held_out)
            if ckpt is not None:
                ckpt.wait()
        finally:
            if ckpt is not None:
                ckpt.close()
        return FitResult(state=state, steps_per_epoch=spe, total_steps=total, resumed_from=resumed,
                         last_eval=last_eval)

    # ------------------------------------------------------------------ helpers
    def _eval(self, state: SFTState, held_out: BucketedData, step: int) -> dict:
        m = self.evaluate(state.params, held_out)
        self._write(m, step, EVAL_KIND)
        return m

    def _write(self, metrics: Mapping[str, Any], step: int, kind: str) -> None:
        if self.sink is not None:
            self.sink.write(metrics, step=step, kind=kind)

    def _drop_after(self, step: int) -> None:
        drop = getattr(self.sink, "drop_after", None)
        if drop is not None:
            for kind in (TRAIN_KIND, EVAL_KIND):
                drop(step, kind)

    @staticmethod
    def _check_resume(saved: Mapping[str, Any], now: Mapping[str, Any]) -> None:
        diff = [k for k in now if saved.get(k) != now[k]]
        if diff:
            raise ValueError("sft: the checkpoint was written with other data or settings ("
                             + ", ".join(f"{k}: {saved.get(k)!r} then, {now[k]!r} now" for k in diff)
                             + "); resume with the same ones or start in a fresh workdir")
