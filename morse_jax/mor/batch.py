"""The SFT batch: what MoR's objective and the SFT trainer exchange (one typed pytree).

Lives in ``mor`` (a low layer) so that the objective (``morse_jax.mor``) and the trainer
(``morse_jax.sft``, higher) share one definition. Rows are right-padded renderings of
multi-role trajectories (``morse_jax.sft.data.render``), possibly packed.

Shapes: B rows, T tokens.
"""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
from flax import struct

NO_ROLE = -1  # role id of tokens that get no adapter (system, user, observation, template glue, padding)


@struct.dataclass
class SFTBatch:
    """One micro-batch of rendered trajectories.

    Attributes:
      tokens: int32[B, T] token ids (padding: any id, masked by ``valid``).
      role_ids: int32[B, T] index into the role names, NO_ROLE (-1) for tokens with no role.
      loss_mask: bool[B, T] True where the token is a prediction target (role-turn content and
        its end-of-turn token); the CE of token t is predicted from position t - 1.
      valid: bool[B, T] False at padding (never attended to, never a target).
      positions: int32[B, T] rotary positions (restart at 0 in each packed segment).
      segment_ids: int32[B, T] packed segment of each token (tokens attend only within their
        segment); all zeros when rows are not packed.
      prefix_hidden: float[B, T, d] or None: the residual stream entering the first adapted layer,
        precomputed by the frozen layers below it (``morse_jax.mor.objective.frozen_prefix``).
        Those layers never change during SFT, so the trainer computes it once per example and
        the objective then runs the adapted layers only. None: the objective runs every layer.
      logit_index: int32[B, C] or None: per row, the positions t whose next token t + 1 is a
        target, then repeats of the last one (``logit_mask`` False there). With it the objective
        runs the LM head at those B*C positions only (the targets are about a quarter of a
        rendered trajectory's tokens, and the head over a 49k vocabulary costs as much per token
        as the 8 adapted layers); without it, at every position. Same loss either way.
      logit_mask: bool[B, C] or None (with ``logit_index``): which entries are real targets.
    """

    tokens: jax.Array
    role_ids: jax.Array
    loss_mask: jax.Array
    valid: jax.Array
    positions: jax.Array
    segment_ids: jax.Array
    prefix_hidden: jax.Array | None = None
    logit_index: jax.Array | None = None
    logit_mask: jax.Array | None = None

    def check(self) -> "SFTBatch":
        """Assert shapes and dtypes agree (call at module boundaries); returns self."""
        chex.assert_rank(self.tokens, 2)
        chex.assert_equal_shape([self.tokens, self.role_ids, self.loss_mask, self.valid, self.positions,
                                 self.segment_ids])
        chex.assert_type([self.tokens, self.role_ids, self.positions, self.segment_ids], jnp.int32)
        chex.assert_type([self.loss_mask, self.valid], bool)
        if self.prefix_hidden is not None:
            chex.assert_rank(self.prefix_hidden, 3)
            chex.assert_equal_shape_prefix([self.tokens, self.prefix_hidden], 2)
        if (self.logit_index is None) != (self.logit_mask is None):
            raise ValueError("logit_index and logit_mask come together")
        if self.logit_index is not None:
            chex.assert_rank(self.logit_index, 2)
            chex.assert_equal_shape([self.logit_index, self.logit_mask])
            chex.assert_equal_shape_prefix([self.tokens, self.logit_index], 1)
            chex.assert_type(self.logit_index, jnp.int32)
            chex.assert_type(self.logit_mask, bool)
        return self
