"""The expert bank: stacked LoRA experts on the last ``n_adapt`` blocks, composed per row.

Expert ids: role experts first (``0 .. num_roles-1``, in ``role_names`` order), then the subtask
experts (``num_roles .. num_roles+num_subtask-1``). Router expert k is bank expert
``num_roles + k``.

Bank params (the trainable pytree)::

    {"a": {target: [E, L_adapt, d_in, rank]}, "b": {target: [E, L_adapt, rank, d_out]}}

Every row of a batch carries its own active set (``expert_ids: int32[B, max_active]``,
``expert_weights: float[B, max_active]``, weight 0 = padding). The delta added to a target
projection for row b is  sum_k w_bk * (alpha / rank) * (x A_k) B_k.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Sequence

import chex
import jax
import jax.numpy as jnp
import numpy as np

from morse_jax.models.config import ModelConfig
from morse_jax.models.transformer import LoraInputs

# Our projection names -> transformers module paths (for PEFT export).
HF_MODULES = {
    "q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj", "o": "self_attn.o_proj",
    "gate": "mlp.gate_proj", "up": "mlp.up_proj", "down": "mlp.down_proj",
}
COMPOSE_MODES = ("gather", "onehot")


@dataclasses.dataclass(frozen=True)
class ExpertBankSpec:
    """Static description of an expert bank (hashable: a jit static argument).

    Defaults follow the paper (App. E): roles execute and merge, 4 subtask experts, rank 8,
    alpha 16, q/v/o on the last 8 blocks. Ablations B / B++ are one always-active expert of
    rank 24 / 48 (``role_names=("single",)``, ``num_subtask=0``).
    """

    role_names: tuple[str, ...] = ("execute", "merge")
    num_subtask: int = 4
    rank: int = 8
    alpha: float = 16.0
    n_adapt: int = 8
    targets: tuple[str, ...] = ("q", "v", "o")
    compose: str = "gather"

    def __post_init__(self):
        # Configs (ml_collections, JSON) hand over lists; a list field would make the spec
        # unhashable, and it is a jit static argument. A bare string would be split into letters.
        for name in ("role_names", "targets"):
            value = getattr(self, name)
            if isinstance(value, str):
                raise ValueError(f"mole.{name} must be a sequence of names, got the string {value!r}")
            object.__setattr__(self, name, tuple(value))
            if len(set(getattr(self, name))) != len(getattr(self, name)):
                raise ValueError(f"mole.{name} has duplicates: {getattr(self, name)}")
        if not self.alpha > 0:
            raise ValueError(f"mole.alpha must be positive, got {self.alpha}")
        if self.rank <= 0:
            raise ValueError(f"mole.rank must be positive, got {self.rank}")
        if self.n_adapt <= 0:
            raise ValueError(f"mole.n_adapt must be positive, got {self.n_adapt}")
        if self.num_subtask < 0 or self.num_experts <= 0:
            raise ValueError("mole: need at least one expert (role_names / num_subtask)")
        bad = set(self.targets) - set(HF_MODULES)
        if bad or not self.targets:
            raise ValueError(f"mole.targets: unknown {sorted(bad)}; choose from {sorted(HF_MODULES)}")
        if self.compose not in COMPOSE_MODES:
            raise ValueError(f"mole.compose must be one of {COMPOSE_MODES}, got {self.compose!r}")

    @property
    def num_roles(self) -> int:
        return len(self.role_names)

    @property
    def num_experts(self) -> int:
        return self.num_roles + self.num_subtask

    @property
    def max_active(self) -> int:
        """Expert slots one call can need: its role expert plus, at a union merge, every subtask
        expert (the ``max_active`` of the sampler's and the update's batches)."""
        return 1 + self.num_subtask

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank

    def role_id(self, role: str) -> int:
        if role not in self.role_names:
            raise ValueError(f"unknown role {role!r}; bank roles are {self.role_names}")
        return self.role_names.index(role)

    def subtask_id(self, k: int) -> int:
        if not 0 <= k < self.num_subtask:
            raise ValueError(f"subtask expert {k} out of range [0, {self.num_subtask})")
        return self.num_roles + k


def target_dims(cfg: ModelConfig, target: str) -> tuple[int, int]:
    """(d_in, d_out) of a target projection: the widest over all layers (Gemma 4's layers differ;
    narrower layers use the leading rows/columns of the factors)."""
    return cfg.target_dims(target)


def init_expert_bank(key: jax.Array, cfg: ModelConfig, spec: ExpertBankSpec, dtype=jnp.float32) -> dict:
    """A ~ U(-1/sqrt(d_in), 1/sqrt(d_in)) (PEFT's default), B = 0: an untrained bank is a no-op."""
    if spec.n_adapt > cfg.num_layers:
        raise ValueError(f"mole.n_adapt={spec.n_adapt} exceeds the backbone's {cfg.num_layers} layers")
    bank = {"a": {}, "b": {}}
    keys = jax.random.split(key, len(spec.targets))
    for k, t in zip(keys, spec.targets):
        d_in, d_out = target_dims(cfg, t)
        bound = 1.0 / math.sqrt(d_in)
        bank["a"][t] = jax.random.uniform(k, (spec.num_experts, spec.n_adapt, d_in, spec.rank), dtype, -bound, bound)
        bank["b"][t] = jnp.zeros((spec.num_experts, spec.n_adapt, spec.rank, d_out), dtype)
    return bank


def gather_lora(bank: dict, spec: ExpertBankSpec, expert_ids: jax.Array, expert_weights: jax.Array,
                trainable: jax.Array | None = None) -> LoraInputs:
    """Per-row LoRA inputs for ``models.forward``.

    Args:
      expert_ids: int32[B, max_active]; expert_weights: float[B, max_active] (0 = padding slot).
      trainable: bool[B, max_active] or None (all slots). A False slot's expert acts in the
        forward pass exactly as a True one but gets no gradient from that row (a merge call's
        inherited subtask experts, Alg. 1). With compose="onehot" the bank is shared by all rows,
        so each expert appears twice: once live for the rows that train it, once behind
        ``stop_gradient`` for the rows that only use it (2E experts in the delta).
    Returns:
      LoraInputs. compose="gather": a[t] [L, B, max_active, d_in, r] (each row's experts gathered);
      compose="onehot": a[t] [L, E, d_in, r] with scale [B, E] (all experts, weights scattered) —
      cheaper when E is small relative to the batch. Both give identical deltas.

    An id outside [0, num_experts) is treated as a padding slot in both modes (ids are traced, so
    they cannot raise here; ``pad_active`` rejects them on the host). Without this, indexing
    would wrap negative ids and clamp large ones to real experts while one_hot drops them.
    """
    chex.assert_rank([expert_ids, expert_weights], 2)
    chex.assert_equal_shape([expert_ids, expert_weights])
    if trainable is not None:
        chex.assert_equal_shape([expert_ids, trainable])
    in_range = (expert_ids >= 0) & (expert_ids < spec.num_experts)
    expert_ids = jnp.where(in_range, expert_ids, 0)
    w = jnp.where(in_range, expert_weights.astype(jnp.float32), 0.0) * spec.scaling
    if spec.compose == "onehot":
        onehot = jax.nn.one_hot(expert_ids, spec.num_experts, dtype=jnp.float32)  # [B, K, E]
        a = {t: jnp.swapaxes(x, 0, 1) for t, x in bank["a"].items()}  # [L, E, d_in, r]
        b = {t: jnp.swapaxes(x, 0, 1) for t, x in bank["b"].items()}
        if trainable is None:
            return LoraInputs(a=a, b=b, scale=jnp.einsum("bk,bke->be", w, onehot))
        live = trainable.astype(jnp.float32)
        scale = jnp.concatenate([jnp.einsum("bk,bke->be", w * live, onehot),
                                 jnp.einsum("bk,bke->be", w * (1.0 - live), onehot)], axis=-1)  # [B, 2E]
        both = lambda x: jnp.concatenate([x, jax.lax.stop_gradient(x)], axis=1)  # noqa: E731
        return LoraInputs(a=jax.tree.map(both, a), b=jax.tree.map(both, b), scale=scale)
    a = {t: jnp.moveaxis(x[expert_ids], 2, 0) for t, x in bank["a"].items()}  # [L, B, K, d_in, r]
    b = {t: jnp.moveaxis(x[expert_ids], 2, 0) for t, x in bank["b"].items()}
    if trainable is not None:
        keep = trainable[None, :, :, None, None]  # broadcast over [L, B, K, d, r]
        a = jax.tree.map(lambda x: jnp.where(keep, x, jax.lax.stop_gradient(x)), a)
        b = jax.tree.map(lambda x: jnp.where(keep, x, jax.lax.stop_gradient(x)), b)
    return LoraInputs(a=a, b=b, scale=w)


# --------------------------------------------------------------------------- active sets


def pad_active(sets: Sequence[Sequence[tuple[int, float]]], max_active: int, *,
               num_experts: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Pack per-row [(expert_id, weight), ...] into (int32[B, max_active], float32[B, max_active]).

    Rejects negative ids, ids >= ``num_experts`` (when given) and non-finite weights.
    """
    if max_active <= 0:
        raise ValueError(f"max_active must be positive, got {max_active}")
    ids = np.zeros((len(sets), max_active), np.int32)
    weights = np.zeros((len(sets), max_active), np.float32)
    for r, row in enumerate(sets):
        if len(row) > max_active:
            raise ValueError(f"row {r} has {len(row)} active experts, more than max_active={max_active}")
        for j, (e, w) in enumerate(row):
            if e < 0 or (num_experts is not None and e >= num_experts):
                raise ValueError(f"row {r}: expert id {e} out of range [0, {num_experts or 'num_experts'})")
            if not math.isfinite(w):
                raise ValueError(f"row {r}: expert {e} has non-finite weight {w}")
            ids[r, j], weights[r, j] = e, w
    return ids, weights


def execute_set(spec: ExpertBankSpec, subtask_experts: Sequence[int], role: str = "execute") -> list[tuple[int, float]]:
    """E_i = {role expert} ∪ routed subtask experts, uniform weights 1/|E_i|.

    ``subtask_experts`` are router indices in [0, num_subtask).
    """
    members = [spec.role_id(role)] + [spec.subtask_id(int(k)) for k in subtask_experts]
    if len(set(members)) != len(members):
        raise ValueError(f"duplicate experts in active set {members}")
    return [(m, 1.0 / len(members)) for m in members]


def merge_set(spec: ExpertBankSpec, parent_subtask_experts: Sequence[Sequence[int]], *, mode: str = "union",
              rng: np.random.Generator | None = None) -> list[tuple[int, float]]:
    """Merge-role active set at a join node: the merge expert + the union of the parents' subtask
    experts (``mode="union"``, the paper), or a random non-empty subset of 1-2 of them
    (``mode="random_subset"``, the authors' training code)."""
    union = sorted({int(k) for ks in parent_subtask_experts for k in ks})
    if mode == "random_subset" and union:
        rng = rng or np.random.default_rng()
        n = int(rng.integers(1, min(2, len(union)) + 1))
        union = sorted(rng.choice(union, size=n, replace=False).tolist())
    elif mode != "union" and mode != "random_subset":
        raise ValueError(f"merge mode must be 'union' or 'random_subset', got {mode!r}")
    return execute_set(spec, union, role="merge")


def single_set(spec: ExpertBankSpec) -> list[tuple[int, float]]:
    """The always-active expert of ablations B / B++ (one expert, weight 1)."""
    if spec.num_experts != 1:
        raise ValueError("single_set needs a bank with exactly one expert")
    return [(0, 1.0)]


# --------------------------------------------------------------------------- PEFT export


def export_peft(bank: dict, spec: ExpertBankSpec, cfg: ModelConfig, expert: int, directory: str | Path, *,
                base_model_name_or_path: str = "") -> Path:
    """Write one expert as an HF-PEFT LoRA adapter (adapter_config.json + adapter_model.safetensors).

    The adapter reproduces our forward with only that expert active at weight 1
    (PEFT scales by lora_alpha / r, as we do). Factors are cut to each layer's projection (banks
    are sized for the widest layer, see ``ModelConfig.target_dims``), and projections a layer does
    not use are left out (Gemma 4: no v on k = v layers, no k / v on KV-shared layers).
    """
    from morse_jax.models.transformer import layer_shapes

    from safetensors.numpy import save_file

    if not 0 <= expert < spec.num_experts:
        raise ValueError(f"expert {expert} out of range [0, {spec.num_experts})")
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    first = cfg.num_layers - spec.n_adapt
    tensors = {}
    for t in spec.targets:
        a = np.asarray(bank["a"][t][expert], np.float32)  # [L, d_in, r]
        b = np.asarray(bank["b"][t][expert], np.float32)  # [L, r, d_out]
        for l in range(spec.n_adapt):
            shapes = layer_shapes(cfg, first + l)
            if t not in shapes:
                continue
            d_in, d_out = shapes[t]["kernel"]
            base = f"base_model.model.model.layers.{first + l}.{HF_MODULES[t]}"
            tensors[f"{base}.lora_A.weight"] = np.ascontiguousarray(a[l, :d_in].T)  # [r, d_in]
            tensors[f"{base}.lora_B.weight"] = np.ascontiguousarray(b[l, :, :d_out].T)  # [d_out, r]
    save_file(tensors, str(out / "adapter_model.safetensors"))
    config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": spec.rank, "lora_alpha": spec.alpha,
        "lora_dropout": 0.0, "bias": "none", "fan_in_fan_out": False, "use_rslora": False,
        "target_modules": sorted(HF_MODULES[t].split(".")[-1] for t in spec.targets),
        "layers_to_transform": list(range(first, cfg.num_layers)),
        "base_model_name_or_path": base_model_name_or_path, "inference_mode": True,
    }
    (out / "adapter_config.json").write_text(json.dumps(config, indent=2))
    return out


def expert_name(spec: ExpertBankSpec, expert: int) -> str:
    if expert < spec.num_roles:
        return f"role_{spec.role_names[expert]}"
    return f"subtask_{expert - spec.num_roles}"


def export_all(bank: dict, spec: ExpertBankSpec, cfg: ModelConfig, directory: str | Path, **kw) -> list[Path]:
    """Every expert as its own PEFT adapter under ``directory/<expert name>``."""
    return [export_peft(bank, spec, cfg, e, Path(directory) / expert_name(spec, e), **kw)
            for e in range(spec.num_experts)]
