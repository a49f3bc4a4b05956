"""Rank-rho subspace divergence (paper App. L.1) and its size-preserving shuffle baseline.

The paper's diagnostic (App. L.1): for a layer and a group g of prompts, restrict the captured
LoRA-input activations A in R^{N_p x d} to the rows of g, mean-centre, and take the top-rho
right singular vectors V_g in R^{d x rho}. For every group pair::

    div(g_a, g_b) = 1 - (1/rho) * || V_{g_a}^T V_{g_b} ||_F^2   in [0, 1]

0 = identical rank-rho subspaces, 1 = mutually orthogonal ones. Shuffle baseline: randomly permute
the group labels (which preserves group sizes), recompute the group subspaces and average the
off-diagonal divergence; T = 20 trials give a mean +- sigma. The real-vs-shuffle gap measures how
much divergence is group-conditional rather than an artifact of any size-preserving partition.

Two kinds of group subspace feed the same divergence and shuffle code:

* activations (:func:`activation_diagnostic`): exactly App. L.1, on features [N, L, d]
  (``morse_jax.analysis.activations`` captures them from the backbone);
* trained LoRA updates (:func:`expert_divergence`, :func:`update_group_diagnostic`): our
  weight-space counterpart. An expert's (or a call's composed) update at one layer is
  dW = scale * A B with A [d_in, r], B [r, d_out]; its input-side subspace is the top-rho left
  singular vectors of dW, which live in the same R^d as the activations above (the directions
  the adapter reads). dW is unchanged by A -> A R, B -> R^-1 B, so the measure is invariant to
  any reparametrisation inside the rank-r factorisation.

All arrays here are host numpy (float64); shapes are in each docstring.
"""

from __future__ import annotations

from typing import Callable, Hashable, Sequence

import chex
import numpy as np

SHUFFLE_TRIALS = 20  # App. L.1: T = 20 trials
_REL_TOL = 1e-6  # a singular value below this fraction of the largest counts as zero


class RankDeficientError(ValueError):
    """A group's data spans fewer than rho directions, so its rank-rho subspace is undefined."""


# --------------------------------------------------------------------------- the divergence


def subspace_divergence(va: np.ndarray, vb: np.ndarray) -> float:
    """div(V_a, V_b) = 1 - ||V_a^T V_b||_F^2 / rho (App. L.1), for orthonormal V_a, V_b [d, rho]."""
    chex.assert_rank([va, vb], 2)
    chex.assert_equal_shape([va, vb])
    rho = va.shape[1]
    overlap = np.asarray(va, np.float64).T @ np.asarray(vb, np.float64)
    # Clip tiny round-off outside [0, 1] so identical subspaces report exactly 0.
    return float(np.clip(1.0 - np.sum(overlap**2) / rho, 0.0, 1.0))


def divergence_matrix(subspaces: Sequence[np.ndarray]) -> np.ndarray:
    """Pairwise divergences float64[G, G] (zero diagonal) of G orthonormal bases [d, rho]."""
    v = np.stack([np.asarray(s, np.float64) for s in subspaces])  # [G, d, rho]
    chex.assert_rank(v, 3)
    rho = v.shape[-1]
    overlap = np.einsum("adr,bds->abrs", v, v)
    div = np.clip(1.0 - np.sum(overlap**2, axis=(2, 3)) / rho, 0.0, 1.0)
    np.fill_diagonal(div, 0.0)
    return div


def mean_off_diagonal(m: np.ndarray) -> float:
    """Mean of the off-diagonal entries of a square matrix [G, G], G >= 2 (NaN entries propagate)."""
    chex.assert_rank(m, 2)
    g = m.shape[0]
    if g < 2 or m.shape[1] != g:
        raise ValueError(f"need a square matrix with at least 2 groups, got shape {m.shape}")
    return float(m[~np.eye(g, dtype=bool)].mean())


def random_subspace_reference(d: int, rho: int) -> float:
    """E[div] for two independent uniformly random rank-rho subspaces of R^d: 1 - rho/d.

    (E||V_a^T V_b||_F^2 = rho^2 / d.) The reference point for divergences between fixed experts,
    where there are no labels to shuffle.
    """
    if not 0 < rho <= d:
        raise ValueError(f"need 0 < rho <= d, got rho={rho}, d={d}")
    return 1.0 - rho / d


# --------------------------------------------------------------------------- subspaces


