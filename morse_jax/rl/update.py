"""The jitted HGRPO update: recompute log-probs under the current experts, losses, AdamW.

Longer than 400 lines because the step and its host driver stay together, so that callers
import one module. Layout: :class:`TrainConfig` and the optimiser; :class:`TrainState` and the pure
pieces of the step (``lora_gradients``, ``add_gradients``, ``finish_step`` = ``route_gradients``
+ ``apply_gradients``),
jitted plainly or with shardings (``make_train_step`` / ``make_sharded_train_step``); the
:class:`Trainer`, a thin host driver that pads, buckets and calls the step.

Only the trainable pytree ``{"bank": expert bank, "router": router params}`` reaches optax; the
frozen backbone params are a separate argument and are never differentiated or updated.

Loss (to minimise), per update over G groups (nodes):
  LoRA:   (1/G) * sum_candidates PPO-clip(token log-probs, behaviour log-probs; A_within)
          aggregated per candidate by ``loss_normalisation`` (token mean or sum, rl.losses)
  router: (1/G) * alpha_pi * sum_routes [-A_cross * log pi(route set)]   (PPO-clipped on reuse)
  reg:    -w_H * mean H(pi) + w_O * ||P̂P̂ᵀ - I||²_F   (+ beta * KL(new || base), beta=0 default)
The 1/G makes a step's gradient the mean node gradient: Alg. 1 sums the nodes of one task and
steps once per task, the authors' code steps once per node (scale 1 per node); here one step per
``tasks_per_step`` tasks, at the per-node scale whatever the number of nodes.
The regularisers enter every update that runs (also when no route has a non-zero A_cross); an
update runs when some candidate or route carries a non-zero advantage. A merge candidate's
inherited subtask experts are in its forward pass but get no gradient from it
(``SequenceExample.expert_trainable``). Gradients are sums over candidates, so micro-batches
accumulate exactly: each micro-batch's gradient is its own program at the current params, summed
on device, and one last program adds the router's gradient and steps the optimiser
(:class:`TrainStep`). ``ppo_epochs`` passes over the same examples each take an
optimiser step; the old log-probs stay the sampler's, so the PPO clip acts from the second pass.

Cost (see bench/train_step.py): only the last L_adapt layers are differentiated (the frozen
prefix has no tangents, so XLA neither transposes it nor keeps its activations); the LM head runs
at generated positions only, as logit[target] - logsumexp; candidates sharing a prompt and active
set run that prompt once (``share_prompts``: the M candidates of an HGRPO route); and when the
examples carry the sampler's ``prefix_states`` (the residual stream entering the first adapted
layer, ``SamplerConfig.return_prefix_states``) the update starts there: the frozen, expert-free
layers before it give the same states under any experts, so they are not run again
(``reuse_prefix_states``).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import struct

from morse_jax.models.config import ModelConfig
from morse_jax.models.block import REMAT
from morse_jax.models.transformer import split_segments
from morse_jax.mole import router as rt
from morse_jax.mole.experts import ExpertBankSpec, init_expert_bank
from morse_jax.parallel.jit import ShapeKeyedJit
from morse_jax.parallel.sharding import batch_shardings, param_shardings, replicated, shard_params
from morse_jax.rl import losses
from morse_jax.rl.examples import RouteExample, SequenceExample
from morse_jax.rl.batch import (RouteBatch, SequenceBatch, SharedBatch, group_order, pad_routes, pad_sequences,
                                pad_shared, sequence_shape, share_key, shared_shape)
from morse_jax.rl.logprobs import sequence_logprobs


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Optimisation hyper-parameters (paper App. E defaults)."""

    lora_lr: float = 8e-5
    router_lr: float = 3e-5
    weight_decay: float = 0.01
    # clip each tree's gradient (LoRA bank, router) to this global norm, separately; None/0: off
    # (neither the paper nor the authors' code clips)
    max_grad_norm: float | None = None
    ppo_eps: float = 0.2
    ppo_epochs: int = 1  # optimisation passes over each rollout batch (Alg. 1 takes one)
    # per-candidate aggregation of the token terms: "sequence_mean" (authors' code) or
    # "sequence_sum" (Eq. 7 as written: A * log p(y)); see rl.losses
    loss_normalisation: str = "sequence_mean"
    ppo_eps_high: float | None = None
    alpha_pi: float = 0.15
    entropy_weight: float = rt.ENTROPY_WEIGHT
    orthogonality_weight: float = rt.ORTHOGONALITY_WEIGHT
    kl_beta: float = 0.0
    approx_set_logp: bool = False  # the authors' sum-of-log-probs approximation
    router_temperature: float = 1.0
    top_k: int = 2  # K: experts in a routed set (the config's mole.top_k, the orchestrator's top_k)
    router_dim: int = 128
    micro_batch: int = 8
    length_buckets: tuple[int, ...] = (128, 256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096)
    # LM-head positions per row (the longest completion's bucket) and, with share_prompts, the
    # prompt and completion lengths: half-octave steps (powers of two and 1.5x), so padding wastes
    # at most a third, while an update's largest prompt and completion (every micro-batch of an
    # update pads to them, Trainer.update_shape) mostly land in the bucket of the previous update's
    # and reuse its compiled program (with 1/8-octave steps a largest prompt ~10 % longer was a
    # new shape, i.e. a compile). None: head everywhere.
    completion_buckets: tuple[int, ...] | None = (
        16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096)
    route_buckets: tuple[int, ...] = (8, 16, 32, 64, 128, 256)
    # run a prompt once for all candidates sharing it and their active set (rl.batch.pad_shared)
    # in updates where that at least halves the prompts run; prompts and completions then pad to
    # completion_buckets separately
    share_prompts: bool = True
    max_active: int = 4
    # start at the first adapted layer from the sampler's prefix_states when every example of an
    # update carries them (SamplerConfig.return_prefix_states); otherwise run the whole model
    reuse_prefix_states: bool = True
    # what the LoRA gradient's backward pass keeps of the adapted layers (models.transformer.forward):
    # "none" every layer's residuals ([B, H, T, T] attention included), "layer" each layer's
    # input and projection outputs, attention recomputed (models.block.remat_layer; fits long
    # sequences, README "Layer rematerialisation")
    remat: str = "none"

    def __post_init__(self):
        for name in ("lora_lr", "router_lr", "micro_batch", "top_k", "router_dim", "ppo_epochs"):
            if getattr(self, name) <= 0:
                raise ValueError(f"train.{name} must be positive, got {getattr(self, name)}")
        if self.max_grad_norm is not None and self.max_grad_norm < 0:
            raise ValueError(f"train.max_grad_norm must be >= 0 (0: off), got {self.max_grad_norm}")
        if self.loss_normalisation not in losses.NORMALISATIONS:
            raise ValueError(f"train.loss_normalisation must be one of {losses.NORMALISATIONS}, "
                             f"got {self.loss_normalisation!r}")
        if self.remat not in REMAT:
            raise ValueError(f"train.remat must be one of {REMAT}, got {self.remat!r}")
        if self.weight_decay < 0 or self.kl_beta < 0 or self.alpha_pi < 0:
            raise ValueError("train.weight_decay, train.kl_beta and train.alpha_pi must be >= 0")


