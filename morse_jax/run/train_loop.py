"""The HGRPO training loop over a built job (``run.build.Job``): rollouts, examples, updates,
metrics records and checkpoints, resuming from the work directory.

Every step is profiled (``run.profile.StepProfile``): after its checkpoint a ``step_time`` record
(``time/<phase>_s``, wall, CPU, idle share) follows the step's ``train`` record in metrics.jsonl,
and one line with the breakdown goes to the progress output."""

from __future__ import annotations

import logging
import time

import jax
import numpy as np
from tqdm.auto import tqdm

from morse_jax.config.derived import train_steps
from morse_jax.rl.examples import examples_from_groups
from morse_jax.run.build import Job
from morse_jax.run.evaluate import count_nodes, router_probs_records
from morse_jax.run.faults import kill_at, kill_now
from morse_jax.run.metrics_log import MetricsWriter
from morse_jax.run.profile import StepProfile

log = logging.getLogger("morse_jax.run.train_loop")


def train(job: Job, writer: MetricsWriter) -> dict:
    """HGRPO training with checkpoints; resumes from the work directory unless config.fresh.

    Each step rolls out ``data.tasks_per_step`` tasks (cycling through the training split),
    turns the groups into sequence and route examples with the variant's advantage, updates the
    trainable params and writes a metrics record; every ``train.checkpoint_every`` steps (and at
    the last) it saves ``job.checkpoint_state``. Returns the last step's record ({"steps": 0}
    when the run does not train)."""
    cfg = job.cfg
    if not job.trains:
        return {"steps": 0}
    if not job.train_tasks:
        raise ValueError("config.data.train: no training tasks were loaded")
    trainer = job.trainer
    opt_state = job.place(trainer.init_opt_state(job.trainable))
    ckpt = job.checkpointer()
    start, cursor = 0, 0
    restored = None if cfg.fresh else job.restore_latest(ckpt, opt_state)
    if restored is not None:
        opt_state = restored.state["opt_state"]
        start = int(restored.metadata["step"])
        cursor = int(restored.metadata["data_cursor"])
        print(f"resumed from {ckpt.workdir} at step {start} (set --config.fresh=True to start over)")
    writer.drop_after(start, "train")
    writer.drop_after(start, "step_time")
    n_tasks = len(job.train_tasks)
    steps = train_steps(cfg, n_tasks)
    bar = tqdm(range(start, steps), desc=f"train {job.variant}", unit="step", initial=start, total=steps,
               disable=None)
    last = {}
    for step in bar:
        job.train_step = step + 1
        profile = StepProfile().start()
        tasks = [job.train_tasks[(cursor + i) % n_tasks] for i in range(min(cfg.data.tasks_per_step, n_tasks))]
        cursor = (cursor + len(tasks)) % n_tasks
        t0 = time.time()
        result = job.run_tasks(tasks, "train", f"rollout {step + 1}", profile=profile)
        t_roll = time.time() - t0
        with profile.phase("update"):
            seqs, routes, stats = examples_from_groups(
                result.groups, advantage=job.advantage, description_ids=job.description_ids,
                clip=cfg.train.clip_advantage, min_std=cfg.train.min_std, num_roles=job.spec.num_roles,
                merge_trains_subtask_experts=cfg.train.merge_trains_subtask_experts)
            t0 = time.time()
            job.trainable, opt_state, m = trainer.update(job.trainable, opt_state, seqs, routes,
                                                          num_groups=max(len(result.groups), 1),
                                                          reinforce=(step == 0))
            t_upd = time.time() - t0
        if kill_at("update", step + 1):
            kill_now()
        usage = m.pop("expert_usage", None)
        last = {"step": step + 1, "reward_mean": stats.reward_mean, "reward_std": stats.reward_std,
                "groups": stats.groups, "skipped_within": stats.skipped_within,
                "skipped_cross": stats.skipped_cross, "sequences": len(seqs), "routes": len(routes),
                "nodes_passed": count_nodes(result, "passed"), "nodes_total": count_nodes(result, None),
                "rollout_s": t_roll, "update_s": t_upd, "waves": result.counters.waves,
                "generate_calls": result.counters.generate_calls, **m}
        if usage is not None:
            last["expert_usage"] = usage
        last["router_probs"] = router_probs_records(result)
        writer.write(last, step=step + 1, kind="train")
        if kill_at("metrics", step + 1):
            kill_now()
        bar.set_postfix(reward=f"{stats.reward_mean:.3f}", skipped=f"{stats.skipped_within:.2f}")
        if (step + 1) % cfg.train.checkpoint_every == 0 or step + 1 == steps:
            with profile.phase("checkpoint"):
                ckpt.save(step + 1, job.checkpoint_state(opt_state),
                          metadata={"step": step + 1, "data_cursor": cursor, "variant": job.variant,
                                    "config": cfg.to_json()})
            if kill_at("checkpoint", step + 1):  # the async write is under way
                kill_now()
        profile.stop()
        # Its own record, after the checkpoint (which the train record, written before it so that
        # a kill never leaves a checkpoint without its metrics, cannot hold).
        writer.write(profile.record(), step=step + 1, kind="step_time")
        bar.write(f"step {step + 1}: {profile.line()}")
    ckpt.wait()
    ckpt.close()
    # Every process logs it: in a multi-process run the values must agree (they do by design).
    log.info("trainable checksum (process %d): %s", jax.process_index(), trainable_checksum(job.trainable))
    return last


def trainable_checksum(tree) -> str:
    """sha256 over the host bytes of every leaf (replicated arrays read locally on each process)."""
    import hashlib

    h = hashlib.sha256()
    for leaf in jax.tree.leaves(tree):
        h.update(np.ascontiguousarray(np.asarray(leaf)).tobytes())
    return h.hexdigest()[:16]