def top_subspace(x: np.ndarray, rho: int, *, center: bool = True) -> np.ndarray:
    """Top-rho right singular vectors float64[d, rho] of rows x [n, d] (mean-centred first).

    Raises RankDeficientError when the (centred) rows span fewer than rho directions.
    """
    chex.assert_rank(x, 2)
    x = np.asarray(x, np.float64)
    if center:
        x = x - x.mean(axis=0, keepdims=True)
    _, s, vt = np.linalg.svd(x, full_matrices=False)
    if len(s) < rho or s[0] <= 0 or s[rho - 1] <= _REL_TOL * s[0]:
        raise RankDeficientError(
            f"{x.shape[0]} rows span fewer than rho={rho} directions"
            + (" after mean-centring (need at least rho + 1 rows)" if center else ""))
    return vt[:rho].T


def lowrank_subspace(left: np.ndarray, right: np.ndarray, rho: int) -> np.ndarray:
    """Top-rho left singular vectors float64[d, rho] of the product left [d, r] @ right [r, m].

    Computed through a QR of ``left`` so the d x m product is never formed. Raises
    RankDeficientError when the product has rank < rho (e.g. an untrained LoRA with B = 0).
    """
    chex.assert_rank([left, right], 2)
    left, right = np.asarray(left, np.float64), np.asarray(right, np.float64)
    if left.shape[1] != right.shape[0]:
        raise ValueError(f"inner dimensions differ: {left.shape} @ {right.shape}")
    q, r = np.linalg.qr(left)
    u, s, _ = np.linalg.svd(r @ right, full_matrices=False)
    if len(s) < rho or s[0] <= 0 or s[rho - 1] <= _REL_TOL * s[0]:
        raise RankDeficientError(f"the update has rank < rho={rho}")
    return q @ u[:, :rho]


def _top_eigvecs(m: np.ndarray, rho: int) -> np.ndarray:
    """Top-rho eigenvectors [n, rho] of a symmetric PSD matrix m [n, n] (RankDeficientError if rank < rho)."""
    w, v = np.linalg.eigh(m)
    w, v = w[::-1], v[:, ::-1]
    if len(w) < rho or w[0] <= 0 or w[rho - 1] <= _REL_TOL**2 * w[0]:
        raise RankDeficientError(f"the group's updates span fewer than rho={rho} directions")
    return v[:, :rho]


# --------------------------------------------------------------------------- shuffle baseline


def _check_labels(labels: Sequence[Hashable], n: int) -> tuple[np.ndarray, list]:
    labels = np.asarray(labels, dtype=object)
    if labels.ndim != 1 or len(labels) != n:
        raise ValueError(f"labels: need one label per row ({n}), got shape {labels.shape}")
    groups = sorted(set(labels.tolist()), key=str)
    if len(groups) < 2:
        raise ValueError(f"labels: need at least 2 groups, got {groups}")
    return labels, groups


def shuffle_baseline(labels: Sequence[Hashable], group_subspaces: Callable[[np.ndarray], list[np.ndarray]], *,
                     trials: int = SHUFFLE_TRIALS, rng: np.random.Generator) -> np.ndarray:
    """Mean off-diagonal divergence under ``trials`` random label permutations -> float64[trials].

    Args:
      labels: one group label per row.
      group_subspaces: labels (object[N]) -> one orthonormal basis [d, rho] per group, in a fixed
        group order. A permutation keeps every group's size, as App. L.1 prescribes.
      rng: the only source of randomness (same generator state -> same baseline).
    """
    if not isinstance(trials, int) or trials < 1:
        raise ValueError(f"trials must be a positive int, got {trials!r}")
    labels = np.asarray(labels, dtype=object)
    out = np.empty(trials)
    for t in range(trials):
        perm = labels[rng.permutation(len(labels))]
        out[t] = mean_off_diagonal(divergence_matrix(group_subspaces(perm)))
    return out


def _summary(real: np.ndarray, shuffled: np.ndarray) -> dict:
    """real: [L, G, G]; shuffled: [L, T] -> per-layer real / shuffle / gap lists."""
    real_mean = np.array([mean_off_diagonal(m) for m in real])
    sh_mean, sh_std = shuffled.mean(axis=1), shuffled.std(axis=1)
    return {"real_matrix": real.tolist(), "real_mean": real_mean.tolist(), "shuffle_mean": sh_mean.tolist(),
            "shuffle_std": sh_std.tolist(), "gap": (real_mean - sh_mean).tolist(),
            "mean_real": float(real_mean.mean()), "mean_shuffle": float(sh_mean.mean()),
            "mean_gap": float((real_mean - sh_mean).mean())}


