"""From training examples (:mod:`morse_jax.rl.examples`) to padded, typed training batches.

Padding to bucketed shapes happens here so the jitted update compiles a bounded number of
times; the padded batches are typed pytrees
(:class:`SequenceBatch`, :class:`SharedBatch`, :class:`RouteBatch`), so a jitted function gets
one layout per type and shape, and code picks a path by the batch's type, never by its keys.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np
from flax import struct

from morse_jax.rl.examples import ROUTER_MAX_TOKENS, RouteExample, SequenceExample

# ------------------------------------------------------------------------------- padded batches
# Dimensions: R candidate rows, L positions, A active-set slots (max_active), C LM-head positions
# per row, d hidden size; P prompt rows, Lp / Lc prompt / completion positions; T description
# tokens, k route members. Leaves are numpy arrays from the pad_* functions (device arrays once
# they pass through jit); optional fields are None when the layout does not use them.


@struct.dataclass
class SequenceBatch:
    """Right-padded teacher-forcing batch (:func:`pad_sequences`): position t predicts token t+1.

    tokens int32[R, L], valid bool[R, L], targets int32[R, L], target_mask f32[R, L] (1 where token
    t+1 was generated), old_logp f32[R, L] (behaviour log-probs at those positions), advantages
    f32[R], expert_ids int32[R, A], expert_weights f32[R, A], expert_trainable bool[R, A];
    logit_index int32[R, C] (each row's generated positions, then repeats of its last one) and
    logit_mask f32[R, C] (1 on real entries), or None: LM head everywhere;
    states [R, L, d] (prefix states entering the first adapted layer) or None.
    """

    tokens: Any
    valid: Any
    targets: Any
    target_mask: Any
    old_logp: Any
    advantages: Any
    expert_ids: Any
    expert_weights: Any
    expert_trainable: Any
    logit_index: Any = None
    logit_mask: Any = None
    states: Any = None


@struct.dataclass
class SharedBatch:
    """Prompt-sharing batch (:func:`pad_shared`): each distinct (prompt, active set) is one prompt
    row, run once; each candidate row holds only its completion.

    prompt_tokens int32[P, Lp] (left-padded: every prompt ends at slot Lp-1), prompt_valid
    bool[P, Lp], prompt_expert_ids int32[P, A], prompt_expert_weights f32[P, A],
    prompt_expert_trainable bool[P, A]; per candidate: tokens int32[R, Lc] (its completion, also
    the targets), valid bool[R, Lc], prompt_row int32[R], target_mask f32[R, Lc], old_logp
    f32[R, Lc], advantages f32[R], expert_ids int32[R, A], expert_weights f32[R, A],
    expert_trainable bool[R, A]; prompt_states [P, Lp, d] and states [R, Lc, d], or both None.
    """

    prompt_tokens: Any
    prompt_valid: Any
    prompt_expert_ids: Any
    prompt_expert_weights: Any
    prompt_expert_trainable: Any
    tokens: Any
    valid: Any
    prompt_row: Any
    target_mask: Any
    old_logp: Any
    advantages: Any
    expert_ids: Any
    expert_weights: Any
    expert_trainable: Any
    prompt_states: Any = None
    states: Any = None


@struct.dataclass
class RouteBatch:
    """Router batch (:func:`pad_routes`): desc_ids int32[R, T], desc_mask bool[R, T], members
    int32[R, k], old_set_logp f32[R], advantages f32[R], row_mask f32[R] (1 on real routes)."""

    desc_ids: Any
    desc_mask: Any
    members: Any
    old_set_logp: Any
    advantages: Any
    row_mask: Any


def _bucket(n: int, buckets: Sequence[int]) -> int:
    for b in buckets:
        if n <= b:
            return b
    return int(np.ceil(n / buckets[-1]) * buckets[-1])


def sequence_shape(examples: Sequence[SequenceExample], *, length_buckets: Sequence[int],
                   completion_buckets: Sequence[int] | None = None) -> tuple[int, int | None]:
    """(L, C) of :func:`pad_sequences` for ``examples``: L the bucket of the longest prompt +
    completion, C (None without ``completion_buckets``) the bucket of the longest completion,
    at most L. The element-wise max over several example sets fits them all."""
    L = _bucket(max([len(e.prompt_ids) + len(e.completion_ids) for e in examples] + [1]), length_buckets)
    if completion_buckets is None:
        return L, None
    return L, min(L, _bucket(max([len(e.completion_ids) for e in examples] + [1]), completion_buckets))


def pad_sequences(examples: Sequence[SequenceExample], *, rows: int, length_buckets: Sequence[int],
                  max_active: int, scale: float = 1.0, completion_buckets: Sequence[int] | None = None,
                  with_states: bool = False, shape: tuple[int, int | None] | None = None) -> SequenceBatch:
    """Right-padded teacher-forcing batch (:class:`SequenceBatch`).

    Position t predicts token t+1; ``target_mask[n, t]`` is 1 where token t+1 was generated.
    Returns tokens int32[R, L], valid bool[R, L], targets int32[R, L], target_mask f32[R, L],
    old_logp f32[R, L], advantages f32[R] (times ``scale``), expert_ids int32[R, A],
    expert_weights f32[R, A], expert_trainable bool[R, A]. Rows beyond len(examples) are padding
    (zero advantage and mask).
    With ``completion_buckets`` also logit_index int32[R, C] (each row's generated positions,
    then repeats of its last one) and logit_mask f32[R, C] (1 on real entries), C the bucket of
    the longest completion, at most L: the LM head then runs at those positions only.
    With ``with_states``: states [R, L, d], every example's ``prefix_states`` (zeros at padding).
    ``shape``: (L, C) to pad to instead of the examples' own buckets (:func:`sequence_shape`; at
    least theirs), so that every micro-batch of an update has one shape: padding positions are
    masked, so the log-probs, loss and gradients are those of the examples' own shape.
    """
    if len(examples) > rows:
        raise ValueError(f"{len(examples)} examples do not fit in {rows} rows")
    own = sequence_shape(examples, length_buckets=length_buckets, completion_buckets=completion_buckets)
    L, C = own if shape is None else shape
    if L < own[0] or (own[1] is None) != (C is None) or (C is not None and C < own[1]):
        raise ValueError(f"shape {shape} does not fit these examples, which need {own}")
    out = {
        "tokens": np.zeros((rows, L), np.int32), "valid": np.zeros((rows, L), bool),
        "targets": np.zeros((rows, L), np.int32), "target_mask": np.zeros((rows, L), np.float32),
        "old_logp": np.zeros((rows, L), np.float32), "advantages": np.zeros(rows, np.float32),
        "expert_ids": np.zeros((rows, max_active), np.int32),
        "expert_weights": np.zeros((rows, max_active), np.float32),
        "expert_trainable": np.ones((rows, max_active), bool),
    }
    for i, e in enumerate(examples):
        p, c = list(e.prompt_ids), list(e.completion_ids)
        if len(e.behaviour_logprobs) != len(c):
            raise ValueError(f"example {i}: {len(e.behaviour_logprobs)} behaviour log-probs for {len(c)} tokens")
        seq = p + c
        n = len(seq)
        out["tokens"][i, :n] = seq
        out["valid"][i, :n] = True
        out["targets"][i, :n - 1] = seq[1:]
        out["target_mask"][i, len(p) - 1:n - 1] = 1.0
        out["old_logp"][i, len(p) - 1:n - 1] = e.behaviour_logprobs
        out["advantages"][i] = e.advantage * scale
        out["expert_ids"][i, :len(e.expert_ids)] = e.expert_ids
        out["expert_weights"][i, :len(e.expert_weights)] = e.expert_weights
        out["expert_trainable"][i] = _trainable_slots(e, max_active)
    if with_states:
        out["states"] = _stack_states(examples, rows, L, lambda e: (0, e.prefix_states))
    if C is not None:
        out["logit_index"] = np.zeros((rows, C), np.int32)
        out["logit_mask"] = np.zeros((rows, C), np.float32)
        for i, e in enumerate(examples):
            p, c = len(e.prompt_ids), len(e.completion_ids)
            out["logit_index"][i] = np.clip(np.arange(C) + p - 1, 0, max(p + c - 2, 0))
            out["logit_mask"][i, :c] = 1.0
    return SequenceBatch(**out)


def _trainable_slots(e: SequenceExample, max_active: int) -> np.ndarray:
    """bool[max_active]: e.expert_trainable padded with True (padding slots carry weight 0)."""
    out = np.ones(max_active, bool)
    if e.expert_trainable is not None:
        if len(e.expert_trainable) != len(e.expert_ids):
            raise ValueError(f"expert_trainable has {len(e.expert_trainable)} slots for {len(e.expert_ids)} experts")
        out[:len(e.expert_trainable)] = e.expert_trainable
    return out


def share_key(e: SequenceExample) -> tuple:
    """Candidates with equal keys (same prompt, same active set, same trained experts) have
    identical prompt activations and gradient paths in every layer, so :func:`pad_shared` runs
    their prompt once."""
    trainable = None if e.expert_trainable is None else tuple(bool(t) for t in e.expert_trainable)
    return (tuple(int(t) for t in e.prompt_ids), tuple(int(x) for x in e.expert_ids),
            tuple(float(w) for w in e.expert_weights), trainable)


def group_order(examples: Sequence[SequenceExample]) -> list[int]:
    """Indices of ``examples`` with equal :func:`share_key` made adjacent (groups in order of first
    appearance, stable within), so micro-batches cut from this order share prompts."""
    first: dict[tuple, int] = {}
    keys = [first.setdefault(share_key(e), len(first)) for e in examples]
    return sorted(range(len(examples)), key=lambda i: keys[i])


def shared_shape(examples: Sequence[SequenceExample], *, buckets: Sequence[int]) -> tuple[int, int, int]:
    """(P, Lp, Lc) of :func:`pad_shared` for ``examples``: P the power of two >= the number of
    distinct (prompt, active set) keys, Lp / Lc the buckets of the longest prompt / completion.
    The element-wise max over several example sets fits them all."""
    keys = {share_key(e) for e in examples}
    P = 1 << max(len(keys) - 1, 0).bit_length()
    Lp = _bucket(max([len(e.prompt_ids) for e in examples] + [1]), buckets)
    Lc = _bucket(max([len(e.completion_ids) for e in examples] + [1]), buckets)
    return P, Lp, Lc


def pad_shared(examples: Sequence[SequenceExample], *, rows: int, buckets: Sequence[int], max_active: int,
               scale: float = 1.0, with_states: bool = False,
               shape: tuple[int, int, int] | None = None) -> SharedBatch:
    """Prompt-sharing batch (:class:`SharedBatch`): each distinct (prompt, active set) is one prompt row, run once; every
    candidate row holds only its completion and attends to its prompt row's keys and values.

    In an HGRPO group all B*M candidates answer one prompt and the M of a route share its experts,
    so the prompt runs B times instead of B*M.
    Returns prompt_tokens int32[P, Lp] (left-padded, so every prompt ends at slot Lp-1),
    prompt_valid bool[P, Lp], prompt_expert_ids int32[P, A], prompt_expert_weights f32[P, A],
    prompt_expert_trainable bool[P, A];
    per candidate: tokens int32[R, Lc] (its completion, right-padded; also the targets, since
    completion token j is predicted at slot j), valid bool[R, Lc], prompt_row int32[R],
    target_mask f32[R, Lc], old_logp f32[R, Lc], advantages f32[R] (times ``scale``),
    expert_ids int32[R, A], expert_weights f32[R, A], expert_trainable bool[R, A]. P is the power of
    two >= the number of distinct prompts (at most ``rows``); Lp and Lc are ``buckets`` of the longest prompt and
    completion. Padding prompt rows repeat row 0; padding candidate rows have zero mask.
    With ``with_states``: prompt_states [P, Lp, d] (left-padded like the prompts) and states
    [R, Lc, d] (the completion positions), from the examples' ``prefix_states``.
    ``shape``: (P, Lp, Lc) to pad to instead of the examples' own (:func:`shared_shape`; at least
    theirs), so that every micro-batch of an update has one shape: padding prompt rows are read
    by no candidate, left-padding and right-padding positions are masked, so the log-probs, loss
    and gradients are those of the examples' own shape.
    """
    if len(examples) > rows:
        raise ValueError(f"{len(examples)} examples do not fit in {rows} rows")
    own = shared_shape(examples, buckets=buckets)
    P, Lp, Lc = own if shape is None else shape
    if any(a < b for a, b in zip((P, Lp, Lc), own)):
        raise ValueError(f"shape {shape} does not fit these examples, which need {own}")
    index: dict[tuple, int] = {}
    prompt_of = [index.setdefault(share_key(e), len(index)) for e in examples]
    uniq = [None] * len(index)
    for e, j in zip(examples, prompt_of):
        uniq[j] = uniq[j] or e
    out = {
        "prompt_tokens": np.zeros((P, Lp), np.int32), "prompt_valid": np.zeros((P, Lp), bool),
        "prompt_expert_ids": np.zeros((P, max_active), np.int32),
        "prompt_expert_weights": np.zeros((P, max_active), np.float32),
        "prompt_expert_trainable": np.ones((P, max_active), bool),
        "tokens": np.zeros((rows, Lc), np.int32), "valid": np.zeros((rows, Lc), bool),
        "prompt_row": np.zeros(rows, np.int32), "target_mask": np.zeros((rows, Lc), np.float32),
        "old_logp": np.zeros((rows, Lc), np.float32), "advantages": np.zeros(rows, np.float32),
        "expert_ids": np.zeros((rows, max_active), np.int32),
        "expert_weights": np.zeros((rows, max_active), np.float32),
        "expert_trainable": np.ones((rows, max_active), bool),
    }
    for j, e in enumerate(uniq):
        p = list(e.prompt_ids)
        if not p:
            raise ValueError(f"prompt {j} is empty: the first completion token needs a prompt position")
        out["prompt_tokens"][j, Lp - len(p):] = p
        out["prompt_valid"][j, Lp - len(p):] = True
        out["prompt_expert_ids"][j, :len(e.expert_ids)] = e.expert_ids
        out["prompt_expert_weights"][j, :len(e.expert_weights)] = e.expert_weights
        out["prompt_expert_trainable"][j] = _trainable_slots(e, max_active)
    for j in range(len(uniq), P):
        for k in ("prompt_tokens", "prompt_valid", "prompt_expert_ids", "prompt_expert_weights",
                  "prompt_expert_trainable"):
            out[k][j] = out[k][0]
    for i, (e, j) in enumerate(zip(examples, prompt_of)):
        c = list(e.completion_ids)
        if len(e.behaviour_logprobs) != len(c):
            raise ValueError(f"example {i}: {len(e.behaviour_logprobs)} behaviour log-probs for {len(c)} tokens")
        out["tokens"][i, :len(c)] = c
        out["valid"][i, :len(c)] = True
        out["prompt_row"][i] = j
        out["target_mask"][i, :len(c)] = 1.0
        out["old_logp"][i, :len(c)] = e.behaviour_logprobs
        out["advantages"][i] = e.advantage * scale
        out["expert_ids"][i] = out["prompt_expert_ids"][j]
        out["expert_weights"][i] = out["prompt_expert_weights"][j]
        out["expert_trainable"][i] = out["prompt_expert_trainable"][j]
    if with_states:
        ps = _stack_states(uniq, P, Lp, lambda e: (Lp - len(e.prompt_ids), e.prefix_states[:len(e.prompt_ids)]))
        ps[len(uniq):] = ps[0]
        out["prompt_states"] = ps
        out["states"] = _stack_states(examples, rows, Lc, lambda e: (0, e.prefix_states[len(e.prompt_ids):]))
    return SharedBatch(**out)


def _stack_states(examples: Sequence[SequenceExample], rows: int, length: int, part) -> np.ndarray:
    """[rows, length, d] with ``part(e) = (start, states)`` of each example placed at ``start``."""
    for i, e in enumerate(examples):
        n = len(e.prompt_ids) + len(e.completion_ids)
        st = e.prefix_states
        if st is None or np.ndim(st) != 2 or len(st) != n:
            raise ValueError(f"example {i}: prefix_states must be [{n}, d] (prompt + completion positions), "
                             f"got {None if st is None else np.shape(st)}")
    first = np.asarray(examples[0].prefix_states)
    out = np.zeros((rows, length, first.shape[1]), first.dtype)
    for i, e in enumerate(examples):
        start, st = part(e)
        out[i, start:start + len(st)] = st
    return out


def pad_routes(examples: Sequence[RouteExample], *, rows: int, k: int, scale: float = 1.0,
               max_tokens: int = ROUTER_MAX_TOKENS) -> RouteBatch:
    """Router batch (:class:`RouteBatch`): desc_ids int32[R, T], desc_mask bool[R, T], members int32[R, k],
    old_set_logp f32[R], advantages f32[R], row_mask f32[R]."""
    out = {
        "desc_ids": np.zeros((rows, max_tokens), np.int32), "desc_mask": np.zeros((rows, max_tokens), bool),
        "members": np.tile(np.arange(k, dtype=np.int32), (rows, 1)), "old_set_logp": np.zeros(rows, np.float32),
        "advantages": np.zeros(rows, np.float32), "row_mask": np.zeros(rows, np.float32),
    }
    for i, e in enumerate(examples):
        if len(e.members) != k:
            raise ValueError(f"route example {i} has {len(e.members)} members, expected k={k}")
        d = list(e.description_ids)[:max_tokens]
        out["desc_ids"][i, :len(d)] = d
        out["desc_mask"][i, :len(d)] = True
        out["members"][i] = e.members
        out["old_set_logp"][i] = e.behaviour_set_logp
        out["advantages"][i] = e.advantage * scale
        out["row_mask"][i] = 1.0
    return RouteBatch(**out)
