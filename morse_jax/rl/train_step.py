"""The jitted HGRPO update: recompute log-probs under the current experts, losses, AdamW.

Only the trainable pytree ``{"bank": expert bank, "router": router params}`` reaches optax; the
frozen backbone params are a separate argument and are never differentiated or updated.

Loss (to minimise), per update over G groups (nodes):
  LoRA:   (1/G) * sum_candidates PPO-clip(token log-probs, behaviour log-probs; A_within)
  router: (1/G) * alpha_pi * sum_routes [-A_cross * log pi(route set)]   (PPO-clipped on reuse)
  reg:    -w_H * mean H(pi) + w_O * ||P̂P̂ᵀ - I||²_F   (+ beta * KL(new || base), beta=0 default)
Micro-batches of sequences are accumulated on the host (gradients are sums, so exact).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

from morse_jax.models.config import ModelConfig
from morse_jax.models.transformer import forward, split_segments
from morse_jax.mole import router as rt
from morse_jax.mole.experts import ExpertBankSpec, gather_lora, init_expert_bank
from morse_jax.rl import losses
from morse_jax.rl.batch import RouteExample, SequenceExample, pad_routes, pad_sequences


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Optimisation hyper-parameters (paper App. E defaults)."""

    lora_lr: float = 8e-5
    router_lr: float = 3e-5
    weight_decay: float = 0.01
    max_grad_norm: float | None = 1.0
    ppo_eps: float = 0.2
    ppo_eps_high: float | None = None
    alpha_pi: float = 0.15
    entropy_weight: float = rt.ENTROPY_WEIGHT
    orthogonality_weight: float = rt.ORTHOGONALITY_WEIGHT
    kl_beta: float = 0.0
    approx_set_logp: bool = False  # the authors' sum-of-log-probs approximation
    router_temperature: float = 1.0
    router_k: int = 2
    router_dim: int = 128
    micro_batch: int = 8
    length_buckets: tuple[int, ...] = (128, 256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096)
    route_buckets: tuple[int, ...] = (8, 16, 32, 64, 128, 256)
    max_active: int = 4

    def __post_init__(self):
        for name in ("lora_lr", "router_lr", "micro_batch", "router_k", "router_dim"):
            if getattr(self, name) <= 0:
                raise ValueError(f"train.{name} must be positive, got {getattr(self, name)}")
        if self.weight_decay < 0 or self.kl_beta < 0 or self.alpha_pi < 0:
            raise ValueError("train.weight_decay, train.kl_beta and train.alpha_pi must be >= 0")


def make_optimizer(cfg: TrainConfig) -> optax.GradientTransformation:
    """AdamW per group (LoRA / router) via ``multi_transform``, after optional global-norm clipping."""
    tx = optax.multi_transform(
        {"lora": optax.adamw(cfg.lora_lr, weight_decay=cfg.weight_decay),
         "router": optax.adamw(cfg.router_lr, weight_decay=cfg.weight_decay)},
        {"bank": "lora", "router": "router"},
    )
    if cfg.max_grad_norm:
        tx = optax.chain(optax.clip_by_global_norm(cfg.max_grad_norm), tx)
    return tx


def init_trainable(key: jax.Array, model_cfg: ModelConfig, spec: ExpertBankSpec, cfg: TrainConfig,
                   dtype=jnp.float32) -> dict:
    k1, k2 = jax.random.split(key)
    trainable = {"bank": init_expert_bank(k1, model_cfg, spec, dtype)}
    trainable["router"] = rt.init_router(k2, model_cfg.hidden_size, num_experts=max(spec.num_subtask, 1),
                                         dim=cfg.router_dim, dtype=jnp.float32)
    return trainable


def sequence_logprobs(frozen, model_cfg: ModelConfig, spec: ExpertBankSpec | None, bank, batch) -> jax.Array:
    """log p(target) at every position under the given experts: float32[R, L] (0 where masked)."""
    lora = None
    if spec is not None and bank is not None:
        lora = gather_lora(bank, spec, batch["expert_ids"], batch["expert_weights"])
    logits, _ = forward(frozen, model_cfg, batch["tokens"], valid=batch["valid"], lora=lora)
    logp = jax.nn.log_softmax(logits, axis=-1)
    out = jnp.take_along_axis(logp, batch["targets"][..., None], axis=-1)[..., 0]
    return out * batch["target_mask"]


