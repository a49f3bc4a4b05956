"""From rollout groups to training examples: advantages per group, one example per candidate / route.

A rollout group is one node's (route b, candidate m) samples with rewards u[b, m] (see
``morse_jax.tomas.trace.RolloutGroup``). Advantages are computed per group on the host
(``hgrpo`` or ``grpo``, :mod:`morse_jax.rl.hgrpo`), then every candidate becomes a
:class:`SequenceExample` (LoRA loss) and every sampled route a :class:`RouteExample` (router
loss). :mod:`morse_jax.rl.batch` pads them into typed batches.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import numpy as np

from morse_jax.rl.hgrpo import check_rewards, get_advantage_fn

ROUTER_MAX_TOKENS = 64


@dataclasses.dataclass(frozen=True)
class SequenceExample:
    """One candidate: prompt + completion under its route's expert set, with its advantage."""

    prompt_ids: Sequence[int]
    completion_ids: Sequence[int]
    behaviour_logprobs: np.ndarray  # float32[len(completion_ids)]
    expert_ids: Sequence[int]
    expert_weights: Sequence[float]
    advantage: float
    # the sampler's residual stream entering the first adapted layer at every prompt and
    # completion position, [len(prompt_ids) + len(completion_ids), d], or None (recompute it)
    prefix_states: np.ndarray | None = None
    # per slot of expert_ids: does this example's loss train that expert? None = every slot.
    # A merge call's inherited subtask experts act in its forward pass but are not trained by it
    # (Alg. 1: "Merger nodes ... only update the merge role expert").
    expert_trainable: Sequence[bool] | None = None


@dataclasses.dataclass(frozen=True)
class RouteExample:
    """One sampled route: the subtask description tokens, the set drawn and its advantage."""

    description_ids: Sequence[int]
    members: Sequence[int]  # router expert indices, len k
    behaviour_set_logp: float
    advantage: float


@dataclasses.dataclass(frozen=True)
class GroupStats:
    reward_mean: float
    reward_std: float
    groups: int
    skipped_within: float  # fraction of routes whose within-group std was below min_std
    skipped_cross: float  # fraction of groups (with >1 route) whose cross std was below min_std


def encode_descriptions(tokenizer: Any, descriptions: Sequence[str], max_tokens: int = ROUTER_MAX_TOKENS):
    """Router input: the first ``max_tokens`` tokens of each description (no special tokens).

    Returns (ids int32[N, max_tokens], mask bool[N, max_tokens]); right-padded.
    """
    ids = np.zeros((len(descriptions), max_tokens), np.int32)
    mask = np.zeros((len(descriptions), max_tokens), bool)
    for i, d in enumerate(descriptions):
        toks = tokenizer(d, add_special_tokens=False)["input_ids"][:max_tokens] if tokenizer is not None else []
        ids[i, :len(toks)] = toks
        mask[i, :len(toks)] = True
    return ids, mask


def examples_from_groups(groups: Sequence[Any], *, advantage: str = "hgrpo", description_ids=None,
                         eps: float = 1e-6, clip: float = 5.0, min_std: float = 5e-4,
                         num_roles: int | None = None, merge_trains_subtask_experts: bool = False):
    """Advantages per group, then flattened examples.

    Args:
      groups: objects with ``rewards`` float[B, M], ``candidates`` [B][M] (each with prompt_ids,
        token_ids, logprobs, expert_ids, expert_weights), ``routes`` (B tuples, empty when the
        group has no router decision), ``route_set_logp_old`` float[B], ``description`` and
        optionally ``role`` ("execute" when absent).
      advantage: "hgrpo" or "grpo" (flat: one credit group over all B*M candidates).
      description_ids: callable description -> token ids (router input), needed when routes exist.
      num_roles: bank expert ids below this are role experts (``ExpertBankSpec.num_roles``);
        required when a group has role "merge".
      merge_trains_subtask_experts: False (Alg. 1): a merge candidate trains only its role
        expert, the inherited subtask experts are used but get no gradient from it. True: every
        active expert (the authors' code, whose merge loss back-propagates into all of them).
    Returns:
      (list[SequenceExample], list[RouteExample], GroupStats). Every sampled route becomes a
      RouteExample carrying its A_cross, zero included: the router's regularisers act on every
      route's distribution whatever its advantage.
    """
    fn = get_advantage_fn(advantage)
    seqs, routes = [], []
    all_rewards, skipped_w, n_routes, skipped_c, n_cross = [], 0, 0, 0, 0
    for g in groups:
        rewards = np.asarray(g.rewards, np.float32)
        check_rewards(rewards, name=f"rewards of group {getattr(g, 'node_id', '?')}", min_ndim=2)
        adv = fn(rewards, eps=eps, clip=clip, min_std=min_std)
        within, cross = np.asarray(adv.within), np.asarray(adv.cross)
        all_rewards.append(rewards.ravel())
        skipped_w += int((~np.asarray(adv.within_valid)).sum())
        n_routes += rewards.shape[0]
        if rewards.shape[0] > 1:
            n_cross += 1
            skipped_c += int(not bool(adv.cross_valid))
        frozen_inherited = getattr(g, "role", "execute") == "merge" and not merge_trains_subtask_experts
        if frozen_inherited and num_roles is None:
            raise ValueError("examples_from_groups: num_roles is required for merge groups")
        for b, row in enumerate(g.candidates):
            for m, c in enumerate(row):
                if within[b, m] == 0.0:
                    continue  # no gradient signal; skip the compute
                trainable = tuple(int(e) < num_roles for e in c.expert_ids) if frozen_inherited else None
                seqs.append(SequenceExample(list(c.prompt_ids), list(c.token_ids),
                                            np.asarray(c.logprobs, np.float32), list(c.expert_ids),
                                            list(c.expert_weights), float(within[b, m]),
                                            getattr(c, "prefix_states", None), trainable))
        if getattr(g, "routes", None) and len(g.routes) == rewards.shape[0] and g.routes[0]:
            if description_ids is None:
                raise ValueError("examples_from_groups: description_ids is required for groups with routes")
            desc = description_ids(g.description)
            for b, members in enumerate(g.routes):
                routes.append(RouteExample(desc, tuple(int(x) for x in members),
                                           float(g.route_set_logp_old[b]), float(cross[b])))
    flat = np.concatenate(all_rewards) if all_rewards else np.zeros(0, np.float32)
    stats = GroupStats(
        reward_mean=float(flat.mean()) if flat.size else 0.0,
        reward_std=float(flat.std()) if flat.size else 0.0,
        groups=len(groups),
        skipped_within=skipped_w / max(n_routes, 1),
        skipped_cross=skipped_c / max(n_cross, 1),
    )
    return seqs, routes, stats
