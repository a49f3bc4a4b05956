"""What a config determines without loading anything: the expert-bank layout, the trainer's and
the orchestrator's settings, the sampler's buckets, the number of training steps and the memory plan.

The job builds its objects through these functions and config validation builds them too, so a
constraint between fields (a batch size above the largest bucket, a token budget above the
largest new-token bucket) is a one-line config error before any weights load.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

from morse_jax.config.variants import agent_variant_of, variant_of
from morse_jax.mole.experts import ExpertBankSpec
from morse_jax.mor.config import MoRConfig
from morse_jax.mor.params import plain_lora_config
from morse_jax.rl.update import TrainConfig
from morse_jax.sampling.sampler import SamplerConfig
from morse_jax.sft.config import DEFAULT_BUCKETS, SFTConfig
from morse_jax.tasks.trajectories import ROLE_NAMES
from morse_jax.tomas.config import OrchestratorConfig, SamplingSettings

_DEFAULT_SAMPLER = SamplerConfig()


def bank_spec(cfg) -> ExpertBankSpec | None:
    """Expert-bank layout for the config's variant (the config is the one source of every rank)."""
    orch = variant_of(cfg).orchestration
    common = dict(n_adapt=cfg.mole.n_adapt, targets=tuple(cfg.mole.targets), compose=cfg.mole.compose)
    if orch == "none":
        return None
    if orch == "single_lora":
        rank = cfg.mole.single_rank
        return ExpertBankSpec(role_names=("single",), num_subtask=0, rank=rank, alpha=2.0 * rank, **common)
    return ExpertBankSpec(num_subtask=cfg.mole.num_subtask, rank=cfg.mole.rank, alpha=cfg.mole.alpha, **common)


def buckets_up_to(base: Sequence[int], limit: int) -> tuple[int, ...]:
    """``base`` extended by doublings until it covers ``limit``; ``limit`` itself ends the batch
    buckets when it is not a power of two (no row budget is rounded past what the user asked)."""
    out = [b for b in base if b < limit]
    nxt = out[-1] * 2 if out else 1
    while nxt < limit:
        out.append(nxt)
        nxt *= 2
    out.append(limit)
    return tuple(out)


def token_budgets(cfg) -> int:
    """The largest number of new tokens any call of this config may ask for."""
    r = cfg.rollout
    return max(r.max_new_tokens, r.eval_max_new_tokens, r.planner_max_new_tokens)


def max_active(cfg) -> int:
    """Expert slots a call of this config can need (``ExpertBankSpec.max_active``; at least 1)."""
    spec = bank_spec(cfg)
    return spec.max_active if spec is not None else 1


def sampler_config(cfg, *, return_prefix_states: bool = False) -> SamplerConfig:
    """The sampler's settings: batch buckets end at ``sampler.max_batch``, new-token buckets cover
    every token budget of the config, prompt buckets cover twice the largest budget (a prompt
    carries upstream artifacts), expert slots cover the bank's ``max_active``. Unused buckets cost
    nothing: programs compile on first use."""
    d = _DEFAULT_SAMPLER
    n = token_budgets(cfg)
    new_tokens = buckets_up_to(d.new_token_buckets, n) if n > max(d.new_token_buckets) else d.new_token_buckets
    prompt_limit = max(max(d.prompt_buckets), 2 * n)
    prompts = buckets_up_to(d.prompt_buckets, prompt_limit) if prompt_limit > max(d.prompt_buckets) else d.prompt_buckets
    return SamplerConfig(batch_buckets=buckets_up_to(d.batch_buckets, cfg.sampler.max_batch),
                         prompt_buckets=prompts, new_token_buckets=new_tokens,
                         max_batch=cfg.sampler.max_batch, chunk=cfg.sampler.chunk, max_active=max_active(cfg),
                         return_prefix_states=return_prefix_states, cpu_kernels=cfg.sampler.cpu_kernels,
                         block_weights=cfg.sampler.get("block_weights", "auto"),
                         refill=bool(cfg.sampler.get("refill", False)), prefill_rows=cfg.sampler.get("prefill_rows", 0))