class Trainer:
    """Owns the jitted gradient functions for one backbone and bank layout.

    With a ``mesh`` the functions run with explicit in/out shardings: frozen weights by the
    logical-axis rules, batch rows split over (data, fsdp), trainable params, gradients and
    optimizer state replicated (``morse_jax.parallel.sharded.trainer_functions``).
    """

    def __init__(self, model_cfg: ModelConfig, frozen_params, spec: ExpertBankSpec, cfg: TrainConfig, mesh=None):
        self.model_cfg, self.spec, self.cfg = model_cfg, spec, cfg
        self.frozen = split_segments(frozen_params, spec.n_adapt)
        self.tx = make_optimizer(cfg)
        self.compile_count = 0
        self._lora_grad = jax.jit(self._lora_grad_impl)
        self._router_grad = jax.jit(self._router_grad_impl, static_argnames=("reinforce",))
        self._apply = jax.jit(self._apply_impl, donate_argnums=(0, 1))
        self._logprobs = jax.jit(functools.partial(sequence_logprobs, model_cfg=model_cfg, spec=spec))
        self.mesh = mesh
        if mesh is not None:  # frozen params and batches sharded, trainable replicated (morse_jax.parallel)
            from morse_jax.parallel.sharded import trainer_functions

            self.frozen, self._lora_grad, self._router_grad, self._apply, self._logprobs = trainer_functions(self, mesh)

    # ---------------------------------------------------------------- device

    def _lora_grad_impl(self, trainable, frozen, batch):
        self.compile_count += 1

        def loss_fn(bank):
            new_logp = sequence_logprobs(frozen, self.model_cfg, self.spec, bank, batch)
            mask = batch["target_mask"]
            loss, m = losses.ppo_clip_token_loss(new_logp, batch["old_logp"], mask, batch["advantages"],
                                                 eps=self.cfg.ppo_eps, eps_high=self.cfg.ppo_eps_high)
            if self.cfg.kl_beta > 0:  # base = same backbone with experts off: no extra weights copy
                base = jax.lax.stop_gradient(sequence_logprobs(frozen, self.model_cfg, None, None, batch))
                kl = losses.kl_to_base(new_logp, base, mask)
                loss = loss + self.cfg.kl_beta * kl
                m = {**m, "kl_to_base": kl}
            n_tok = jnp.maximum(mask.sum(), 1.0)
            gap = jnp.abs(jax.lax.stop_gradient(new_logp) - batch["old_logp"]) * mask
            m = {**m, "logp_gap_max": gap.max(), "logp_gap_mean": gap.sum() / n_tok,
                 "token_nll": -(jax.lax.stop_gradient(new_logp) * mask).sum() / n_tok, "tokens": mask.sum()}
            return loss, m

        (loss, metrics), g = jax.value_and_grad(loss_fn, has_aux=True)(trainable["bank"])
        grads = {"bank": g, "router": jax.tree.map(jnp.zeros_like, trainable["router"])}
        return grads, {**metrics, "lora_loss": loss}

    def _router_grad_impl(self, trainable, embed, batch, *, reinforce):
        self.compile_count += 1
        c = self.cfg

        def loss_fn(router):
            emb = rt.subtask_embedding(embed, batch["desc_ids"], batch["desc_mask"])
            probs = rt.router_probs(router, emb, temperature=c.router_temperature)
            set_fn = rt.approx_set_log_prob if c.approx_set_logp else rt.set_log_prob
            set_logp = set_fn(probs, batch["members"])
            loss, m = losses.router_loss(set_logp, batch["old_set_logp"], batch["advantages"], alpha_pi=c.alpha_pi,
                                         eps=c.ppo_eps, reinforce=reinforce)
            w = batch["row_mask"]
            ent = jnp.sum(losses.routing_entropy(probs) * w) / jnp.maximum(w.sum(), 1.0)
            ortho = losses.prototype_orthogonality(router["prototypes"])
            total = loss - c.entropy_weight * ent + c.orthogonality_weight * ortho
            usage = jnp.sum(jax.nn.one_hot(batch["members"], probs.shape[-1]) * w[:, None, None], axis=(0, 1))
            return total, {**m, "router_loss": loss, "routing_entropy": ent, "orthogonality": ortho,
                           "expert_usage": usage}

        (loss, metrics), g = jax.value_and_grad(loss_fn, has_aux=True)(trainable["router"])
        grads = {"bank": jax.tree.map(jnp.zeros_like, trainable["bank"]), "router": g}
        return grads, metrics

    def _apply_impl(self, trainable, opt_state, grads):
        self.compile_count += 1
        updates, opt_state = self.tx.update(grads, opt_state, trainable)
        return optax.apply_updates(trainable, updates), opt_state, optax.global_norm(grads)

    # ---------------------------------------------------------------- host

    def init_opt_state(self, trainable):
        return self.tx.init(trainable)

    def update(self, trainable, opt_state, seqs: Sequence[SequenceExample], routes: Sequence[RouteExample], *,
               num_groups: int, reinforce: bool = True, progress=None):
        """One optimiser step over all examples (micro-batched, gradients summed).

        Returns (trainable, opt_state, metrics dict of floats). With nothing to learn from (all
        groups skipped) the params are returned unchanged and ``metrics["skipped_update"] = 1``.
        """
        scale = 1.0 / max(num_groups, 1)
        grads, metrics, parts = None, {}, []
        mb = self.cfg.micro_batch
        for start in range(0, len(seqs), mb):
            batch = pad_sequences(seqs[start:start + mb], rows=mb, length_buckets=self.cfg.length_buckets,
                                  max_active=self.cfg.max_active, scale=scale)
            g, m = self._lora_grad(trainable, self.frozen, batch)
            grads = g if grads is None else jax.tree.map(jnp.add, grads, g)
            parts.append(m)
            if progress is not None:
                progress(1)
        if routes and self.spec.num_subtask > 0:
            rows = next((b for b in self.cfg.route_buckets if b >= len(routes)), len(routes))
            batch = pad_routes(routes, rows=rows, k=self.cfg.router_k, scale=scale)
            g, m = self._router_grad(trainable, self.frozen["embed"], batch, reinforce=reinforce)
            grads = g if grads is None else jax.tree.map(jnp.add, grads, g)
            metrics.update({k: np.asarray(v) for k, v in m.items()})
        if grads is None:
            return trainable, opt_state, {"skipped_update": 1.0}
        if parts:
            tok = sum(float(p["tokens"]) for p in parts)
            metrics["lora_loss"] = sum(float(p["lora_loss"]) for p in parts)
            for k in ("clip_fraction", "approx_kl", "ratio_mean", "logp_gap_mean", "token_nll", "kl_to_base"):
                if k in parts[0]:
                    metrics[k] = sum(float(p[k]) * float(p["tokens"]) for p in parts) / max(tok, 1.0)
            metrics["logp_gap_max"] = max(float(p["logp_gap_max"]) for p in parts)
        trainable, opt_state, gnorm = self._apply(trainable, opt_state, grads)
        metrics["grad_norm"] = float(gnorm)
        metrics["skipped_update"] = 0.0
        out = {}
        for k, v in metrics.items():
            v = np.asarray(v)
            out[k] = v.tolist() if v.ndim else float(v)
        return trainable, opt_state, out

    def logprobs(self, bank, seqs: Sequence[SequenceExample]) -> list[np.ndarray]:
        """Per-example completion log-probs under ``bank`` (for checks against the sampler)."""
        out = []
        mb = self.cfg.micro_batch
        for start in range(0, len(seqs), mb):
            chunk = seqs[start:start + mb]
            batch = pad_sequences(chunk, rows=mb, length_buckets=self.cfg.length_buckets,
                                  max_active=self.cfg.max_active)
            lp = np.asarray(self._logprobs(self.frozen, bank=bank, batch=batch))
            for i, e in enumerate(chunk):
                p, n = len(e.prompt_ids), len(e.completion_ids)
                out.append(lp[i, p - 1:p - 1 + n])
        return out