def make_optimizer(cfg: TrainConfig) -> optax.GradientTransformation:
    """AdamW per group (LoRA / router) via ``multi_transform``; with ``max_grad_norm`` each group's
    gradient is first clipped to that norm on its own, so a large router gradient never shrinks
    the LoRA step (or the reverse), as two separate optimisers would behave."""

    def group(lr):
        adamw = optax.adamw(lr, weight_decay=cfg.weight_decay)
        return optax.chain(optax.clip_by_global_norm(cfg.max_grad_norm), adamw) if cfg.max_grad_norm else adamw

    return optax.multi_transform({"lora": group(cfg.lora_lr), "router": group(cfg.router_lr)},
                                 {"bank": "lora", "router": "router"})


def init_trainable(key: jax.Array, model_cfg: ModelConfig, spec: ExpertBankSpec, cfg: TrainConfig,
                   dtype=jnp.float32) -> dict:
    k1, k2 = jax.random.split(key)
    trainable = {"bank": init_expert_bank(k1, model_cfg, spec, dtype)}
    trainable["router"] = rt.init_router(k2, model_cfg.hidden_size, num_experts=max(spec.num_subtask, 1),
                                         dim=cfg.router_dim, dtype=jnp.float32)
    return trainable



# --------------------------------------------------------------------------- the pure step