def train_steps(cfg, n_train_tasks: int) -> int:
    """HGRPO steps of a training run: ``train.steps``, or ``train.epochs`` passes over the tasks."""
    if cfg.train.epochs > 0:
        return cfg.train.epochs * -(-n_train_tasks // cfg.data.tasks_per_step)
    return cfg.train.steps


def memory_plan(cfg, model_config, spec: ExpertBankSpec | None, mesh_shape: Sequence[int], backend: str):
    """The per-device memory plan of this run (``parallel.memory.memory_plan`` with the config's
    token budgets, update micro-batch, sampler batch and the prefill chunk's token rows the sampler
    uses on ``backend``, e.g. ``jax.default_backend()``)."""
    from morse_jax import parallel as par
    from morse_jax.sampling.requests import prefill_token_rows

    r = cfg.rollout
    n = max(r.max_new_tokens, r.eval_max_new_tokens)
    return par.memory_plan(model_config, spec, "adamw", batch=cfg.train.micro_batch,
                           cache_len=[p + n for p in (512, 1024, 2048)], seq_len=1024 + n,
                           mesh_shape=tuple(mesh_shape), dtype=cfg.model.dtype, sample_batch=cfg.sampler.max_batch,
                           remat=cfg.train.remat, prefill_rows=prefill_token_rows(sampler_config(cfg), backend))


def train_config(cfg) -> TrainConfig:
    """The trainer's settings: ``cfg.train``, the router's K (``mole.top_k``) and the bank's
    expert slots (``max_active``)."""
    t = cfg.train
    return TrainConfig(lora_lr=t.lora_lr, router_lr=t.router_lr, weight_decay=t.weight_decay,
                       max_grad_norm=t.max_grad_norm or None, ppo_eps=t.ppo_eps, ppo_epochs=t.ppo_epochs,
                       loss_normalisation=t.loss_normalisation, alpha_pi=t.alpha_pi,
                       entropy_weight=t.entropy_weight, orthogonality_weight=t.orthogonality_weight,
                       kl_beta=t.kl_beta, approx_set_logp=t.approx_set_logp, top_k=cfg.mole.top_k,
                       micro_batch=t.micro_batch, max_active=max_active(cfg),
                       reuse_prefix_states=t.reuse_prefix_states, remat=t.remat)


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
        heal_answer_prefix=r.heal_answer_prefix, verify_workers=r.verify_workers,
        verify_overlap=r.verify_overlap, seed=cfg.seed)


# --------------------------------------------------------------------------- MoRAgent (config.system="moragent")


def mor_config(cfg, model_cfg) -> MoRConfig | None:
    """The variant's adapter (``morse_jax.mor.MoRConfig``): MoR with ``moragent.*``'s groups, or the
    plain-LoRA row (one LoRA on every token with MoR's trainable budget, or rank
    ``moragent.lora_rank``); None for a variant without adapter. ``model_cfg`` sizes the budget."""
    v = agent_variant_of(cfg)
    if v.adapter == "none":
        return None
    m = cfg.moragent
    mor = MoRConfig(role_names=ROLE_NAMES, routed=tuple(m.routed), top_k=tuple(m.top_k), rank=m.rank,
                    targets=tuple(m.targets), n_adapt=m.n_adapt or None, shared_gate=m.shared_gate, scale=m.scale,
                    routing="router" if m.routers else "uniform", use_balance=m.balance_weight > 0,
                    use_orth=m.orth_weight > 0)
    if v.adapter == "lora":
        return dataclasses.replace(mor, kind="lora", rank=m.lora_rank) if m.lora_rank else \
            plain_lora_config(model_cfg, mor)
    return mor


def sft_config(cfg) -> SFTConfig:
    """The SFT trainer's settings (``morse_jax.sft.SFTConfig``) from ``moragent.*``: length buckets
    up to ``moragent.max_len``, accumulation = batch_size / micro_batch."""
    m = cfg.moragent
    buckets = tuple(b for b in DEFAULT_BUCKETS if b < m.max_len) + (m.max_len,)
    return SFTConfig(learning_rate=m.lr, warmup_fraction=m.warmup_fraction, epochs=m.epochs,
                     micro_batch=m.micro_batch, accum_steps=m.batch_size // m.micro_batch, length_buckets=buckets,
                     seed=cfg.seed, checkpoint_every=m.checkpoint_every)
