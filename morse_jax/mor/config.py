"""MoRConfig: the static description of a Mixture-of-Roles adapter (a jit static argument).

Defaults are the paper's (MoRAgent §4.2, Table 5) and the authors' released layer (see
``../shared/docs/moragent-reference.md`` §2): three roles, per role one shared LoRA plus 4 / 4 / 3
routed LoRAs of which the router keeps the top 3 / 3 / 2 per token, rank 16, all seven projections
of every layer, no α/r scaling, the shared LoRA always on (paper; the code's per-token sigmoid gate
is ``shared_gate="sigmoid"``).

The ablations of the paper's Tables 4-6 are settings of the same record:

* ``routing="uniform"``: no routers; a role's routed LoRAs are averaged with weight 1 / E_r each
  (every routed LoRA active: "uniform over the group"; top-k does not apply);
* ``use_balance=False`` / ``use_orth=False``: drop the balance / orthogonality loss;
* ``kind="lora"``: plain LoRA, ONE LoRA of rank ``rank`` on every token (roles and role-less
  tokens alike, as a standard PEFT LoRA fine-tune); :func:`morse_jax.mor.params.plain_lora_config`
  builds the one with MoR's trainable-parameter budget.
"""

from __future__ import annotations

import dataclasses

from morse_jax.models.adapters import LORA_TARGETS

KINDS = ("mor", "lora")
ROUTINGS = ("router", "uniform")
SHARED_GATES = ("always", "sigmoid")


@dataclasses.dataclass(frozen=True)
class MoRConfig:
    """Attributes:
      role_names: the roles, in role-id order (``morse_jax.tasks.trajectories.ROLE_NAMES``).
      routed: routed LoRAs per role (E_r); each role also has one shared LoRA.
      top_k: routed LoRAs kept per token per role (k_r <= E_r).
      rank: LoRA rank (also the plain LoRA's rank with ``kind="lora"``).
      targets: adapted projections (of q, k, v, o, gate, up, down).
      n_adapt: adapted layers, the last ``n_adapt`` (None: every layer).
      shared_gate: "always" (weight 1, paper) or "sigmoid" (σ(g_r·x) per token, released code).
      scale: factor on every delta (the code has none: 1.0; α/r-style scaling if wanted).
      routing: "router" (learned token routers) or "uniform" (ablation: no routers).
      kind: "mor" or "lora" (ablation: plain LoRA).
      use_balance / use_orth: include the balance / orthogonality loss in the objective.
    """

    role_names: tuple[str, ...] = ("reasoner", "executor", "summarizer")
    routed: tuple[int, ...] = (4, 4, 3)
    top_k: tuple[int, ...] = (3, 3, 2)
    rank: int = 16
    targets: tuple[str, ...] = LORA_TARGETS
    n_adapt: int | None = None
    shared_gate: str = "always"
    scale: float = 1.0
    routing: str = "router"
    kind: str = "mor"
    use_balance: bool = True
    use_orth: bool = True

    def __post_init__(self):
        for name in ("role_names", "routed", "top_k", "targets"):  # lists from configs -> hashable tuples
            value = getattr(self, name)
            if isinstance(value, str):
                raise ValueError(f"mor.{name} must be a sequence, got the string {value!r}")
            object.__setattr__(self, name, tuple(value))
        if self.kind not in KINDS:
            raise ValueError(f"mor.kind must be one of {KINDS}, got {self.kind!r}")
        if self.routing not in ROUTINGS:
            raise ValueError(f"mor.routing must be one of {ROUTINGS}, got {self.routing!r}")
        if self.shared_gate not in SHARED_GATES:
            raise ValueError(f"mor.shared_gate must be one of {SHARED_GATES}, got {self.shared_gate!r}")
        if not self.role_names or len(set(self.role_names)) != len(self.role_names):
            raise ValueError(f"mor.role_names must be distinct and non-empty, got {self.role_names}")
        if len(self.routed) != len(self.role_names) or len(self.top_k) != len(self.role_names):
            raise ValueError(f"mor: one routed count and one top_k per role ({len(self.role_names)} roles), got "
                             f"routed={self.routed}, top_k={self.top_k}")
        for r, (e, k) in enumerate(zip(self.routed, self.top_k)):
            if e < 0 or (e > 0 and not 1 <= k <= e):
                raise ValueError(f"mor: role {self.role_names[r]!r} has {e} routed LoRAs; top_k must be in "
                                 f"[1, {e}], got {k}")
        if self.rank <= 0:
            raise ValueError(f"mor.rank must be positive, got {self.rank}")
        bad = set(self.targets) - set(LORA_TARGETS)
        if bad or not self.targets or len(set(self.targets)) != len(self.targets):
            raise ValueError(f"mor.targets: unknown or repeated {self.targets}; choose from {LORA_TARGETS}")
        if self.n_adapt is not None and self.n_adapt <= 0:
            raise ValueError(f"mor.n_adapt must be positive or None, got {self.n_adapt}")

    @property
    def num_roles(self) -> int:
        return len(self.role_names)

    @property
    def has_router(self) -> bool:
        return self.kind == "mor" and self.routing == "router" and sum(self.routed) > 0

    @property
    def has_gate(self) -> bool:
        return self.kind == "mor" and self.shared_gate == "sigmoid"

    @property
    def num_loras(self) -> int:
        """N, the stacked LoRAs per projection: per role its shared LoRA then its routed ones
        (plain LoRA: 1)."""
        return 1 if self.kind == "lora" else sum(1 + e for e in self.routed)

    def lora_offset(self, role: int) -> int:
        """Index of role ``role``'s shared LoRA in the stacked axis; its routed LoRAs follow."""
        return sum(1 + e for e in self.routed[:role])

    def router_offset(self, role: int) -> int:
        """First router column (of sum(routed)) of role ``role``."""
        return sum(self.routed[:role])

    def adapted_layers(self, num_layers: int) -> int:
        n = num_layers if self.n_adapt is None else self.n_adapt
        if n > num_layers:
            raise ValueError(f"mor.n_adapt={n} exceeds the backbone's {num_layers} layers")
        return n