@struct.dataclass
class TrainState:
    """Everything one update changes, as one pytree (trainable and optimiser only: the frozen
    backbone is a separate argument, sharded differently and never donated).

    params: {"bank": expert bank, "router": router params}, the only differentiated tree.
    opt_state: ``make_optimizer(cfg)``'s state over ``params`` (its Adam counts are the step).
    No gradient sum (an update's gradients live only inside :meth:`TrainStep.__call__`) and no
    PRNG key (nothing in the update is random).
    """

    params: Any
    opt_state: Any

    @classmethod
    def create(cls, params, opt_state) -> "TrainState":
        return cls(params=params, opt_state=opt_state)


@struct.dataclass
class UpdateBatch:
    """One optimiser step's data: ``sequences`` the LoRA micro-batches (one layout, all
    ``SequenceBatch`` or all ``SharedBatch``), ``routes`` the router batch or None (no subtask
    experts); ``reinforce`` selects the router's REINFORCE form (first PPO pass of the first
    training step; a traced flag in the step, so both forms share one program)."""

    sequences: tuple
    routes: RouteBatch | None
    reinforce: bool = struct.field(pytree_node=False, default=True)


def lora_gradients(params, frozen, batch: SequenceBatch | SharedBatch, *, model_cfg: ModelConfig,
                   spec: ExpertBankSpec, cfg: TrainConfig, start_layer: int) -> tuple[Any, dict]:
    """One micro-batch's LoRA-loss gradient w.r.t. the bank: (a tree like ``params["bank"]``,
    metrics). A function of ``params`` alone (no running sum), so the micro-batches of an update
    are independent programs that the runtime may overlap.

    Metrics (float32 scalars): lora_loss, clip_fraction, approx_kl, ratio_mean (token means),
    logp_gap_max / logp_gap_mean (|new - behaviour| log-prob), token_nll, tokens (mask sum),
    kl_to_base when ``cfg.kl_beta > 0``.
    """

    def loss_fn(bank):
        new_logp = sequence_logprobs(frozen, model_cfg, spec, bank, batch, start_layer=start_layer, remat=cfg.remat)
        mask = batch.target_mask
        norm = cfg.loss_normalisation
        loss, m = losses.ppo_clip_token_loss(new_logp, batch.old_logp, mask, batch.advantages, eps=cfg.ppo_eps,
                                             eps_high=cfg.ppo_eps_high, normalisation=norm)
        if cfg.kl_beta > 0:  # base = same backbone with experts off: no extra weights copy
            base = jax.lax.stop_gradient(sequence_logprobs(frozen, model_cfg, None, None, batch,
                                                           start_layer=start_layer))
            kl = losses.kl_to_base(new_logp, base, mask, norm)
            loss = loss + cfg.kl_beta * kl
            m = {**m, "kl_to_base": kl}
        n_tok = jnp.maximum(mask.sum(), 1.0)
        gap = jnp.abs(jax.lax.stop_gradient(new_logp) - batch.old_logp) * mask
        m = {**m, "logp_gap_max": gap.max(), "logp_gap_mean": gap.sum() / n_tok,
             "token_nll": -(jax.lax.stop_gradient(new_logp) * mask).sum() / n_tok, "tokens": mask.sum()}
        return loss, m

    (loss, metrics), g = jax.value_and_grad(loss_fn, has_aux=True)(params["bank"])
    return g, {**metrics, "lora_loss": loss}


def add_gradients(total, g):
    """``total + g`` leaf by leaf (the running sum of an update's micro-batch gradients)."""
    return jax.tree.map(jnp.add, total, g)


