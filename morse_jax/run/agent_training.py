"""The MoRAgent job's training side: the variant's adapter, its training data, SFT and restore.

* The adapter: ``morse_jax.mor``'s (MoR, or the plain-LoRA row as MoR's ``kind="lora"``), seen
  by the sampler through :class:`MoRRoleAdapter` (``sampling.loop.RoleAdapter``): each token
  of a prefill chunk and each generated token runs under its role's group.
* The data: ``moragent.train_data`` = "synthetic" (``tasks.bfcl.synthetic``'s leakage-free
  function-calling records, converted to multi-role trajectories by the rule-based converter;
  the last ``moragent.heldout_examples`` are held out), "bfcl_live" (BFCL's live categories,
  ``tasks.bfcl.live_records``: items offering a function named in the scored non-live
  categories left out; shuffled, the first ``moragent.live_examples`` kept), "questions"
  (``tasks.bfcl.questions``' leakage-free questions, converted the same way), "synthetic+bfcl_live"
  (both, shuffled together) or a JSON Lines file in the multi-role
  format (its last ``heldout_examples`` records held out); rendered with the backbone's chat
  template (``sft.data.render``).
* SFT: ``sft.trainer.SFTTrainer`` with MoR's objective (``mor.objective.sft_loss``: role CE +
  alpha1 balance + alpha2 orthogonality; with ``moragent.cache_frozen_prefix`` and an adapter on
  the last layers only, the frozen layers below run once per example), checkpoints under ``<workdir>/checkpoints`` (resumed);
  metrics to ``<workdir>/metrics.jsonl`` (kinds sft_data / sft_train / sft_eval).
"""

from __future__ import annotations

import dataclasses
import functools
import random
from typing import Any

import jax
import jax.numpy as jnp

from morse_jax.checkpoint import Checkpointer
from morse_jax.config.derived import mor_config, sft_config
from morse_jax.config.validate import GENERATED_DATA
from morse_jax.mor.adapter import layer_values
from morse_jax.mor.config import MoRConfig
from morse_jax.mor.objective import frozen_prefix, sft_loss
from morse_jax.mor.params import init_mor_params, param_count
from morse_jax.models.transformer import split_segments
from morse_jax.run.metrics_log import MetricsWriter
from morse_jax.sft.batching import BucketedData
from morse_jax.sft.data import render
from morse_jax.sft.state import SFTState, make_optimizer
from morse_jax.sft.trainer import SFTTrainer
from morse_jax.tasks.bfcl.live_records import live_records
from morse_jax.tasks.bfcl.questions import generate as generate_questions
from morse_jax.tasks.bfcl.synthetic import generate as generate_records
from morse_jax.tasks.bfcl.trajectories import from_function_calling
from morse_jax.tasks.trajectories import Trajectory, load_jsonl


@dataclasses.dataclass(frozen=True)
class MoRRoleAdapter:
    """``sampling.loop.RoleAdapter`` over ``morse_jax.mor``: the per-layer ``MoRLayer`` values for
    the role ids of the tokens about to run ([B, T] prefill chunk or [B] decode step)."""

    cfg: MoRConfig

    @property
    def num_roles(self) -> int:
        return self.cfg.num_roles

    def layers(self, params: Any, role_ids: jax.Array) -> tuple:
        return layer_values(params, role_ids, self.cfg)


def build_adapter(cfg, backbone, key: jax.Array) -> tuple[MoRRoleAdapter, dict]:
    """(the sampler's role adapter, fresh trainable params: B = 0, so the untrained adapter is the backbone)."""
    mcfg = mor_config(cfg, backbone.config)
    return MoRRoleAdapter(mcfg), init_mor_params(key, backbone.config, mcfg, jnp.dtype(cfg.model.dtype))