def activation_diagnostic(features: np.ndarray, labels: Sequence[Hashable], rho: int, *,
                          trials: int = SHUFFLE_TRIALS, seed: int = 0, layer_names: Sequence | None = None) -> dict:
    """App. L.1 on captured activations, per layer, with the shuffle baseline.

    Args:
      features: float[N, L, d] LoRA-input activations (last token) of N prompts at L layers.
      labels: one group label per prompt (a role, or a subtask cluster).
      rho: subspace rank (the LoRA rank, 8 in the paper).
      trials: shuffle trials T; seed: seeds the permutations (deterministic).
    Returns:
      {"groups", "sizes", "rho", "trials", "layers", "real_matrix" [L][G][G], "real_mean" [L],
       "shuffle_mean" [L], "shuffle_std" [L], "gap" [L], "mean_real", "mean_shuffle", "mean_gap"}.
    Raises RankDeficientError when a group has fewer than rho + 1 prompts (or spans fewer
    directions): its centred rank-rho subspace would be undefined.
    """
    chex.assert_rank(features, 3)
    feats = np.asarray(features, np.float64)
    n, n_layers, _ = feats.shape
    labels, groups = _check_labels(labels, n)
    sizes = {str(g): int(np.sum(labels == g)) for g in groups}
    small = {g: s for g, s in sizes.items() if s < rho + 1}
    if small:
        raise RankDeficientError(f"labels: groups {small} have fewer than rho + 1 = {rho + 1} prompts")
    rng = np.random.default_rng(seed)
    real, shuffled = [], []
    for layer in range(n_layers):
        x = feats[:, layer]

        def subspaces(lab, x=x):
            return [top_subspace(x[lab == g], rho) for g in groups]

        real.append(divergence_matrix(subspaces(labels)))
        shuffled.append(shuffle_baseline(labels, subspaces, trials=trials, rng=rng))
    out = {"groups": [str(g) for g in groups], "sizes": sizes, "rho": rho, "trials": trials,
           "layers": list(layer_names) if layer_names is not None else list(range(n_layers))}
    out.update(_summary(np.stack(real), np.stack(shuffled)))
    return out


# --------------------------------------------------------------------------- LoRA weight space


def _factors(bank: dict, target: str, side: str) -> tuple[np.ndarray, np.ndarray]:
    """(left [E, L, d, r], right [E, L, r, m]) with dW^T or dW = left @ right on the chosen side."""
    if target not in bank.get("a", {}) or target not in bank.get("b", {}):
        raise ValueError(f"target: the bank has no LoRA target {target!r}; it has {sorted(bank.get('a', {}))}")
    a, b = np.asarray(bank["a"][target], np.float64), np.asarray(bank["b"][target], np.float64)
    chex.assert_rank([a, b], 4)
    if a.shape[:2] != b.shape[:2] or a.shape[3] != b.shape[2]:
        raise ValueError(f"bank[{target!r}]: A {a.shape} and B {b.shape} do not pair as [E,L,d_in,r], [E,L,r,d_out]")
    if side == "input":  # dW = A B: left singular vectors live in d_in (what the adapter reads)
        return a, b
    if side == "output":  # dW^T = B^T A^T: left singular vectors live in d_out (what it writes)
        return np.swapaxes(b, 2, 3), np.swapaxes(a, 2, 3)
    raise ValueError(f"side must be 'input' or 'output', got {side!r}")


def expert_divergence(bank: dict, target: str, rho: int, *, experts: Sequence[int] | None = None,
                      side: str = "input") -> dict:
    """Pairwise rank-rho divergence between individual experts' updates, per adapted layer.

    Args:
      bank: {"a": {t: [E, L, d_in, r]}, "b": {t: [E, L, r, d_out]}} (``morse_jax.mole.experts``).
      target: projection name ("q", "v", "o", ...); rho <= r; experts: bank ids (default all).
      side: "input" (subspace in d_in, default) or "output" (in d_out).
    Returns:
      {"experts", "matrix" [L][n][n] (NaN where an expert's update has rank < rho, e.g. an
       untrained B = 0), "mean" [L] (mean off-diagonal, NaN if any pair is undefined),
       "undefined" [[layer, expert], ...], "random_reference" 1 - rho/d}.
    """
    left, right = _factors(bank, target, side)
    n_exp, n_layers, d, r = left.shape
    if not 0 < rho <= r:
        raise ValueError(f"rho must be in [1, {r}] (the LoRA rank), got {rho}")
    ids = list(range(n_exp)) if experts is None else [int(e) for e in experts]
    bad = [e for e in ids if not 0 <= e < n_exp]
    if bad or len(ids) < 2:
        raise ValueError(f"experts: need >= 2 ids in [0, {n_exp}), got {ids}")
    mats, undefined = [], []
    for layer in range(n_layers):
        subs = []
        for e in ids:
            try:
                subs.append(lowrank_subspace(left[e, layer], right[e, layer], rho))
            except RankDeficientError:
                subs.append(None)
                undefined.append([layer, e])
        m = np.full((len(ids), len(ids)), np.nan)
        ok = [i for i, s in enumerate(subs) if s is not None]
        if ok:
            sub_m = divergence_matrix([subs[i] for i in ok])
            m[np.ix_(ok, ok)] = sub_m
        np.fill_diagonal(m, 0.0)
        mats.append(m)
    mats = np.stack(mats)
    return {"experts": ids, "target": target, "side": side, "rho": rho, "matrix": mats.tolist(),
            "mean": [mean_off_diagonal(m) for m in mats], "undefined": undefined,
            "random_reference": random_subspace_reference(d, rho)}