def route_gradients(router, embed, batch: RouteBatch, *, cfg: TrainConfig, reinforce) -> tuple[Any, dict]:
    """The router loss's gradient (Eq. 8 plus the entropy and orthogonality regularisers) w.r.t.
    ``router`` (a tree like ``params["router"]``), and metrics. ``embed``: the backbone's input
    embedding [V, d]. ``reinforce``: a Python bool, or a bool[] array (both forms traced, one
    program for either value: the first training step takes the REINFORCE form, the next ones
    the PPO one).

    Metrics: router_loss, clip_fraction, ratio_mean, routing_entropy, orthogonality (scalars),
    expert_usage f32[num_subtask] (route members counted over real rows).
    """
    c = cfg

    def loss_fn(router):
        emb = rt.subtask_embedding(embed, batch.desc_ids, batch.desc_mask)
        probs = rt.router_probs(router, emb, temperature=c.router_temperature)
        set_fn = rt.approx_set_log_prob if c.approx_set_logp else rt.set_log_prob
        set_logp = set_fn(probs, batch.members)
        def form(reinforce: bool):
            return losses.router_loss(set_logp, batch.old_set_logp, batch.advantages, alpha_pi=c.alpha_pi,
                                      eps=c.ppo_eps, reinforce=reinforce)

        if isinstance(reinforce, bool):
            loss, m = form(reinforce)
        else:
            loss, m = jax.lax.cond(reinforce, lambda: form(True), lambda: form(False))
        w = batch.row_mask
        ent = jnp.sum(losses.routing_entropy(probs) * w) / jnp.maximum(w.sum(), 1.0)
        ortho = losses.prototype_orthogonality(router["prototypes"])
        total = loss - c.entropy_weight * ent + c.orthogonality_weight * ortho
        usage = jnp.sum(jax.nn.one_hot(batch.members, probs.shape[-1]) * w[:, None, None], axis=(0, 1))
        return total, {**m, "router_loss": loss, "routing_entropy": ent, "orthogonality": ortho,
                       "expert_usage": usage}

    (_, metrics), g = jax.value_and_grad(loss_fn, has_aux=True)(router)
    return g, metrics


def apply_gradients(state: TrainState, grads, *, tx: optax.GradientTransformation) -> tuple[TrainState, dict]:
    """One optimiser step with ``grads`` (a tree like ``state.params``).
    Metrics: grad_norm, grad_norm_lora, grad_norm_router (before any clipping)."""
    updates, opt_state = tx.update(grads, state.opt_state, state.params)
    norms = {"grad_norm": optax.global_norm(grads), "grad_norm_lora": optax.global_norm(grads["bank"]),
             "grad_norm_router": optax.global_norm(grads["router"])}
    return TrainState(params=optax.apply_updates(state.params, updates), opt_state=opt_state), norms


def finish_step(state: TrainState, bank_grad, embed, routes: RouteBatch | None, reinforce, *, cfg: TrainConfig,
                tx: optax.GradientTransformation) -> tuple[TrainState, dict]:
    """The end of a step, one program: the router's gradient (:func:`route_gradients`, when there
    is a route batch; ``reinforce`` a bool[] array) next to ``bank_grad`` (the micro-batches'
    summed LoRA gradient, or None: zeros), then :func:`apply_gradients`. Returns (state, route
    metrics + norms)."""
    params = state.params
    bank = jax.tree.map(jnp.zeros_like, params["bank"]) if bank_grad is None else bank_grad
    metrics: dict = {}
    if routes is None:
        router = jax.tree.map(jnp.zeros_like, params["router"])
    else:
        router, metrics = route_gradients(params["router"], embed, routes, cfg=cfg, reinforce=reinforce)
    state, norms = apply_gradients(state, {"bank": bank, "router": router}, tx=tx)
    return state, {**metrics, **norms}


def combine_metrics(lora_parts: Sequence[dict], finish_metrics: dict) -> dict:
    """One update's metrics (host numpy) from its micro-batches' and its finish program's (route
    metrics, norms): lora_loss summed, logp_gap_max the max, the other LoRA metrics
    token-weighted means."""
    metrics = {k: np.asarray(v) for k, v in finish_metrics.items()}
    if lora_parts:
        tok = sum(float(p["tokens"]) for p in lora_parts)
        metrics["lora_loss"] = sum(float(p["lora_loss"]) for p in lora_parts)
        for k in ("clip_fraction", "approx_kl", "ratio_mean", "logp_gap_mean", "token_nll", "kl_to_base"):
            if k in lora_parts[0]:
                metrics[k] = sum(float(p[k]) * float(p["tokens"]) for p in lora_parts) / max(tok, 1.0)
        metrics["logp_gap_max"] = max(float(p["logp_gap_max"]) for p in lora_parts)
    return metrics