def training_trajectories(cfg) -> tuple[list[Trajectory], list[Trajectory]]:
    """(training, held-out) trajectories of ``moragent.train_data``."""
    m = cfg.moragent
    if m.train_data in GENERATED_DATA:
        records = []
        if m.train_data in ("synthetic", "synthetic+bfcl_live"):
            records += generate_records(m.synthetic_examples, seed=cfg.seed)
        if m.train_data == "questions":
            records += generate_questions(m.synthetic_examples, seed=cfg.seed)
        if m.train_data in ("bfcl_live", "synthetic+bfcl_live"):
            live, _ = live_records()
            # BFCL lists them category by category: shuffle (seeded) so the held-out tail and a capped
            # sample mix the categories
            random.Random(cfg.seed).shuffle(live)
            records += live[:m.live_examples] if m.live_examples else live
        if m.train_data == "synthetic+bfcl_live":
            # one seeded shuffle of both sources, so batches and the held-out tail hold both
            random.Random(cfg.seed + 1).shuffle(records)
        trajs = [from_function_calling(r, thought=m.thought) for r in records]
    else:
        trajs, _ = load_jsonl(m.train_data)
    n_held = min(m.heldout_examples, max(len(trajs) - 1, 0))
    return trajs[:len(trajs) - n_held], trajs[len(trajs) - n_held:]


def restore_or_train(job, *, train: bool) -> dict:
    """Train the job's adapter (``train``; resumes its checkpoints) or restore its latest
    checkpoint; sets ``job.params`` and ``job.trained_state``; returns facts for the report."""
    cfg, bb = job.cfg, job.backbone
    mcfg = job.role_adapter.cfg
    scfg = sft_config(cfg)
    frozen = bb.params
    n_adapt = mcfg.adapted_layers(bb.config.num_layers)
    if n_adapt < bb.config.num_layers:
        frozen = split_segments(frozen, n_adapt)
    info = {"adapter": mcfg.kind, "trainable parameters": param_count(bb.config, mcfg), "rank": mcfg.rank,
            "routing": mcfg.routing if mcfg.kind == "mor" else "-"}
    if not train:
        ckpt = Checkpointer(job.workdir / "checkpoints", frozen=frozen)
        try:
            template = SFTState.create(job.params, make_optimizer(scfg, 1), jax.random.key(0))
            restored = ckpt.restore_latest_valid(template) if (job.workdir / "checkpoints").is_dir() else None
        finally:
            ckpt.close()
        if restored is None:
            info["state"] = job.trained_state = "untrained (no checkpoint)"
        else:
            job.params = restored.state.params
            info["state"] = job.trained_state = f"checkpoint step {restored.step}"
        return info
    train_trajs, held = training_trajectories(cfg)
    tok = bb.tokenizer
    train_data = BucketedData([render(t, tok) for t in train_trajs], scfg.length_buckets)
    held_data = BucketedData([render(t, tok) for t in held], scfg.length_buckets) if held else None
    loss_fn = functools.partial(sft_loss, model_cfg=bb.config, mor_cfg=mcfg, alpha_balance=cfg.moragent.balance_weight,
                                alpha_orth=cfg.moragent.orth_weight)
    prefix_fn = (functools.partial(frozen_prefix, model_cfg=bb.config, mor_cfg=mcfg)
                 if cfg.moragent.cache_frozen_prefix and n_adapt < bb.config.num_layers else None)
    writer = MetricsWriter(job.workdir)
    try:
        trainer = SFTTrainer(scfg, loss_fn, frozen, workdir=job.workdir, sink=writer, prefix_fn=prefix_fn)
        result = trainer.fit(job.params, train_data, held_data)
        first = next((r for r in writer.read("sft_eval") if r.get("step") == 0), None)
    finally:
        writer.close()
    job.params = result.state.params
    job.trained_state = f"checkpoint step {result.total_steps}"
    info.update({"state": job.trained_state, "train examples": len(train_data.kept), "held-out": len(held),
                 "steps": result.total_steps, "resumed from": result.resumed_from,
                 "held-out CE before": None if first is None else round(first.get("ce", float("nan")), 4),
                 "held-out CE after": None if result.last_eval is None else round(result.last_eval.get("ce", 0.0), 4)})
    if result.last_eval:
        info.update({k: round(v, 4) for k, v in result.last_eval.items() if k.startswith("ce/")})
    return info
