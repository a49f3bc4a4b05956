"""The MoR adapter: role-gated LoRA groups with per-token routers, through the one adapter hook.

Per wrapped projection W (x [.., d_in] -> [.., d_out]) and token t of role r (its role id), with
the role's shared LoRA (A_0, B_0) and routed LoRAs (A_i, B_i), i = 1..E_r::

    p_t      = softmax(float32(x_t G_r))                      router G_r [d_in, E_r], bias-free
    K_t      = the k_r largest p_t,i (ties: lowest index)      top-k
    w_t,i    = p_t,i / Σ_{j∈K_t} p_t,j  for i ∈ K_t, else 0    renormalised over the kept
    s_t      = 1 (shared_gate="always")  or  σ(x_t g_r)        shared LoRA's weight
    Δ(x_t)   = scale · (s_t · x_t A_0 B_0 + Σ_i w_t,i · x_t A_i B_i)

x is the projection's own input (the "layer input" the released layer routes on). A token whose
role id is NO_ROLE (-1) gets weight 0 on every LoRA: its delta is exactly 0, so its output is the
base model's bit for bit. Rows may differ in role and a row's role may change from token to token
(packed trajectories); in the decode step a generated token takes its row's role ([B] ids).
``routing="uniform"`` replaces p and top-k by w_t,i = 1 / E_r; ``kind="lora"`` is one LoRA on
every token (weight 1).

Compute layout: every token multiplies all N stacked LoRAs (x @ A_cat is one [d_in, N·r] product),
the per-token weights [B, T, N] (zero outside the token's role group) scale the N·r columns, then
one [N·r, d_out] product. Rows of one batch may be in different roles, so this one dense form
serves them all; N·r = 224 at the paper's setting.

Values:

* :class:`MoRLayer`: one adapted layer (``params`` sliced to that layer, per-token ``role_ids``);
  the adapter value of ``models.adapters.project``. Its ``aux`` returns the router logits
  {target: float32 [B, T, ΣE_r]} so that ``transformer.forward(..., with_aux=True)`` hands them to
  the balance loss (stacked [L, B, T, ΣE_r]).
* :class:`MoRInputs`: the stacked adapter ``transformer.forward(lora=...)`` takes (every adapted
  layer, role ids [B, T]).
* :func:`layer_values`: the tuple over adapted layers that ``decode.forward_cached`` (role ids
  [B, T]) and ``decode.decode_step`` (role ids [B]) take; :meth:`MoRLayer.with_roles` swaps ids.
"""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
from flax import struct

from morse_jax.models.adapters import GROUPS
from morse_jax.mor.config import MoRConfig
from morse_jax.mor.topk import topk_mask

NEG_INF = -1e30  # not -inf: a masked logit must not turn a softmax gradient into NaN


def token_weights(cfg: MoRConfig, router_logits: jax.Array | None, gate_logits: jax.Array | None,
                  role_ids: jax.Array) -> jax.Array:
    """Per-token weights of the N stacked LoRAs (module docstring), float32 [..., N].

    router_logits: float[..., ΣE_r] (None with routing="uniform" or kind="lora"); gate_logits:
    float[..., roles] (None unless shared_gate="sigmoid"); role_ids: int[...] (-1: no role).
    """
    if cfg.kind == "lora":
        return jnp.ones((*role_ids.shape, 1), jnp.float32)
    parts = []
    for r, (e, k) in enumerate(zip(cfg.routed, cfg.top_k)):
        on = (role_ids == r).astype(jnp.float32)[..., None]
        shared = jnp.ones(role_ids.shape, jnp.float32) if gate_logits is None else \
            jax.nn.sigmoid(gate_logits[..., r].astype(jnp.float32))
        parts.append(shared[..., None] * on)
        if e == 0:
            continue
        if router_logits is None:
            routed = jnp.full((*role_ids.shape, e), 1.0 / e, jnp.float32)
        else:
            start = cfg.router_offset(r)
            logits = router_logits[..., start:start + e].astype(jnp.float32)
            keep = topk_mask(logits, k)  # ties: lowest index first
            # softmax over the kept logits = the kept softmax probabilities renormalised
            routed = jax.nn.softmax(jnp.where(keep, logits, NEG_INF), axis=-1) * keep
        parts.append(routed * on)
    return jnp.concatenate(parts, axis=-1)