@dataclasses.dataclass
class TrainStep:
    """``train_step(state, frozen, batch) -> (state, metrics)`` from the jitted pure pieces.

    Per micro-batch one ``lora`` program (its gradient at ``state.params``), summed on device by
    ``add`` (a small program that donates the running sum); then one ``finish`` program (router
    gradient + AdamW) that donates the state. The micro-batch programs depend on the
    params only, not on each other, so they are dispatched back to back and the runtime may
    overlap them (a running sum threaded through them as a state field made each wait for the
    previous one, and copied the params and optimiser state through every program); nothing
    goes back to the host until the step's programs are all dispatched. The pieces are jitted separately, each once per batch layout
    (shape signature): the number of micro-batches varies from update to update (it follows
    the candidates with a non-zero advantage), and a step jitted as a whole would compile again
    for every new count. ``compile_count`` counts traces of the three.
    """

    lora: Callable  # (params, frozen, SequenceBatch | SharedBatch) -> (bank grad, metrics)
    add: Callable  # (sum, grad) -> sum; donates the sum
    finish: Callable  # (state, bank grad | None, embed, RouteBatch | None, bool[]) -> (state, metrics)
    logprobs: Callable  # (frozen, bank=, batch=) -> float32[R, L] or [R, Lc]
    traces: list = dataclasses.field(default_factory=list)

    @property
    def compile_count(self) -> int:
        return len(self.traces)

    def __call__(self, state: TrainState, frozen, batch: UpdateBatch, progress=None) -> tuple[TrainState, dict]:
        parts, total = [], None
        for micro in batch.sequences:
            g, m = self.lora(state.params, frozen, micro)
            total = g if total is None else self.add(total, g)
            parts.append(m)
            if progress is not None:
                progress(1)
        state, finish_metrics = self.finish(state, total, frozen["embed"], batch.routes, np.bool_(batch.reinforce))
        return state, combine_metrics(parts, finish_metrics)


def _traced(fn: Callable, traces: list, name: str) -> Callable:
    """``fn`` noting each trace in ``traces`` (runs at trace time only, so it counts compiles)."""

    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        traces.append(name)
        return fn(*args, **kwargs)

    return wrapped


def _pure_pieces(model_cfg: ModelConfig, spec: ExpertBankSpec, cfg: TrainConfig, start_layer: int, traces: list):
    lora = _traced(functools.partial(lora_gradients, model_cfg=model_cfg, spec=spec, cfg=cfg,
                                     start_layer=start_layer), traces, "lora")
    add = _traced(add_gradients, traces, "add")
    finish = _traced(functools.partial(finish_step, cfg=cfg, tx=make_optimizer(cfg)), traces, "finish")

    def logprobs(frozen, bank, batch):
        return sequence_logprobs(frozen, model_cfg, spec, bank, batch, start_layer=start_layer)

    return lora, add, finish, logprobs


def make_train_step(model_cfg: ModelConfig, spec: ExpertBankSpec, cfg: TrainConfig, *,
                    start_layer: int) -> TrainStep:
    """The step on one device (or wherever the arguments live): plain ``jax.jit``."""
    traces: list = []
    lora, add, finish, logprobs = _pure_pieces(model_cfg, spec, cfg, start_layer, traces)
    return TrainStep(lora=jax.jit(lora), add=jax.jit(add, donate_argnums=(0,)),
                     finish=jax.jit(finish, donate_argnums=(0,)),
                     logprobs=jax.jit(logprobs), traces=traces)


def make_sharded_train_step(mesh, frozen, model_cfg: ModelConfig, spec: ExpertBankSpec, cfg: TrainConfig, *,
                            start_layer: int) -> tuple[Any, TrainStep]:
    """(frozen placed on ``mesh``, the step with explicit shardings): frozen weights by the
    logical-axis rules (``parallel.sharding``), batch rows split over (data, fsdp), the train
    state, gradients, metrics and log-probs replicated (so every process can read them)."""
    frozen = shard_params(mesh, frozen, model_cfg)
    f_sh = param_shardings(mesh, frozen, model_cfg)
    rep = replicated(mesh)
    traces: list = []
    lora, add, finish, logprobs = _pure_pieces(model_cfg, spec, cfg, start_layer, traces)

    def like(tree):
        return jax.tree.map(lambda _: rep, tree)

    def finish_shardings(a, _):
        routes = None if a[3] is None else batch_shardings(mesh, a[3])
        return (like(a[0]), like(a[1]), f_sh["embed"], routes, rep), rep

    step = TrainStep(
        lora=ShapeKeyedJit(lora, lambda a, _: ((like(a[0]), f_sh, batch_shardings(mesh, a[2])), rep)),
        add=ShapeKeyedJit(add, lambda a, _: ((like(a[0]), like(a[1])), rep), donate_argnums=(0,)),
        finish=ShapeKeyedJit(finish, finish_shardings, donate_argnums=(0,)),
        logprobs=ShapeKeyedJit(logprobs, lambda a, _: ((f_sh, like(a[1]), batch_shardings(mesh, a[2])), rep)),
        traces=traces)
    return frozen, step


