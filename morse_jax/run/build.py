"""The main job: wires backbone, experts, router, sampler, orchestrator, trainer and checkpoints.

``Job(cfg)`` builds everything from a validated config; ``train()``, ``evaluate()``, ``solve()``
and ``plan()`` are the modes. The orchestrator decides *what* runs; the sampler and trainer do
the numbers in jitted functions.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from morse_jax import parallel as par
from morse_jax.checkpoint import Checkpointer
from morse_jax.config.derived import bank_spec, memory_plan, sampler_config, train_steps, trains, variant_of
from morse_jax.models import load_backbone
from morse_jax.models.chat import encode_chat, stop_token_ids
from morse_jax.models.loading import embedded_model_path
from morse_jax.models.transformer import split_segments
from morse_jax.mole import router as rt
from morse_jax.mole.experts import ExpertBankSpec
from morse_jax.rl.batch import encode_descriptions, examples_from_groups
from morse_jax.rl.update import Trainer, TrainConfig, init_trainable
from morse_jax.sampling.sampler import Sampler
from morse_jax.tasks.base import Task, VerifyResult
from morse_jax.tomas.orchestrator import Orchestrator
from morse_jax.tomas.config import OrchestratorConfig, SamplingSettings
from morse_jax.tomas.trace import RouteDraw, RunResult
from morse_jax.run.metrics_log import MetricsWriter

log = logging.getLogger("morse_jax.run.build")

# Fault injection for the kill -9 tests (tests/test_faults.py): "<phase>:<step>" kills this process
# with SIGKILL at that point of that training step. Phases: sampling (first model call),
# verification (while the first wave's candidates are being verified), update (after the update,
# before its metrics record), metrics (after the record, before the checkpoint), checkpoint
# (while the checkpoint is being written).
KILL_AT_ENV = "MORSE_JAX_KILL_AT"


def _kill_at(phase: str, step: int) -> bool:
    return os.environ.get(KILL_AT_ENV) == f"{phase}:{step}"


def _kill_now() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def resolve_model_path(path: str) -> Path:
    return embedded_model_path() if path == "embedded" else Path(path).expanduser()


def train_config(cfg) -> TrainConfig:
    t = cfg.train
    return TrainConfig(lora_lr=t.lora_lr, router_lr=t.router_lr, weight_decay=t.weight_decay,
                       max_grad_norm=t.max_grad_norm or None, ppo_eps=t.ppo_eps, ppo_epochs=t.ppo_epochs,
                       loss_normalisation=t.loss_normalisation, alpha_pi=t.alpha_pi,
                       entropy_weight=t.entropy_weight, orthogonality_weight=t.orthogonality_weight,
                       kl_beta=t.kl_beta, approx_set_logp=t.approx_set_logp, router_k=cfg.mole.top_k,
                       micro_batch=t.micro_batch, max_active=1 + cfg.mole.num_subtask,
                       reuse_prefix_states=t.reuse_prefix_states)


def orchestrator_config(cfg, mode: str, *, stop_token_ids=(), stop_strings=(),
                        single_agent: bool | None = None) -> OrchestratorConfig:
    """The orchestrator's settings from the job config (every rollout knob comes from ``cfg.rollout``).

    single_agent: None = ``cfg.rollout.single_agent``, else forced (``solve``'s baseline).
    """
    r = cfg.rollout
    return OrchestratorConfig(
        mode=mode, variant=variant_of(cfg).orchestration, routes_per_node=r.routes,
        candidates_per_route=r.candidates,
        top_k=cfg.mole.top_k, max_attempts=r.max_attempts, eval_max_attempts=r.eval_max_attempts,
        merge_mode=cfg.mole.merge_mode, merge_candidates=r.merge_candidates,
        fixed_plan_dependencies="planner" if r.scicode_dag == "planner" else "keep",
        single_agent=cfg.rollout.single_agent if single_agent is None else single_agent,
        train_sampling=SamplingSettings(r.temperature, r.top_p, r.max_new_tokens),
        eval_sampling=SamplingSettings(r.eval_temperature, r.eval_top_p, r.eval_max_new_tokens),
        planner_sampling=SamplingSettings(0.0, 1.0, r.planner_max_new_tokens),
        stop_token_ids=tuple(stop_token_ids), stop_strings=tuple(stop_strings), min_nodes=r.min_nodes,
        max_nodes=r.max_nodes,
        max_replans=r.max_replans, planner_prefix=r.planner_prefix, answer_prefix=r.answer_prefix,
        heal_answer_prefix=r.heal_answer_prefix, seed=cfg.seed)


class Job:
    """Everything one run needs. ``log_fn`` receives human-readable progress lines."""

    def __init__(self, cfg, *, load_tasks: bool = True):
        self._train_step = 0  # the training step in progress (1-based), for the fault injection
        self.cfg = cfg
        self.workdir = Path(cfg.workdir).expanduser()
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.variant = cfg.variant
        v = variant_of(cfg)
        self.orch_variant, self.advantage = v.orchestration, v.advantage
        self.trains = trains(cfg)  # mode=train on a variant with adapters
        t0 = time.time()
        dtype = jnp.dtype(cfg.model.dtype)
        # with several devices the weights stay on the host until they are sharded over the mesh
        multi = jax.device_count() > 1
        backbone = load_backbone(resolve_model_path(cfg.model.path), dtype, on_device=not multi)
        if backbone.tokenizer is None:
            raise ValueError(f"config.model.path: {cfg.model.path} has no tokenizer; the job needs one")
        log.info("backbone loaded in %.1fs", time.time() - t0)
        self.spec = bank_spec(cfg)
        self.tcfg = train_config(cfg)
        if self.spec is not None:  # split once here; sampler and trainer reuse it (no extra weight copies)
            backbone = dataclasses.replace(backbone, params=split_segments(backbone.params, self.spec.n_adapt))
        # One device: plain jit. Several (local or across processes): the configured mesh, backbone
        # sharded by the logical-axis rules, experts/router/optimizer replicated (morse_jax.parallel).
        self.mesh = par.make_mesh(tuple(cfg.parallel.mesh)) if multi else None
        if self.mesh is not None:
            backbone = par.shard_backbone(self.mesh, backbone)
            log.info("mesh %s", par.describe(self.mesh))
        self.backbone = backbone
        self.key = jax.random.key(cfg.seed)
        self.key, k_init = jax.random.split(self.key)
        self.trainable = None
        if self.spec is not None:
            self.trainable = self._place(init_trainable(k_init, self.backbone.config, self.spec, self.tcfg, dtype))
        max_active = 1 + (self.spec.num_subtask if self.spec is not None else 0)
        # prefix states only matter to updates, and only where a frozen prefix exists
        states = bool(self.trains and self.tcfg.reuse_prefix_states and self.spec is not None
                      and self.spec.n_adapt < self.backbone.config.num_layers)
        self.sampler = Sampler(self.backbone, self.spec,
                               sampler_config(cfg, max_active=max_active, return_prefix_states=states),
                               mesh=self.mesh)
        log.info("sampler native CPU kernels: %s", self.sampler.native_kernels)
        self._trainer = None
        self.stop_ids = stop_token_ids(self.backbone.tokenizer, self.backbone.config.eos_token_ids)
        if self.mesh is None:
            self._route_jit = jax.jit(self._route_impl, static_argnames=("num_samples", "greedy"))
        else:
            self._route_jit = par.replicated_jit(self.mesh, self._route_impl, static_argnames=("num_samples", "greedy"))
        self.family = None
        self.train_tasks: list[Task] = []
        self.eval_tasks: list[Task] = []
        self.splits = []  # registry.SplitSummary per configured split
        if load_tasks:
            from morse_jax.tasks.registry import build_family, load_splits

            self.family = build_family(cfg, self.workdir)
            self.train_tasks, self.eval_tasks, self.splits = load_splits(cfg, self.family)

    def _place(self, tree):
        return tree if self.mesh is None else par.replicate(self.mesh, tree)

    @property
    def trainer(self) -> Trainer:
        if self._trainer is None:
            self._trainer = Trainer(self.backbone.config, self.backbone.params, self.spec, self.tcfg, mesh=self.mesh)
        return self._trainer

    def memory_report(self) -> str:
        """Per-device memory estimate of this run (backbone, experts, optimizer, KV cache, activations)."""
        shape = tuple(self.mesh.devices.shape) if self.mesh is not None else (1, 1, 1)
        limit = None
        try:
            limit = (jax.devices()[0].memory_stats() or {}).get("bytes_limit")
        except Exception:  # CPU backends have no memory stats
            limit = None
        return memory_plan(self.cfg, self.backbone.config, self.spec, shape).format(limit)

    def split_report(self) -> str:
        """One line per split: tasks and steps used, and those left out with the reason."""
        return "\n".join(s.line() for s in self.splits)

    def verify_collective(self):
        """Verification on process 0 only, results broadcast (None for a single process)."""
        if _kill_at("verification", self._train_step):  # killed mid-verification (sandboxes running)
            return lambda thunk: (threading.Timer(0.3, _kill_now).start(), thunk())[1]
        if jax.process_count() == 1:
            return None

        def encode(results):
            return [None if v is None else [dataclasses.asdict(v[0]), bool(v[1])] for v in results]

        def decode(data):
            return [None if v is None else (VerifyResult(**v[0]), v[1]) for v in data]

        return lambda thunk: par.run_on_coordinator(thunk, encode=encode, decode=decode)

    # ------------------------------------------------------------------ injected callables

    def next_key(self) -> jax.Array:
        self.key, sub = jax.random.split(self.key)
        return sub

    def encode(self, messages) -> list[int]:
        return encode_chat(self.backbone.tokenizer, messages)

    def generate(self, requests):
        if _kill_at("sampling", self._train_step):
            _kill_now()
        bank = self.trainable["bank"] if self.trainable is not None else None
        bar = tqdm(total=len(requests), desc="generate", unit="call", leave=False, disable=None)
        try:
            return self.sampler.generate(bank, requests, key=self.next_key(), progress=bar.update)
        finally:
            bar.close()

    def _route_impl(self, router, embed, ids, mask, key, *, num_samples, greedy):
        emb = rt.subtask_embedding(embed, ids, mask)
        probs = rt.router_probs(router, emb, temperature=1.0)
        k = self.cfg.mole.top_k
        set_fn = rt.approx_set_log_prob if self.cfg.train.approx_set_logp else rt.set_log_prob
        if greedy:
            members = rt.greedy_route(probs, k)[:, None]
        else:
            members = jnp.stack([rt.sample_route(kk, probs, k) for kk in jax.random.split(key, num_samples)], 1)
        n, s = members.shape[:2]
        set_logp = set_fn(jnp.repeat(probs, s, axis=0), members.reshape(n * s, k)).reshape(n, s)
        return members, set_logp, probs

    def route(self, descriptions: Sequence[str], *, num_samples: int, greedy: bool) -> RouteDraw:
        ids, mask = encode_descriptions(self.backbone.tokenizer, descriptions)
        members, set_logp, probs = self._route_jit(self.trainable["router"], self.sampler.params["embed"], ids,
                                                   mask, self.next_key(), num_samples=num_samples, greedy=greedy)
        return RouteDraw(np.asarray(members), np.asarray(set_logp), np.asarray(probs))

    def description_ids(self, description: str) -> list[int]:
        ids, mask = encode_descriptions(self.backbone.tokenizer, [description])
        return ids[0, :mask[0].sum()].tolist()

    def orchestrator(self, mode: str, *, single_agent: bool | None = None) -> Orchestrator:
        variant = self.orch_variant
        if mode == "train" and self.spec is None:
            raise ValueError(f"config.variant={self.variant!r} has no adapters to train; use config.mode=eval")
        # a family may end answers early (PyFuncs: at the closing code fence)
        ocfg = orchestrator_config(self.cfg, mode, stop_token_ids=self.stop_ids, single_agent=single_agent,
                                   stop_strings=tuple(getattr(self.family, "stop_strings", ())))
        families = {self.family.name: self.family} if self.family is not None else {}
        route_fn = self.route if variant in ("mole", "flat_mole") else None
        return Orchestrator(families, self.spec, self.generate, route_fn, self.encode, ocfg,
                            verify_collective=self.verify_collective())

    # ------------------------------------------------------------------ modes

    def run_tasks(self, tasks: Sequence[Task], mode: str, desc: str) -> RunResult:
        orch = self.orchestrator(mode)
        bar = tqdm(desc=desc, unit="wave", leave=False, disable=None)

        def progress(stats):
            bar.update(1)
            bar.set_postfix_str(f"requests={getattr(stats, 'requests', '?')}")

        try:
            return orch.run(tasks, progress=progress)
        finally:
            bar.close()

    def checkpointer(self) -> Checkpointer:
        return Checkpointer(self.workdir / "checkpoints", max_to_keep=self.cfg.train.keep_checkpoints,
                            frozen=self.backbone.params)

    def _restore(self, ckpt: Checkpointer, opt_state):
        """Latest valid checkpoint into ``self.trainable`` / ``self.key``; the Restored or None."""
        restored = ckpt.restore_latest_valid({"trainable": self.trainable, "opt_state": opt_state, "key": self._place(self.key)})
        if restored is not None:
            self.trainable = self._place(restored.state["trainable"])
            self.key = restored.state["key"]
            restored.state["opt_state"] = self._place(restored.state["opt_state"])
        return restored

    def restore(self) -> str:
        """Load the work directory's latest valid checkpoint for eval / diagnose; says what was loaded."""
        if self.trainable is None:
            return "no trainable state (variant without adapters)"
        if self.cfg.fresh or not (self.workdir / "checkpoints").is_dir():
            return "untrained (no checkpoint in the work directory)"
        ckpt = self.checkpointer()
        try:
            restored = self._restore(ckpt, self._place(self.trainer.init_opt_state(self.trainable)))
        finally:
            ckpt.close()
        return "untrained (no valid checkpoint)" if restored is None else f"checkpoint step {int(restored.metadata['step'])}"

    def train(self, writer: MetricsWriter) -> dict:
        """HGRPO training with checkpoints; resumes from the work directory unless config.fresh."""
        cfg = self.cfg
        if not self.trains:
            return {"steps": 0}
        if not self.train_tasks:
            raise ValueError("config.data.train: no training tasks were loaded")
        trainer = self.trainer
        opt_state = self._place(trainer.init_opt_state(self.trainable))
        ckpt = self.checkpointer()
        start, cursor = 0, 0
        restored = None if cfg.fresh else self._restore(ckpt, opt_state)
        if restored is not None:
            opt_state = restored.state["opt_state"]
            start = int(restored.metadata["step"])
            cursor = int(restored.metadata["data_cursor"])
            print(f"resumed from {ckpt.workdir} at step {start} (set --config.fresh=True to start over)")
        writer.drop_after(start, "train")
        n_tasks = len(self.train_tasks)
        steps = train_steps(cfg, n_tasks)
        bar = tqdm(range(start, steps), desc=f"train {self.variant}", unit="step", initial=start, total=steps,
                   disable=None)
        last = {}
        for step in bar:
            self._train_step = step + 1
            tasks = [self.train_tasks[(cursor + i) % n_tasks] for i in range(min(cfg.data.tasks_per_step, n_tasks))]
            cursor = (cursor + len(tasks)) % n_tasks
            t0 = time.time()
            result = self.run_tasks(tasks, "train", f"rollout {step + 1}")
            t_roll = time.time() - t0
            seqs, routes, stats = examples_from_groups(
                result.groups, advantage=self.advantage, description_ids=self.description_ids,
                clip=cfg.train.clip_advantage, min_std=cfg.train.min_std, num_roles=self.spec.num_roles,
                merge_trains_subtask_experts=cfg.train.merge_trains_subtask_experts)
            t0 = time.time()
            self.trainable, opt_state, m = trainer.update(self.trainable, opt_state, seqs, routes,
                                                          num_groups=max(len(result.groups), 1),
                                                          reinforce=(step == 0))
            t_upd = time.time() - t0
            if _kill_at("update", step + 1):
                _kill_now()
            usage = m.pop("expert_usage", None)
            last = {"step": step + 1, "reward_mean": stats.reward_mean, "reward_std": stats.reward_std,
                    "groups": stats.groups, "skipped_within": stats.skipped_within,
                    "skipped_cross": stats.skipped_cross, "sequences": len(seqs), "routes": len(routes),
                    "nodes_passed": _count(result, "passed"), "nodes_total": _count(result, None),
                    "rollout_s": t_roll, "update_s": t_upd, "waves": result.counters.waves,
                    "generate_calls": result.counters.generate_calls, **m}
            if usage is not None:
                last["expert_usage"] = usage
            last["router_probs"] = _router_probs(result)
            writer.write(last, step=step + 1, kind="train")
            if _kill_at("metrics", step + 1):
                _kill_now()
            bar.set_postfix(reward=f"{stats.reward_mean:.3f}", skipped=f"{stats.skipped_within:.2f}")
            if (step + 1) % cfg.train.checkpoint_every == 0 or step + 1 == steps:
                ckpt.save(step + 1, {"trainable": self.trainable, "opt_state": opt_state, "key": self._place(self.key)},
                          metadata={"step": step + 1, "data_cursor": cursor, "variant": self.variant,
                                    "config": cfg.to_json()})
                if _kill_at("checkpoint", step + 1):  # the async write is under way
                    _kill_now()
        ckpt.wait()
        ckpt.close()
        # Every process logs it: in a multi-process run the values must agree (they do by design).
        log.info("trainable checksum (process %d): %s", jax.process_index(), trainable_checksum(self.trainable))
        return last

    def evaluate(self, writer: MetricsWriter | None = None, *, tasks: Sequence[Task] | None = None) -> dict:
        from morse_jax.tasks.registry import family_metrics

        tasks = list(tasks if tasks is not None else self.eval_tasks)
        if not tasks:
            raise ValueError("config.data.eval: no evaluation tasks were loaded")
        t0 = time.time()
        result = self.run_tasks(tasks, "eval", f"eval {self.variant}")
        metrics = family_metrics(self.cfg, self.family, tasks, result)
        metrics.update({"variant": self.variant, "tasks": len(tasks), "eval_s": time.time() - t0,
                        "router_probs": _router_probs(result),
                        "expert_sets": _expert_sets(result, self.spec)})
        if self.spec is not None and self.spec.num_subtask >= self.cfg.mole.top_k:
            from morse_jax.analysis.records import records_from_traces
            from morse_jax.analysis.utilisation import utilisation

            metrics["utilisation"] = utilisation(records_from_traces(result.traces),
                                                 num_subtask=self.spec.num_subtask)
        if writer is not None:
            writer.write({k: v for k, v in metrics.items() if not isinstance(v, (dict, list))}, step=0,
                         kind="eval")
        self.last_eval_result = result
        return metrics


def trainable_checksum(tree) -> str:
    """sha256 over the host bytes of every leaf (replicated arrays read locally on each process)."""
    import hashlib

    h = hashlib.sha256()
    for leaf in jax.tree.leaves(tree):
        h.update(np.ascontiguousarray(np.asarray(leaf)).tobytes())
    return h.hexdigest()[:16]


def _count(result: RunResult, status) -> int:
    return sum(1 for tr in result.traces.values() for n in tr.nodes.values() if status is None or n.status == status)


def _router_probs(result: RunResult) -> list:
    out = []
    for tid, tr in result.traces.items():
        for nid, n in tr.nodes.items():
            if getattr(n, "route_probs", None) is not None:
                out.append({"task": tid, "node": nid, "probs": np.asarray(n.route_probs).round(4).tolist()})
    return out


def _expert_sets(result: RunResult, spec: ExpertBankSpec | None) -> dict[str, int]:
    """How often each routed subtask-expert set was used at execute calls (paper Table 5 layout)."""
    counts: dict[str, int] = {}
    for tr in result.traces.values():
        for n in tr.nodes.values():
            route = getattr(n, "route", None)
            if route:
                key = "+".join(f"S{int(k)}" for k in sorted(route))
                counts[key] = counts.get(key, 0) + 1
    return counts
