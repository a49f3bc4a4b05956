"""The run's wiring: backbone, expert bank, router, sampler, trainer, orchestrator and
checkpointer, built once from a validated config.

``Job(cfg)`` holds them and the callables the orchestrator is handed (``generate``, ``route``,
``encode``); it decides nothing about a run's course. The modes drive it: ``run.train_loop.train``
(HGRPO steps with checkpoints), ``run.evaluate.evaluate`` (one evaluation), ``run.solve`` (plan /
solve one task) and ``run.diagnose``. The orchestrator decides *what* runs; the sampler, the
trainer and the route draw do the numbers in jitted functions.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import threading
import time
from pathlib import Path
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from morse_jax import parallel as par
from morse_jax.checkpoint import Checkpointer
from morse_jax.config.derived import bank_spec, memory_plan, orchestrator_config, sampler_config, train_config
from morse_jax.config.variants import trains, variant_of
from morse_jax.models import load_backbone
from morse_jax.models.chat import encode_chat, stop_token_ids
from morse_jax.models.loading import embedded_model_path
from morse_jax.models.transformer import split_segments
from morse_jax.mole import router as rt
from morse_jax.rl.examples import encode_descriptions
from morse_jax.rl.update import Trainer, init_trainable
from morse_jax.sampling.sampler import Sampler
from morse_jax.tasks.base import Task, VerifyResult
from morse_jax.tomas.orchestrator import Orchestrator
from morse_jax.tomas.trace import RouteDraw, RunResult
from morse_jax.run.faults import kill_at, kill_now
from morse_jax.run.profile import StepProfile, phase_of

log = logging.getLogger("morse_jax.run.build")


def resolve_model_path(path: str) -> Path:
    return embedded_model_path() if path == "embedded" else Path(path).expanduser()


class Job:
    """The wired components of one run and the callables handed to the orchestrator.

    Built from a validated config: ``backbone`` (split into segments when a bank exists, sharded
    over ``mesh`` with several devices), ``spec`` (the expert bank's layout, None without
    adapters), ``trainable`` ({"bank", "router"} or None), ``sampler``, ``trainer`` (built on
    first use), the evaluation / training tasks of the configured family, and the PRNG ``key``
    the run threads through. ``orchestrator(mode)`` wires ``generate`` / ``route`` / ``encode``
    into a ``tomas.Orchestrator``; ``checkpointer`` / ``restore_latest`` / ``restore`` move the
    trainable state to and from the work directory.
    """

    def __init__(self, cfg, *, load_tasks: bool = True):
        self.train_step = 0  # the training step in progress (1-based; set by the train loop), for fault injection
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
            self.trainable = self.place(init_trainable(k_init, self.backbone.config, self.spec, self.tcfg, dtype))
        # prefix states only matter to updates, and only where a frozen prefix exists
        states = bool(self.trains and self.tcfg.reuse_prefix_states and self.spec is not None
                      and self.spec.n_adapt < self.backbone.config.num_layers)
        self.sampler = Sampler(self.backbone, self.spec,
                               sampler_config(cfg, return_prefix_states=states),
                               mesh=self.mesh)
        log.info("sampler native CPU kernels: %s", self.sampler.native_kernels)
        self._trainer = None
        self.stop_ids = stop_token_ids(self.backbone.tokenizer, self.backbone.config.eos_token_ids)
        # the route draw: one pure function, its config-fixed arguments bound here (static under jit)
        draw = functools.partial(rt.draw_routes, k=cfg.mole.top_k, approx_set_logp=cfg.train.approx_set_logp)
        if self.mesh is None:
            self._draw_routes = jax.jit(draw, static_argnames=("num_samples", "greedy"))
        else:
            self._draw_routes = par.replicated_jit(self.mesh, draw, static_argnames=("num_samples", "greedy"))
        self.family = None
        self.train_tasks: list[Task] = []
        self.eval_tasks: list[Task] = []
        self.splits = []  # registry.SplitSummary per configured split
        self.last_eval_result: RunResult | None = None  # set by run.evaluate.evaluate
        if load_tasks:
            from morse_jax.tasks.registry import build_family, load_splits

            self.family = build_family(cfg, self.workdir)
            self.train_tasks, self.eval_tasks, self.splits = load_splits(cfg, self.family)

    def place(self, tree):
        """``tree`` replicated over the mesh (unchanged on one device)."""
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
        return memory_plan(self.cfg, self.backbone.config, self.spec, shape, jax.default_backend()).format(limit)

    def split_report(self) -> str:
        """One line per split: tasks and steps used, and those left out with the reason."""
        return "\n".join(s.line() for s in self.splits)

    def verify_collective(self, profile: StepProfile | None = None):
        """Verification on process 0 only, results broadcast (None for a single process), timed
        as ``profile``'s ``verify`` phase when one is given."""
        inner = self._verify_collective()
        if profile is None:
            return inner

        def timed(thunk):
            with profile.phase("verify"):
                return thunk() if inner is None else inner(thunk)

        return timed

    def _verify_collective(self):
        if kill_at("verification", self.train_step):  # killed mid-verification (sandboxes running)
            return lambda thunk: (threading.Timer(0.3, kill_now).start(), thunk())[1]
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

    def generate(self, requests, on_ready=None, profile: StepProfile | None = None):
        """The sampler on ``requests``; with a ``profile``, timed as ``decode`` (the sampler
        times its prefill calls inside it); ``on_ready`` as in ``Sampler.generate``."""
        if kill_at("sampling", self.train_step):
            kill_now()
        bank = self.trainable["bank"] if self.trainable is not None else None
        bar = tqdm(total=len(requests), desc="generate", unit="call", leave=False, disable=None)
        try:  # on_ready: the orchestrator verifies each finished micro-batch while the next generates
            with phase_of(profile, "decode"):
                return self.sampler.generate(bank, requests, key=self.next_key(), progress=bar.update,
                                             on_ready=on_ready, profile=profile)
        finally:
            bar.close()

    def route(self, descriptions: Sequence[str], *, num_samples: int, greedy: bool,
              profile: StepProfile | None = None) -> RouteDraw:
        """Route draws for N subtask descriptions (``mole.router.draw_routes``, this run's K)."""
        with phase_of(profile, "route"):
            ids, mask = encode_descriptions(self.backbone.tokenizer, descriptions)
            members, set_logp, probs = self._draw_routes(self.trainable["router"], self.backbone.params["embed"],
                                                         ids, mask, self.next_key(), num_samples=num_samples,
                                                         greedy=greedy)
            return RouteDraw(np.asarray(members), np.asarray(set_logp), np.asarray(probs))

    def description_ids(self, description: str) -> list[int]:
        ids, mask = encode_descriptions(self.backbone.tokenizer, [description])
        return ids[0, :mask[0].sum()].tolist()

    def orchestrator(self, mode: str, *, single_agent: bool | None = None,
                     profile: StepProfile | None = None) -> Orchestrator:
        """A ``tomas.Orchestrator`` of ``mode`` wired to this job; ``profile`` (a step's
        ``StepProfile``, or None) is handed to everything it calls."""
        variant = self.orch_variant
        if mode == "train" and self.spec is None:
            raise ValueError(f"config.variant={self.variant!r} has no adapters to train; use config.mode=eval")
        # a family may end answers early (PyFuncs: at the closing code fence)
        ocfg = orchestrator_config(self.cfg, mode, stop_token_ids=self.stop_ids, single_agent=single_agent,
                                   stop_strings=tuple(getattr(self.family, "stop_strings", ())))
        families = {self.family.name: self.family} if self.family is not None else {}
        generate, route_fn = self.generate, self.route if variant in ("mole", "flat_mole") else None
        if profile is not None:
            generate = functools.partial(self.generate, profile=profile)
            route_fn = route_fn and functools.partial(route_fn, profile=profile)
        return Orchestrator(families, self.spec, generate, route_fn, self.encode, ocfg,
                            verify_collective=self.verify_collective(profile), profile=profile)

    # ------------------------------------------------------------------ tasks and checkpoints

    def run_tasks(self, tasks: Sequence[Task], mode: str, desc: str, profile: StepProfile | None = None) -> RunResult:
        """Plan and run ``tasks`` with a fresh orchestrator of ``mode``, a progress bar per wave
        (timed into ``profile`` when one is given)."""
        orch = self.orchestrator(mode, profile=profile)
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

    def checkpoint_state(self, opt_state) -> dict:
        """The pytree a checkpoint holds: trainable params, optimizer state, PRNG key."""
        return {"trainable": self.trainable, "opt_state": opt_state, "key": self.place(self.key)}

    def restore_latest(self, ckpt: Checkpointer, opt_state):
        """Latest valid checkpoint into ``self.trainable`` / ``self.key``; the Restored (its
        ``state["opt_state"]`` placed) or None."""
        restored = ckpt.restore_latest_valid(self.checkpoint_state(opt_state))
        if restored is not None:
            self.trainable = self.place(restored.state["trainable"])
            self.key = restored.state["key"]
            restored.state["opt_state"] = self.place(restored.state["opt_state"])
        return restored

    def restore(self) -> str:
        """Load the work directory's latest valid checkpoint for eval / diagnose; says what was loaded."""
        if self.trainable is None:
            return "no trainable state (variant without adapters)"
        if self.cfg.fresh or not (self.workdir / "checkpoints").is_dir():
            return "untrained (no checkpoint in the work directory)"
        ckpt = self.checkpointer()
        try:
            restored = self.restore_latest(ckpt, self.place(self.trainer.init_opt_state(self.trainable)))
        finally:
            ckpt.close()
        return "untrained (no valid checkpoint)" if restored is None else f"checkpoint step {int(restored.metadata['step'])}"
