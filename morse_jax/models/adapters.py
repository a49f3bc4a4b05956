"""The adapter hook: every weight projection of a decoder layer goes through :func:`project`.

``project(layout, x, weights, group, out_dims, adapter)`` computes the frozen projection in the
caller's layout (``layout.linear``: the model's ``x @ W`` per target, or the decode path's fused
``[d_out, d_in]`` weights) and adds the adapter's low-rank deltas, one per target of the group.
A *group* is the set of targets that read the same activation: "qkv" (q, k, v), "o",
"gu" (gate, up), "down", and Gemma 4's "ple_gate", "ple_out" (never adapted).

Adapter types (one per-layer value each; ``None`` means no adapter):

* :class:`LayerLora`: one layer's slice of :class:`LoraInputs` (``morse_jax.mole.experts.
  gather_lora``), the training forward's form; activations [B, T, d] only.
* :class:`PreparedLora`: one layer of :func:`prepare_lora`, the sampler's form (factors laid out
  once per device call); activations [B, T, d] (prefill) or transposed [d, B] (decode step).

Adding an adapter type (e.g. token-routed role groups): write a pytree class (NamedTuple or
``flax.struct`` dataclass) with a method ``deltas(x, group, out_dims, columns) -> {target:
delta}`` that returns, for each target of ``out_dims`` ({target: d_out}, the targets this layer
has) that it adapts, the additive delta in the activation layout (``columns``: x is [d_in, B]
and deltas [d_out, B]; otherwise x [B, T, d_in] and deltas [B, T, d_out]). Optionally a method
``aux(x, group, columns) -> {name: array}``: values the training forward should hand back (e.g.
router logits for a balance loss); the block collects them per layer (:func:`project_aux`) and
``transformer.forward(..., with_aux=True)`` returns them stacked over the adapted layers.
Then hand the adapter to the forward: ``decode`` takes a tuple over adapted layers of per-layer
values; ``transformer.forward(lora=...)`` takes a *stacked* adapter covering the last
``num_layers`` layers (:class:`StackedAdapter`: :class:`LoraInputs` is one, sliced into
:class:`LayerLora` per layer). Nothing else changes: the decoder block, the layouts and the caches
never look inside an adapter.

Shapes: B batch, T tokens, d_in / d_out a projection's widths, E experts, K active experts per
row, r rank, L_adapt adapted layers.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Protocol

import jax
import jax.numpy as jnp

LORA_TARGETS = ("q", "k", "v", "o", "gate", "up", "down")
GROUPS = {"qkv": ("q", "k", "v"), "o": ("o",), "gu": ("gate", "up"), "down": ("down",),
          "ple_gate": ("ple_gate",), "ple_out": ("ple_out",)}  # targets by the activation they read


class Layout(Protocol):
    """How a caller stores weights and activations (see ``morse_jax.models.block``)."""

    columns: bool

    def linear(self, x: jax.Array, weights: dict, group: str, out_dims: dict[str, int] | None) -> dict[str, jax.Array]:
        """The frozen projection (+ bias) of ``group``, {target: y} for the targets the layer has."""


def project(layout: Layout, x: jax.Array, weights: dict, group: str, out_dims: dict[str, int] | None,
            adapter: Any) -> list[jax.Array]:
    """THE projection hook: frozen projection of ``group`` plus the adapter's deltas.

    x: [B, T, d_in] (or [d_in, B] with ``layout.columns``); weights: the layer's params in the
    layout's form; out_dims: {target: d_out} of a fused group's parts in stored order (the
    layout splits by it; None for a single target); adapter: a per-layer adapter value (see the
    module docstring) or None. Returns the targets' outputs in group order.
    """
    ys = layout.linear(x, weights, group, out_dims)
    if adapter is None:
        return list(ys.values())
    axis = 0 if layout.columns else -1
    deltas = adapter.deltas(x, group, {t: y.shape[axis] for t, y in ys.items()}, layout.columns)
    return [y + deltas[t] if t in deltas else y for t, y in ys.items()]


def project_aux(adapter: Any, x: jax.Array, group: str, columns: bool) -> dict:
    """The adapter's auxiliary outputs for the projections of ``group`` reading ``x`` (its
    ``aux`` method; {} for no adapter or an adapter without one)."""
    aux = getattr(adapter, "aux", None)
    return {} if aux is None else aux(x, group, columns)


class StackedAdapter(Protocol):
    """What ``transformer.forward(lora=...)`` needs of an adapter over the last ``num_layers``
    layers: a sub-range, and for ``jax.lax.scan`` the part stacked on a leading layer axis
    (``xs``) with ``rebuild(xs_i)`` giving layer i's per-layer value (what is not per layer, e.g.
    per-token role ids or per-row scales, is closed over)."""

    @property
    def num_layers(self) -> int: ...

    def layers(self, start: int, stop: int) -> "StackedAdapter": ...

    def scan_parts(self) -> tuple[Any, Any]: ...


# --------------------------------------------------------------------------- LoRA, training form


class LoraInputs(NamedTuple):
    """Per-row LoRA deltas for the adapted segment, already gathered for each row.

    Either gathered per row — a[target]: [L_adapt, B, K, d_in, r], b[target]: [L_adapt, B, K, r, d_out],
    scale: [B, K] — or all experts with per-row weights — a: [L_adapt, E, d_in, r],
    b: [L_adapt, E, r, d_out], scale: [B, E]. scale = expert weight * alpha / rank; 0 is an exact no-op.
    Built by ``morse_jax.mole.experts.gather_lora``.
    """

    a: dict[str, jax.Array]
    b: dict[str, jax.Array]
    scale: jax.Array

    @property
    def num_layers(self) -> int:
        return next(iter(self.a.values())).shape[0]

    def layers(self, start: int, stop: int) -> "LoraInputs":
        return LoraInputs({t: a[start:stop] for t, a in self.a.items()}, {t: b[start:stop] for t, b in self.b.items()},
                          self.scale)

    def scan_parts(self):
        return (self.a, self.b), lambda ab: LayerLora(ab[0], ab[1], self.scale)


class LayerLora(NamedTuple):
    """One layer of :class:`LoraInputs`: a[target] [B, K, d_in, r] or [E, d_in, r], b likewise,
    scale [B, K] or [B, E]. Rows-layout activations only."""

    a: dict[str, jax.Array]
    b: dict[str, jax.Array]
    scale: jax.Array

    def deltas(self, x, group, out_dims, columns):
        if columns:
            raise ValueError("LayerLora adapts [B, T, d] activations; the decode step takes prepare_lora's form")
        out = {}
        for t, d_out in out_dims.items():
            if t not in self.a:
                continue
            a, b = fit_lora(self.a[t], self.b[t], (x.shape[-1], d_out), t)
            scale = self.scale.astype(x.dtype)[:, None, :, None]
            if a.ndim == 4:  # gathered per row: [B, K, d_in, r], [B, K, r, d_out]
                xa = jnp.einsum("btd,bkdr->btkr", x, a.astype(x.dtype)) * scale
                out[t] = jnp.einsum("btkr,bkro->bto", xa, b.astype(x.dtype))
            else:  # all experts, per-row weights scattered over them: [E, d_in, r], [E, r, d_out]
                xa = jnp.einsum("btd,edr->bter", x, a.astype(x.dtype)) * scale
                out[t] = jnp.einsum("bter,ero->bto", xa, b.astype(x.dtype))
        return out


def fit_lora(a: jax.Array, b: jax.Array, dims: tuple[int, int], target: str) -> tuple[jax.Array, jax.Array]:
    """LoRA factors sized for the widest layer (``ModelConfig.target_dims``) cut to a layer's
    projection ``dims`` = (d_in, d_out): a narrower layer (Gemma 4 sliding next to full
    attention) uses the leading input rows of A and output columns of B. Factors that are too
    small are an error."""
    d_in, d_out = dims
    if a.shape[-2] == d_in and b.shape[-1] == d_out:
        return a, b
    if a.shape[-2] < d_in or b.shape[-1] < d_out:
        raise ValueError(f"LoRA factors for {target!r} are {a.shape[-2]} -> {b.shape[-1]} but a layer's projection "
                         f"is {d_in} -> {d_out}; size expert banks with ModelConfig.target_dims")
    return a[..., :d_in, :], b[..., :d_out]


# --------------------------------------------------------------------------- LoRA, sampler form


class PreparedLora(NamedTuple):
    """One adapted layer of :func:`prepare_lora`: per input group one A (all the group's targets
    stacked), per target one B.

    * all experts (``compose="onehot"``): A[group] [n, d_in] (n = targets * E * r, shared by
      every row), per-row scales s[group] [B, n] applied after A; B[t] [d_out, E*r].
    * gathered per row: A[group] [B, n, d_in] with each row's scales folded in (s empty);
      B[t] [B, d_out, Ka*r].
    """

    A: dict[str, jax.Array]
    s: dict[str, jax.Array]
    B: dict[str, jax.Array]

    def deltas(self, x, group, out_dims, columns):
        if group not in self.A:
            return {}
        A = self.A[group]
        if columns:  # xT [d_in, B] -> [d_out, B]
            A = _fit_a(A, x.shape[0], group).astype(x.dtype)
            if A.ndim == 2:
                xa = (A @ x) * self.s[group].T.astype(x.dtype)
                return self._split(xa, group, lambda v, s, n, Bt: Bt @ v[s:s + n], out_dims)
            xa = jnp.einsum("db,bnd->nb", x, A)
            return self._split(xa, group, lambda v, s, n, Bt: jnp.einsum("nb,bon->ob", v[s:s + n], Bt), out_dims)
        A = _fit_a(A, x.shape[-1], group).astype(x.dtype)  # x [B, T, d_in] -> [B, T, d_out]
        if A.ndim == 2:
            xa = jnp.einsum("btd,nd->btn", x, A) * self.s[group][:, None, :].astype(x.dtype)
            return self._split(xa, group, lambda v, s, n, Bt: jnp.einsum("btn,on->bto", v[..., s:s + n], Bt),
                               out_dims)
        xa = jnp.einsum("btd,bnd->btn", x, A)
        return self._split(xa, group, lambda v, s, n, Bt: jnp.einsum("btn,bon->bto", v[..., s:s + n], Bt), out_dims)

    def _split(self, xa, group, contract, out_dims):
        """Apply each target's B to its slice of ``xa``; ``contract(xa, start, n, B)`` does the
        product. B is cut to a narrower layer's d_out (see :func:`fit_lora`); targets the layer
        does not have are skipped."""
        deltas, start = {}, 0
        for t in GROUPS[group]:
            if t in self.B:
                Bt = self.B[t]
                n = Bt.shape[-1]
                if t in out_dims:
                    if Bt.shape[-2] != out_dims[t]:
                        Bt = _cut(Bt, out_dims[t], -2, t)
                    deltas[t] = contract(xa, start, n, Bt.astype(xa.dtype))
                start += n
        return deltas


def prepare_lora(lora: LoraInputs) -> tuple[PreparedLora, ...]:
    """Rearrange ``gather_lora`` output once per device call, outside the decode loop.

    Per adapted layer and input group (targets that read the same activation): one A for all the
    group's targets, so a step does one A product per group and one B product per target
    (:class:`PreparedLora` gives the shapes). Returns a tuple over adapted layers.
    """
    first = next(iter(lora.a.values()))
    shared = first.ndim == 4  # [L, E, d_in, r]
    out = []
    for j in range(first.shape[0]):
        layer = PreparedLora({}, {}, {})
        for group in ("qkv", "o", "gu", "down"):
            present = [t for t in GROUPS[group] if t in lora.a]
            if not present:
                continue
            As, Ss = [], []
            for t in present:
                a, b = lora.a[t][j], lora.b[t][j]
                if shared:  # a [E, d_in, r], b [E, r, d_out]
                    E, d_in, r = a.shape
                    As.append(jnp.transpose(a, (0, 2, 1)).reshape(E * r, d_in))
                    Ss.append(jnp.repeat(lora.scale, r, axis=1))
                    layer.B[t] = b.reshape(E * r, -1).T
                else:  # a [B, Ka, d_in, r], b [B, Ka, r, d_out]
                    Bsz, Ka, d_in, r = a.shape
                    a = a * lora.scale[:, :, None, None].astype(a.dtype)
                    As.append(jnp.transpose(a, (0, 1, 3, 2)).reshape(Bsz, Ka * r, d_in))
                    layer.B[t] = jnp.swapaxes(b.reshape(Bsz, Ka * r, -1), 1, 2)
            layer.A[group] = jnp.concatenate(As, axis=-2)
            if shared:
                layer.s[group] = jnp.concatenate(Ss, axis=-1)
        out.append(layer)
    return tuple(out)


def _cut(w, size, axis, target):
    if w.shape[axis] < size:
        raise ValueError(f"LoRA factors for {target!r} are narrower ({w.shape[axis]}) than a layer's projection "
                         f"({size}); size expert banks with ModelConfig.target_dims")
    return jax.lax.slice_in_dim(w, 0, size, axis=axis % w.ndim)


def _fit_a(A, d_in, group):
    return A if A.shape[-1] == d_in else _cut(A, d_in, -1, group)