def update_group_diagnostic(bank: dict, target: str, scale: float, active_sets: Sequence[Sequence[tuple[int, float]]],
                            labels: Sequence[Hashable], rho: int, *, trials: int = SHUFFLE_TRIALS, seed: int = 0,
                            side: str = "input") -> dict:
    """The App. L.1 pipeline (group subspaces + size-preserving shuffle) on composed LoRA updates.

    Call i (a routing record) applies dW_i = sum_{k in E_i} w_k * scale * A_k B_k at each layer.
    Group g's subspace is the top-rho eigenvectors of M_g = sum_{i in g} dW_i dW_i^T, i.e. the
    top-rho left singular vectors of the group's updates side by side. Unlike activations the
    updates are not mean-centred: a component shared by a whole group (its role expert, say) is
    the adaptation itself, not an offset to remove.

    Everything is computed exactly in the span Q of all experts' left factors (d x E*r), so
    d x d matrices are never formed: dW_i = Q (Q^T dW_i) and V_a^T V_b is the same in Q's
    coordinates. Only the few distinct active sets are composed; a shuffle only recounts them.

    Args:
      bank: expert bank pytree; target: projection name; scale: alpha / rank.
      active_sets: per call ((bank expert id, weight), ...); labels: per call group label.
    Returns:
      The dict of :func:`activation_diagnostic` (per adapted layer), plus "target" and "side".
      Raises RankDeficientError when some group's updates span fewer than rho directions
      (always so for an untrained bank, whose B = 0).
    """
    left, right = _factors(bank, target, side)
    n_exp, n_layers, _, r = left.shape
    if len(active_sets) != len(labels):
        raise ValueError(f"active_sets ({len(active_sets)}) and labels ({len(labels)}) must have equal length")
    labels, groups = _check_labels(labels, len(labels))
    keys = [tuple(sorted((int(e), float(w)) for e, w in s)) for s in active_sets]
    for i, k in enumerate(keys):
        if not k or any(not 0 <= e < n_exp for e, _ in k):
            raise ValueError(f"active_sets[{i}]: need a non-empty set of expert ids in [0, {n_exp}), got {k}")
    distinct = sorted(set(keys))
    set_index = np.array([distinct.index(k) for k in keys])
    rng = np.random.default_rng(seed)
    real, shuffled = [], []
    for layer in range(n_layers):
        q, _ = np.linalg.qr(np.concatenate(list(left[:, layer]), axis=1))  # [d, E*r]
        qa = np.einsum("dc,edr->ecr", q, left[:, layer])  # Q^T A_k: [E, E*r, r]
        grams = []
        for k in distinct:
            c = sum(w * scale * qa[e] @ right[e, layer] for e, w in k)  # Q^T dW_s: [E*r, m]
            grams.append(c @ c.T)
        grams = np.stack(grams)  # [S, E*r, E*r]

        def subspaces(lab, grams=grams):
            counts = np.stack([np.bincount(set_index[lab == g], minlength=len(distinct)) for g in groups])
            return [_top_eigvecs(np.tensordot(cnt, grams, axes=1), rho) for cnt in counts.astype(np.float64)]

        real.append(divergence_matrix(subspaces(labels)))
        shuffled.append(shuffle_baseline(labels, subspaces, trials=trials, rng=rng))
    out = {"groups": [str(g) for g in groups], "sizes": {str(g): int(np.sum(labels == g)) for g in groups},
           "rho": rho, "trials": trials, "layers": list(range(n_layers)), "target": target, "side": side}
    out.update(_summary(np.stack(real), np.stack(shuffled)))
    return out