def _fit(w: jax.Array, size: int, axis: int) -> jax.Array:
    """Leading ``size`` entries along ``axis`` (a narrower Gemma 4 layer; ModelConfig.target_dims)."""
    if w.shape[axis] == size:
        return w
    if w.shape[axis] < size:
        raise ValueError(f"MoR factors are {w.shape[axis]} wide but a layer's projection needs {size}")
    return jax.lax.slice_in_dim(w, 0, size, axis=axis % w.ndim)


@struct.dataclass
class MoRLayer:
    """One adapted layer: ``params`` {"a": {t: [N, d_in, r]}, "b": {t: [N, r, d_out]}, "router"?:
    {t: [d_in, ΣE_r]}, "gate"?: {t: [d_in, roles]}}; ``role_ids`` int[B, T] (rows layout) or
    int[B] (the decode step: one token per row)."""

    params: dict
    role_ids: jax.Array
    cfg: MoRConfig = struct.field(pytree_node=False)

    def with_roles(self, role_ids: jax.Array) -> "MoRLayer":
        return self.replace(role_ids=role_ids)

    def _rows(self, x, columns):
        """x as [B, T, d_in] and role ids as [B, T] (columns: x [d_in, B] is one token per row)."""
        roles = self.role_ids[:, None] if self.role_ids.ndim == 1 else self.role_ids
        xr = x.T[:, None, :] if columns else x
        chex.assert_equal_shape_prefix([xr, roles], 2)
        return xr, roles

    def _logits(self, xr, t, name):
        w = self.params.get(name, {}).get(t)
        if w is None:
            return None
        return jnp.einsum("btd,de->bte", xr, _fit(w, xr.shape[-1], 0).astype(xr.dtype))

    def deltas(self, x, group, out_dims, columns):
        targets = [t for t in GROUPS[group] if t in out_dims and t in self.params["a"]]
        if not targets:
            return {}
        xr, roles = self._rows(x, columns)
        out = {}
        for t in targets:
            a = _fit(self.params["a"][t], xr.shape[-1], -2).astype(x.dtype)
            b = _fit(self.params["b"][t], out_dims[t], -1).astype(x.dtype)
            w = token_weights(self.cfg, self._logits(xr, t, "router"), self._logits(xr, t, "gate"), roles)
            xa = jnp.einsum("btd,ndr->btnr", xr, a) * w[..., None].astype(x.dtype)
            d = jnp.einsum("btnr,nro->bto", xa, b)
            if self.cfg.scale != 1.0:
                d = d * jnp.asarray(self.cfg.scale, d.dtype)
            out[t] = d[:, 0].T if columns else d
        return out

    def aux(self, x, group, columns):
        """{target: float32 router logits [B, T, ΣE_r]} of the group's routed targets."""
        if "router" not in self.params:
            return {}
        xr, _ = self._rows(x, columns)
        return {t: self._logits(xr, t, "router").astype(jnp.float32)
                for t in GROUPS[group] if t in self.params["router"]}


@struct.dataclass
class MoRInputs:
    """The stacked adapter for ``transformer.forward(lora=...)`` (``adapters.StackedAdapter``):
    ``params`` the whole trainable tree ([L, ...] leaves, ``morse_jax.mor.params``), ``role_ids``
    int[B, T]."""

    params: dict
    role_ids: jax.Array
    cfg: MoRConfig = struct.field(pytree_node=False)

    @property
    def num_layers(self) -> int:
        return jax.tree.leaves(self.params)[0].shape[0]

    def layers(self, start: int, stop: int) -> "MoRInputs":
        return self.replace(params=jax.tree.map(lambda p: p[start:stop], self.params))

    def scan_parts(self):
        return self.params, lambda p: MoRLayer(p, self.role_ids, self.cfg)


def layer_values(params: dict, role_ids: jax.Array, cfg: MoRConfig) -> tuple[MoRLayer, ...]:
    """Per adapted layer (the last ``L``) a :class:`MoRLayer`, for ``decode.forward_cached``
    (role_ids int[B, T]) and ``decode.decode_step`` (int[B]; swap with ``with_roles``)."""
    n = jax.tree.leaves(params)[0].shape[0]
    return tuple(MoRLayer(jax.tree.map(lambda p, j=j: p[j], params), role_ids, cfg) for j in range(n))
