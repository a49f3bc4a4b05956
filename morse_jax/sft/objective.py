"""SFT objectives the trainer can run: ``loss_fn(trainable, frozen, batch) -> (loss, metrics)``.

:func:`lora_objective`: one plain LoRA on every token (MoLE's expert bank with a single always-on
expert, ``ExpertBankSpec(role_names=("single",), num_subtask=0)``) and the role-masked CE of
``morse_jax.mor.losses.role_ce``. It is the generic trainer's own check and a plain-LoRA peer for
the step bench; MoRAgent's objective (role groups, token routers, auxiliary losses) is
``morse_jax.mor``'s and plugs into the trainer the same way.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from morse_jax.models.config import ModelConfig
from morse_jax.models.transformer import forward
from morse_jax.mole.experts import ExpertBankSpec, gather_lora, init_expert_bank
from morse_jax.mor.batch import SFTBatch
from morse_jax.mor.losses import role_ce
from morse_jax.tasks.trajectories import ROLE_NAMES


def single_lora_spec(rank: int, n_adapt: int, targets=("q", "k", "v", "o", "gate", "up", "down"),
                     alpha: float | None = None) -> ExpertBankSpec:
    """One always-on LoRA of ``rank`` on ``targets`` of the last ``n_adapt`` layers; alpha defaults to
    the rank (scale 1, as MoRAgent's released layer applies no alpha/r scaling)."""
    return ExpertBankSpec(role_names=("single",), num_subtask=0, rank=rank, alpha=float(alpha or rank),
                          n_adapt=n_adapt, targets=tuple(targets), compose="onehot")


def init_lora(key: jax.Array, model_cfg: ModelConfig, spec: ExpertBankSpec, dtype=jnp.float32) -> dict:
    """The trainable tree of :func:`lora_objective`: MoLE's bank {"a", "b"} (A uniform, B = 0)."""
    return init_expert_bank(key, model_cfg, spec, dtype)


def lora_objective(model_cfg: ModelConfig, spec: ExpertBankSpec, role_names: tuple[str, ...] = ROLE_NAMES):
    """``loss_fn(bank, frozen, batch)``: role CE of the backbone with ``spec``'s one LoRA on every token.

    ``frozen``: backbone params split so the last ``spec.n_adapt`` layers form their own segment
    (``models.split_segments``). Metrics: ``role_ce``'s (ce, tokens, ce/<role>, acc/<role>, tokens/<role>).
    """
    if spec.num_experts != 1:
        raise ValueError("lora_objective: the spec must hold exactly one expert (single_lora_spec)")

    def loss_fn(bank, frozen, batch: SFTBatch):
        B = batch.tokens.shape[0]
        lora = gather_lora(bank, spec, jnp.zeros((B, 1), jnp.int32), jnp.ones((B, 1), jnp.float32))
        logits, _ = forward(frozen, model_cfg, batch.tokens, positions=batch.positions, valid=batch.valid,
                            lora=lora)
        return role_ce(logits, batch.tokens, batch.loss_mask & batch.valid, batch.role_ids, tuple(role_names))

    return loss_fn