# --------------------------------------------------------------------------- host driver


class Trainer:
    """Host-side driver of :func:`train_step` for one backbone and bank layout: micro-batching,
    padding to buckets, one :class:`TrainState` per update, metrics to floats.

    With a ``mesh`` the step's pieces run with explicit in/out shardings
    (:func:`make_sharded_train_step`); the frozen params are placed on the mesh once, here.
    """

    def __init__(self, model_cfg: ModelConfig, frozen_params, spec: ExpertBankSpec, cfg: TrainConfig, mesh=None):
        self.model_cfg, self.spec, self.cfg, self.mesh = model_cfg, spec, cfg, mesh
        self.tx = make_optimizer(cfg)
        self.start_layer = model_cfg.num_layers - spec.n_adapt  # where prefix_states enter
        frozen = split_segments(frozen_params, spec.n_adapt)
        if mesh is None:
            self.frozen = frozen
            self.train_step = make_train_step(model_cfg, spec, cfg, start_layer=self.start_layer)
        else:
            self.frozen, self.train_step = make_sharded_train_step(mesh, frozen, model_cfg, spec, cfg,
                                                                   start_layer=self.start_layer)

    @property
    def compile_count(self) -> int:
        """Traces (= compiles) of the step's gradient and optimiser functions so far."""
        return self.train_step.compile_count

    def init_opt_state(self, trainable):
        return self.tx.init(trainable)

    def update(self, trainable, opt_state, seqs: Sequence[SequenceExample], routes: Sequence[RouteExample], *,
               num_groups: int, reinforce: bool = True, progress=None):
        """``ppo_epochs`` optimiser steps over all examples (each micro-batched, gradients summed).

        The router term (its regularisers included) runs in every step when the bank has subtask
        experts, with or without route examples. Returns (trainable, opt_state, metrics dict of
        floats; the last pass's, plus ``clip_fraction_first`` / ``ratio_mean_first`` of the first
        pass when there are several). With nothing to learn from (no candidate and no route with a
        non-zero advantage) the params are returned unchanged and ``metrics["skipped_update"] = 1``.
        """
        if not seqs and not any(r.advantage != 0.0 for r in routes):
            return trainable, opt_state, {"skipped_update": 1.0}
        batch = self.batch(seqs, routes, num_groups=num_groups, reinforce=reinforce)
        state = TrainState.create(trainable, opt_state)
        first = {}
        for epoch in range(self.cfg.ppo_epochs):
            # REINFORCE for the router on the first pass only (its gradient is PPO's at ratio 1)
            state, metrics = self.train_step(state, self.frozen, batch.replace(reinforce=reinforce and epoch == 0),
                                             progress=progress)
            if epoch == 0:
                first = metrics
        if self.cfg.ppo_epochs > 1:
            metrics.update({f"{k}_first": first[k] for k in ("clip_fraction", "ratio_mean") if k in first})
        metrics["skipped_update"] = 0.0
        out = {}
        for k, v in metrics.items():
            v = np.asarray(v)
            out[k] = v.tolist() if v.ndim else float(v)
        return state.params, state.opt_state, out

    def batch(self, seqs: Sequence[SequenceExample], routes: Sequence[RouteExample], *, num_groups: int,
              reinforce: bool = True) -> UpdateBatch:
        """The padded :class:`UpdateBatch` of one update (advantages scaled by 1/num_groups).

        Every micro-batch of the update is padded to one shape (:meth:`update_shape`), so an
        update compiles at most one LoRA program and consecutive updates, whose largest prompt
        and completion mostly fall in the same bucket, reuse it."""
        scale = 1.0 / max(num_groups, 1)
        shared, chunks = self.micro_batches(seqs)
        states = self.use_states(seqs)
        groups = [[seqs[i] for i in idx] for idx in chunks]
        shape = self.update_shape(groups, shared)
        micro = tuple(self._pad(g, shared, scale, states, shape) for g in groups)
        route_batch = None
        if self.spec.num_subtask > 0:
            rows = next((b for b in self.cfg.route_buckets if b >= len(routes)), len(routes))
            route_batch = pad_routes(routes, rows=rows, k=self.cfg.top_k, scale=scale)
        return UpdateBatch(sequences=micro, routes=route_batch, reinforce=reinforce)

    def update_shape(self, groups: Sequence[Sequence[SequenceExample]], shared: bool) -> tuple:
        """The one padded shape of an update's micro-batches ``groups``: the element-wise max of
        their own (``rl.batch.shared_shape`` (P, Lp, Lc) or ``sequence_shape`` (L, C))."""
        c = self.cfg
        if shared:
            own = [shared_shape(g, buckets=c.completion_buckets or c.length_buckets) for g in groups]
        else:
            own = [sequence_shape(g, length_buckets=c.length_buckets, completion_buckets=c.completion_buckets)
                   for g in groups]
        if not own:
            return None
        return tuple(None if col[0] is None else max(col) for col in zip(*own))

    def micro_batches(self, seqs: Sequence[SequenceExample]) -> tuple[bool, list[list[int]]]:
        """(shared, index lists): the prompt-sharing layout when it at least halves the prompts run
        (decided once per update, so one update compiles one layout), else flat micro-batches.

        Shared micro-batches hold whole runs of candidates with one prompt and active set (a run
        longer than a micro-batch is cut): split runs would repeat their prompt and make the prompt
        row count vary from step to step (each count a compile).
        """
        mb = self.cfg.micro_batch
        keys = [share_key(e) for e in seqs]
        if not (self.cfg.share_prompts and 2 * len(set(keys)) <= len(seqs)):
            return False, [list(range(s, min(s + mb, len(seqs)))) for s in range(0, len(seqs), mb)]
        order = group_order(seqs)
        runs: list[list[int]] = []
        for i in order:
            if runs and keys[runs[-1][0]] == keys[i] and len(runs[-1]) < mb:
                runs[-1].append(i)
            else:
                runs.append([i])
        chunks: list[list[int]] = []
        for run in runs:
            if not chunks or len(chunks[-1]) + len(run) > mb:
                chunks.append([])
            chunks[-1].extend(run)
        return True, chunks

    def use_states(self, seqs: Sequence[SequenceExample]) -> bool:
        """Restart at the first adapted layer: decided once per update (one layout, one compile)."""
        return (self.cfg.reuse_prefix_states and self.start_layer > 0 and bool(seqs)
                and all(e.prefix_states is not None for e in seqs))

    def _pad(self, chunk: Sequence[SequenceExample], shared: bool, scale: float = 1.0,
             states: bool = False, shape: tuple | None = None) -> SequenceBatch | SharedBatch:
        c = self.cfg
        if shared:
            return pad_shared(chunk, rows=c.micro_batch, buckets=c.completion_buckets or c.length_buckets,
                              max_active=c.max_active, scale=scale, with_states=states, shape=shape)
        return pad_sequences(chunk, rows=c.micro_batch, length_buckets=c.length_buckets, max_active=c.max_active,
                             scale=scale, completion_buckets=c.completion_buckets, with_states=states, shape=shape)

    def logprobs(self, bank, seqs: Sequence[SequenceExample]) -> list[np.ndarray]:
        """Per-example completion log-probs under ``bank`` (for checks against the sampler)."""
        out: list[np.ndarray | None] = [None] * len(seqs)
        shared, chunks = self.micro_batches(seqs)
        states = self.use_states(seqs)
        groups = [[seqs[i] for i in idx] for idx in chunks]
        shape = self.update_shape(groups, shared)
        for idx, group in zip(chunks, groups):
            batch = self._pad(group, shared, states=states, shape=shape)
            lp = np.asarray(self.train_step.logprobs(self.frozen, bank=bank, batch=batch))
            for row, i in enumerate(idx):
                p, n = len(seqs[i].prompt_ids), len(seqs[i].completion_ids)
                out[i] = lp[row, :n] if shared else lp[row, p - 1:p - 1 + n]
        return out
