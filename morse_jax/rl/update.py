"""The jitted HGRPO update: recompute log-probs under the current experts, losses, AdamW.

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
(``SequenceExample.expert_trainable``). Micro-batches of sequences are accumulated on the host
(gradients are sums, so exact). ``ppo_epochs`` passes over the same examples each take an
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
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

from morse_jax.models.config import ModelConfig
from morse_jax.models.transformer import forward, init_cache, split_segments
from morse_jax.mole import router as rt
from morse_jax.mole.experts import ExpertBankSpec, gather_lora, init_expert_bank
from morse_jax.rl import losses
from morse_jax.rl.batch import (RouteExample, SequenceExample, group_order, pad_routes, pad_sequences, pad_shared,
                                share_key)


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
    router_k: int = 2
    router_dim: int = 128
    micro_batch: int = 8
    length_buckets: tuple[int, ...] = (128, 256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096)
    # LM-head positions per row (the longest completion's bucket) and, with share_prompts, the
    # prompt and completion lengths: 1/8-octave steps, so padding wastes at most ~20 % (a 194-token
    # completion pads to 224, not 256) for a bounded number of compiles. None: head everywhere.
    completion_buckets: tuple[int, ...] | None = (
        16, 32, 48, 64, 80, 96, 112, 128, 160, 192, 224, 256, 320, 384, 448, 512, 640, 768, 896, 1024,
        1280, 1536, 1792, 2048, 2560, 3072, 3584, 4096)
    route_buckets: tuple[int, ...] = (8, 16, 32, 64, 128, 256)
    # run a prompt once for all candidates sharing it and their active set (rl.batch.pad_shared)
    # in updates where that at least halves the prompts run; prompts and completions then pad to
    # completion_buckets separately
    share_prompts: bool = True
    max_active: int = 4
    # start at the first adapted layer from the sampler's prefix_states when every example of an
    # update carries them (SamplerConfig.return_prefix_states); otherwise run the whole model
    reuse_prefix_states: bool = True

    def __post_init__(self):
        for name in ("lora_lr", "router_lr", "micro_batch", "router_k", "router_dim", "ppo_epochs"):
            if getattr(self, name) <= 0:
                raise ValueError(f"train.{name} must be positive, got {getattr(self, name)}")
        if self.max_grad_norm is not None and self.max_grad_norm < 0:
            raise ValueError(f"train.max_grad_norm must be >= 0 (0: off), got {self.max_grad_norm}")
        if self.loss_normalisation not in losses.NORMALISATIONS:
            raise ValueError(f"train.loss_normalisation must be one of {losses.NORMALISATIONS}, "
                             f"got {self.loss_normalisation!r}")
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


def sequence_logprobs(frozen, model_cfg: ModelConfig, spec: ExpertBankSpec | None, bank, batch, *,
                      start_layer: int = 0) -> jax.Array:
    """log p(target) at every position under the given experts: float32[R, L] (0 where masked).

    With ``batch["states"]`` (``with_states`` padding) the layers before ``start_layer`` (the
    first adapted one) are not run: the states are the residual stream entering it.

    With ``batch["logit_index"]`` (int32[R, C], each row's generated positions, from
    ``pad_sequences``) the LM head runs at those R*C positions only (with 200-token prompts,
    half of R*L). A prompt-sharing batch (``pad_shared``) goes to :func:`shared_logprobs` and
    gives float32[R, Lc], entry j for completion token j.
    """
    if "prompt_tokens" in batch:
        return shared_logprobs(frozen, model_cfg, spec, bank, batch, start_layer=start_layer)
    start, states = _restart(batch, "states", start_layer)
    lora = None
    if spec is not None and bank is not None:
        lora = gather_lora(bank, spec, batch["expert_ids"], batch["expert_weights"], batch.get("expert_trainable"))
    hidden, _ = forward(frozen, model_cfg, batch["tokens"], valid=batch["valid"], lora=lora, logits_mode="hidden",
                        start_layer=start, hidden=states)
    if "logit_index" not in batch:
        return token_logprobs(frozen, model_cfg, hidden, batch["targets"]) * batch["target_mask"]
    idx = batch["logit_index"]
    h = jnp.take_along_axis(hidden, idx[..., None], axis=1)  # [R, C, d]
    lp = token_logprobs(frozen, model_cfg, h, jnp.take_along_axis(batch["targets"], idx, axis=1))
    rows = jnp.arange(idx.shape[0])[:, None]
    # padding entries of the index repeat a position with weight 0, so the scatter-add is exact
    out = jnp.zeros(batch["targets"].shape, jnp.float32).at[rows, idx].add(lp * batch["logit_mask"])
    return out * batch["target_mask"]


def _restart(batch, name: str, start_layer: int):
    """(start layer, states) for ``forward``: (start_layer, batch[name]) if the batch has states."""
    if name not in batch:
        return 0, None
    if start_layer <= 0:
        raise ValueError(f"the batch has {name} but start_layer={start_layer}: pass the first adapted layer")
    return start_layer, batch[name]


def shared_logprobs(frozen, model_cfg: ModelConfig, spec: ExpertBankSpec | None, bank, batch, *,
                    start_layer: int = 0) -> jax.Array:
    """Completion log-probs for a prompt-sharing batch (``rl.batch.pad_shared``): float32[R, Lc],
    entry j the log-prob of completion token j (0 where masked).

    The prompt rows run into a KV cache; each candidate row continues from a copy of its prompt
    row's cache. Gradients reach the experts through both passes (the prompt's adapted-layer
    keys and values depend on them).
    """
    use = spec is not None and bank is not None
    P, Lp = batch["prompt_tokens"].shape
    Lc = batch["tokens"].shape[1]
    start, prompt_states = _restart(batch, "prompt_states", start_layer)
    comp_states = batch["states"] if start else None  # pad_shared writes both or neither
    cache = init_cache(model_cfg, frozen, P, Lp, frozen["embed"].dtype, start_layer=start)
    lora = (gather_lora(bank, spec, batch["prompt_expert_ids"], batch["prompt_expert_weights"],
                        batch.get("prompt_expert_trainable")) if use else None)
    h_prompt, cache = forward(frozen, model_cfg, batch["prompt_tokens"], valid=batch["prompt_valid"], cache=cache,
                              lora=lora, logits_mode="hidden", start_layer=start, hidden=prompt_states)
    rows = batch["prompt_row"]

    def widen(x):  # each candidate's copy of its prompt's cache, with Lc free slots after the prompt
        x = jnp.take(x, rows, axis=x.ndim - 4)  # stacked segments [n, P, S, K, D], unrolled [P, S, K, D]
        return jnp.pad(x, [(0, Lc if a == x.ndim - 3 else 0) for a in range(x.ndim)])

    cache = {"layers": jax.tree.map(widen, cache["layers"]),
             "valid": jnp.pad(cache["valid"][rows], ((0, 0), (0, Lc))), "index": cache["index"]}
    lora = (gather_lora(bank, spec, batch["expert_ids"], batch["expert_weights"], batch.get("expert_trainable"))
            if use else None)
    h_comp, _ = forward(frozen, model_cfg, batch["tokens"], valid=batch["valid"], cache=cache, lora=lora,
                        logits_mode="hidden", start_layer=start, hidden=comp_states)
    # completion token 0 is predicted at the prompt's last slot, token j at completion slot j-1
    hidden = jnp.concatenate([h_prompt[rows, -1][:, None], h_comp[:, :-1]], axis=1)
    return token_logprobs(frozen, model_cfg, hidden, batch["tokens"]) * batch["target_mask"]


def token_logprobs(frozen, model_cfg: ModelConfig, hidden: jax.Array, targets: jax.Array) -> jax.Array:
    """log softmax(LM head(hidden))[target]: float32[...] for hidden [..., d], targets int32[...].

    Computed as logit[target] - logsumexp(logits): unlike a full log_softmax, no second [..., V]
    array is written and read back (the head's elementwise passes were ~1/3 of its time on CPU).
    """
    head = frozen["embed"].T if model_cfg.tie_embeddings else frozen["lm_head"]
    logits = jnp.einsum("...d,dv->...v", hidden, head).astype(jnp.float32)
    if model_cfg.final_logit_softcap:
        logits = jnp.tanh(logits / model_cfg.final_logit_softcap) * model_cfg.final_logit_softcap
    picked = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    return picked - jax.nn.logsumexp(logits, axis=-1)


class Trainer:
    """Owns the jitted gradient functions for one backbone and bank layout.

    With a ``mesh`` the functions run with explicit in/out shardings: frozen weights by the
    logical-axis rules, batch rows split over (data, fsdp), trainable params, gradients and
    optimizer state replicated (``morse_jax.parallel.jit.trainer_functions``).
    """

    def __init__(self, model_cfg: ModelConfig, frozen_params, spec: ExpertBankSpec, cfg: TrainConfig, mesh=None):
        self.model_cfg, self.spec, self.cfg = model_cfg, spec, cfg
        self.frozen = split_segments(frozen_params, spec.n_adapt)
        self.tx = make_optimizer(cfg)
        self.compile_count = 0
        self.start_layer = model_cfg.num_layers - spec.n_adapt  # where prefix_states enter
        self._lora_grad = jax.jit(self._lora_grad_impl)
        self._router_grad = jax.jit(self._router_grad_impl, static_argnames=("reinforce",))
        self._apply = jax.jit(self._apply_impl, donate_argnums=(0, 1))
        self._logprobs = jax.jit(functools.partial(sequence_logprobs, model_cfg=model_cfg, spec=spec,
                                                   start_layer=self.start_layer))
        self.mesh = mesh
        if mesh is not None:  # frozen params and batches sharded, trainable replicated (morse_jax.parallel)
            from morse_jax.parallel.jit import trainer_functions

            self.frozen, self._lora_grad, self._router_grad, self._apply, self._logprobs = trainer_functions(self, mesh)

    # ---------------------------------------------------------------- device

    def _lora_grad_impl(self, trainable, frozen, batch):
        self.compile_count += 1

        def loss_fn(bank):
            new_logp = sequence_logprobs(frozen, self.model_cfg, self.spec, bank, batch, start_layer=self.start_layer)
            mask = batch["target_mask"]
            norm = self.cfg.loss_normalisation
            loss, m = losses.ppo_clip_token_loss(new_logp, batch["old_logp"], mask, batch["advantages"],
                                                 eps=self.cfg.ppo_eps, eps_high=self.cfg.ppo_eps_high,
                                                 normalisation=norm)
            if self.cfg.kl_beta > 0:  # base = same backbone with experts off: no extra weights copy
                base = jax.lax.stop_gradient(sequence_logprobs(frozen, self.model_cfg, None, None, batch,
                                                               start_layer=self.start_layer))
                kl = losses.kl_to_base(new_logp, base, mask, norm)
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
        norms = {"grad_norm": optax.global_norm(grads), "grad_norm_lora": optax.global_norm(grads["bank"]),
                 "grad_norm_router": optax.global_norm(grads["router"])}  # before any clipping
        return optax.apply_updates(trainable, updates), opt_state, norms

    # ---------------------------------------------------------------- host

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
        scale = 1.0 / max(num_groups, 1)
        shared, chunks = self._micro_batches(seqs)
        states = self._use_states(seqs)
        batches = [self._pad([seqs[i] for i in idx], shared, scale, states) for idx in chunks]
        route_batch = None
        if self.spec.num_subtask > 0:
            rows = next((b for b in self.cfg.route_buckets if b >= len(routes)), len(routes))
            route_batch = pad_routes(routes, rows=rows, k=self.cfg.router_k, scale=scale)
        first = {}
        for epoch in range(self.cfg.ppo_epochs):
            grads, metrics = self._gradients(trainable, batches, route_batch, reinforce=reinforce and epoch == 0,
                                             progress=progress)
            trainable, opt_state, norms = self._apply(trainable, opt_state, grads)
            metrics.update(norms)
            if epoch == 0:
                first = metrics
        if self.cfg.ppo_epochs > 1:
            metrics.update({f"{k}_first": first[k] for k in ("clip_fraction", "ratio_mean") if k in first})
        metrics["skipped_update"] = 0.0
        out = {}
        for k, v in metrics.items():
            v = np.asarray(v)
            out[k] = v.tolist() if v.ndim else float(v)
        return trainable, opt_state, out

    def _gradients(self, trainable, batches, route_batch, *, reinforce: bool, progress=None):
        """(grads summed over the micro-batches and the router batch, metrics) at ``trainable``."""
        grads, metrics, parts = None, {}, []
        for batch in batches:
            g, m = self._lora_grad(trainable, self.frozen, batch)
            grads = g if grads is None else jax.tree.map(jnp.add, grads, g)
            parts.append(m)
            if progress is not None:
                progress(1)
        if route_batch is not None:
            g, m = self._router_grad(trainable, self.frozen["embed"], route_batch, reinforce=reinforce)
            grads = g if grads is None else jax.tree.map(jnp.add, grads, g)
            metrics.update({k: np.asarray(v) for k, v in m.items()})
        if parts:
            tok = sum(float(p["tokens"]) for p in parts)
            metrics["lora_loss"] = sum(float(p["lora_loss"]) for p in parts)
            for k in ("clip_fraction", "approx_kl", "ratio_mean", "logp_gap_mean", "token_nll", "kl_to_base"):
                if k in parts[0]:
                    metrics[k] = sum(float(p[k]) * float(p["tokens"]) for p in parts) / max(tok, 1.0)
            metrics["logp_gap_max"] = max(float(p["logp_gap_max"]) for p in parts)
        if grads is None:  # only router-less route examples: nothing to differentiate
            grads = jax.tree.map(jnp.zeros_like, trainable)
        return grads, metrics

    def _micro_batches(self, seqs: Sequence[SequenceExample]) -> tuple[bool, list[list[int]]]:
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

    def _use_states(self, seqs: Sequence[SequenceExample]) -> bool:
        """Restart at the first adapted layer: decided once per update (one layout, one compile)."""
        return (self.cfg.reuse_prefix_states and self.start_layer > 0 and bool(seqs)
                and all(e.prefix_states is not None for e in seqs))

    def _pad(self, chunk: Sequence[SequenceExample], shared: bool, scale: float = 1.0,
             states: bool = False) -> dict[str, np.ndarray]:
        c = self.cfg
        if shared:
            return pad_shared(chunk, rows=c.micro_batch, buckets=c.completion_buckets or c.length_buckets,
                              max_active=c.max_active, scale=scale, with_states=states)
        return pad_sequences(chunk, rows=c.micro_batch, length_buckets=c.length_buckets, max_active=c.max_active,
                             scale=scale, completion_buckets=c.completion_buckets, with_states=states)

    def logprobs(self, bank, seqs: Sequence[SequenceExample]) -> list[np.ndarray]:
        """Per-example completion log-probs under ``bank`` (for checks against the sampler)."""
        out: list[np.ndarray | None] = [None] * len(seqs)
        shared, chunks = self._micro_batches(seqs)
        states = self._use_states(seqs)
        for idx in chunks:
            batch = self._pad([seqs[i] for i in idx], shared, states=states)
            lp = np.asarray(self._logprobs(self.frozen, bank=bank, batch=batch))
            for row, i in enumerate(idx):
                p, n = len(seqs[i].prompt_ids), len(seqs[i].completion_ids)
                out[i] = lp[row, :n] if shared else lp[row, p - 1:p - 1 + n]
        return out
