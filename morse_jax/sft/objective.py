"""The SFT objective the trainer runs: ``loss_fn(trainable, frozen, batch) -> (loss, metrics)``.

:func:`mor_objective` binds MoRAgent's ``morse_jax.mor.objective.sft_loss`` (role-masked CE +
α1 · balance + α2 · orthogonality) to its static settings. The ablations are ``MoRConfig``
settings of the same objective: plain LoRA with MoR's budget (``kind="lora"``,
``morse_jax.mor.params.plain_lora_config``), uniform routing, no balance / orthogonality loss.
The trainable tree is ``morse_jax.mor.params.init_mor_params``'s. The trainer
(``morse_jax.sft.step``) takes any function of this signature.
"""

from __future__ import annotations

import functools

from morse_jax.models.config import ModelConfig
from morse_jax.mor.config import MoRConfig
from morse_jax.mor.losses import ALPHA_BALANCE, ALPHA_ORTH
from morse_jax.mor.objective import sft_loss


def mor_objective(model_cfg: ModelConfig, mor_cfg: MoRConfig, *, alpha_balance: float = ALPHA_BALANCE,
                  alpha_orth: float = ALPHA_ORTH):
    """``sft_loss`` with its settings bound: ``loss_fn(trainable, frozen, batch)``.

    ``frozen``: backbone params with the last ``mor_cfg.adapted_layers`` layers split into their own
    segment (``models.split_segments``) when not every layer is adapted. Build it once and reuse
    it: the trainer's compiled steps are cached per objective object.
    """
    return functools.partial(sft_loss, model_cfg=model_cfg, mor_cfg=mor_cfg, alpha_balance=alpha_balance,
                             alpha_orth=alpha_orth)

