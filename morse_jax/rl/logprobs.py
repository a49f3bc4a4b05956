"""Completion log-probs under given experts, for the padded batches of ``rl.batch``.

The batch's type picks the path: a :class:`~morse_jax.rl.batch.SequenceBatch` runs every row's
whole prompt + completion (:func:`flat_logprobs`), a :class:`~morse_jax.rl.batch.SharedBatch`
runs each prompt once into a KV cache and continues every candidate from it
(:func:`shared_logprobs`). Pure functions of arrays; jit them with the model config and bank
spec bound (``functools.partial``), as ``rl.update`` does.
"""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp

from morse_jax.models.config import ModelConfig
from morse_jax.models.head_logprobs import head_token_logprobs
from morse_jax.models.transformer import forward, init_cache
from morse_jax.mole.experts import ExpertBankSpec, gather_lora
from morse_jax.rl.batch import SequenceBatch, SharedBatch


def sequence_logprobs(frozen, model_cfg: ModelConfig, spec: ExpertBankSpec | None, bank,
                      batch: SequenceBatch | SharedBatch, *, start_layer: int = 0, remat: str = "none") -> jax.Array:
    """log p(target) under the given experts (0 where masked): :func:`flat_logprobs` for a
    ``SequenceBatch`` (float32[R, L], entry t for the token at t+1), :func:`shared_logprobs` for a
    ``SharedBatch`` (float32[R, Lc], entry j for completion token j). ``spec``/``bank`` None: the
    backbone alone (experts off). ``remat``: the adapted layers' rematerialisation under
    differentiation (``transformer.forward``; same values either way)."""
    if isinstance(batch, SharedBatch):
        return shared_logprobs(frozen, model_cfg, spec, bank, batch, start_layer=start_layer, remat=remat)
    return flat_logprobs(frozen, model_cfg, spec, bank, batch, start_layer=start_layer, remat=remat)


def _restart(states, name: str, start_layer: int):
    """(start layer, states) for ``forward``: (start_layer, states) if the batch carries them."""
    if states is None:
        return 0, None
    if start_layer <= 0:
        raise ValueError(f"the batch has {name} but start_layer={start_layer}: pass the first adapted layer")
    return start_layer, states


def flat_logprobs(frozen, model_cfg: ModelConfig, spec: ExpertBankSpec | None, bank, batch: SequenceBatch, *,
                  start_layer: int = 0, remat: str = "none") -> jax.Array:
    """log p(target) at every position of a ``SequenceBatch``: float32[R, L] (0 where masked).

    With ``batch.states`` the layers before ``start_layer`` (the first adapted one) are not run:
    the states are the residual stream entering it. With ``batch.logit_index`` (int32[R, C], each
    row's generated positions) the LM head runs at those R*C positions only (with 200-token
    prompts, half of R*L).
    """
    chex.assert_rank([batch.tokens, batch.targets, batch.target_mask], 2)
    start, states = _restart(batch.states, "states", start_layer)
    lora = None
    if spec is not None and bank is not None:
        lora = gather_lora(bank, spec, batch.expert_ids, batch.expert_weights, batch.expert_trainable)
    hidden, _ = forward(frozen, model_cfg, batch.tokens, valid=batch.valid, lora=lora, logits_mode="hidden",
                        start_layer=start, hidden=states, remat=remat)
    if batch.logit_index is None:
        return token_logprobs(frozen, model_cfg, hidden, batch.targets) * batch.target_mask
    idx = batch.logit_index
    h = jnp.take_along_axis(hidden, idx[..., None], axis=1)  # [R, C, d]
    lp = token_logprobs(frozen, model_cfg, h, jnp.take_along_axis(batch.targets, idx, axis=1))
    rows = jnp.arange(idx.shape[0])[:, None]
    # padding entries of the index repeat a position with weight 0, so the scatter-add is exact
    out = jnp.zeros(batch.targets.shape, jnp.float32).at[rows, idx].add(lp * batch.logit_mask)
    return out * batch.target_mask


def shared_logprobs(frozen, model_cfg: ModelConfig, spec: ExpertBankSpec | None, bank, batch: SharedBatch, *,
                    start_layer: int = 0, remat: str = "none") -> jax.Array:
    """Completion log-probs for a ``SharedBatch``: float32[R, Lc], entry j the log-prob of
    completion token j (0 where masked).

    The prompt rows run into a KV cache; each candidate row continues from a copy of its prompt
    row's cache. Gradients reach the experts through both passes (the prompt's adapted-layer
    keys and values depend on them).
    """
    chex.assert_rank([batch.prompt_tokens, batch.tokens, batch.target_mask], 2)
    use = spec is not None and bank is not None
    P, Lp = batch.prompt_tokens.shape
    Lc = batch.tokens.shape[1]
    start, prompt_states = _restart(batch.prompt_states, "prompt_states", start_layer)
    comp_states = batch.states if start else None  # pad_shared writes both or neither
    cache = init_cache(model_cfg, frozen, P, Lp, frozen["embed"].dtype, start_layer=start)
    lora = (gather_lora(bank, spec, batch.prompt_expert_ids, batch.prompt_expert_weights,
                        batch.prompt_expert_trainable) if use else None)
    h_prompt, cache = forward(frozen, model_cfg, batch.prompt_tokens, valid=batch.prompt_valid, cache=cache,
                              lora=lora, logits_mode="hidden", start_layer=start, hidden=prompt_states, remat=remat)
    rows = batch.prompt_row

    def widen(x):  # each candidate's copy of its prompt's cache, with Lc free slots after the prompt
        x = jnp.take(x, rows, axis=x.ndim - 4)  # stacked segments [n, P, S, K, D], unrolled [P, S, K, D]
        return jnp.pad(x, [(0, Lc if a == x.ndim - 3 else 0) for a in range(x.ndim)])

    cache = {"layers": jax.tree.map(widen, cache["layers"]),
             "valid": jnp.pad(cache["valid"][rows], ((0, 0), (0, Lc))), "index": cache["index"]}
    lora = (gather_lora(bank, spec, batch.expert_ids, batch.expert_weights, batch.expert_trainable)
            if use else None)
    h_comp, _ = forward(frozen, model_cfg, batch.tokens, valid=batch.valid, cache=cache, lora=lora,
                        logits_mode="hidden", start_layer=start, hidden=comp_states, remat=remat)
    # completion token 0 is predicted at the prompt's last slot, token j at completion slot j-1
    hidden = jnp.concatenate([h_prompt[rows, -1][:, None], h_comp[:, :-1]], axis=1)
    return token_logprobs(frozen, model_cfg, hidden, batch.tokens) * batch.target_mask


def token_logprobs(frozen, model_cfg: ModelConfig, hidden: jax.Array, targets: jax.Array) -> jax.Array:
    """log softmax(LM head(hidden))[target]: float32[...] for hidden [..., d], targets int32[...].

    ``models.head_logprobs``: logit[target] - logsumexp over chunks of positions, and under
    differentiation the closed-form gradient w.r.t. ``hidden`` computed next to it, so the
    [..., V] logits are neither kept for the backward pass nor materialised whole.
    """
    return head_token_logprobs(frozen, model_cfg, hidden, targets)
