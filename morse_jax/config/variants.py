"""The ablation variants: one ``Variant`` record per row of the paper's tables.

A variant says what goes on the backbone (``orchestration``: the orchestrator's adapter mode),
how rewards are credited (``advantage``: a name of ``rl.hgrpo``'s advantage functions), whether
the paper's row trains, and the settings its row fixes (single-agent, single-LoRA rank). The
settings are fields of their own in the config (``mode``, ``rollout.single_agent``,
``mole.single_rank``): ``apply_variant`` writes a row's values into a config, and the config is
what a run reads (``--config configs/qwen3_4b_srdd.py:B``).
"""

from __future__ import annotations

import dataclasses

import ml_collections


@dataclasses.dataclass(frozen=True)
class Variant:
    """What an ablation row puts on the backbone, how it credits rewards, and what its row sets."""

    orchestration: str  # mole | flat_mole | single_lora | none (the orchestrator's adapter modes)
    advantage: str  # hgrpo | grpo (rl.hgrpo)
    what: str  # one line for describe / the README
    trains: bool = True  # the paper's row trains its adapters (False: the row only evaluates, mode=eval)
    single_agent: bool = False  # the paper's row has no DAG: one node per task (rollout.single_agent)
    single_rank: int | None = None  # the row's rank of the single LoRA (mole.single_rank), if it fixes one

    @property
    def has_adapters(self) -> bool:
        return self.orchestration != "none"

    def overlay(self, name: str) -> dict:
        """The config fields (dotted) the paper's row ``name`` sets."""
        out: dict = {"variant": name}
        if not self.trains:
            out["mode"] = "eval"
        if self.single_rank is not None:
            out["mole.single_rank"] = self.single_rank
        if self.single_agent:
            out["rollout.single_agent"] = True
        return out


VARIANTS = {
    "A": Variant("mole", "hgrpo", "MoRSE framework with untrained MoLE (Table 2 row A)", trains=False),
    "B": Variant("single_lora", "grpo", "one fixed LoRA of rank mole.single_rank, flat GRPO (Table 2 row B)",
                 single_rank=24),
    "B++": Variant("single_lora", "grpo", "one fixed LoRA of rank mole.single_rank (48: total params matched)",
                   single_rank=48),
    "C": Variant("flat_mole", "grpo", "MoLE + flat GRPO, every candidate its own route (Table 2 row C)"),
    "D": Variant("mole", "hgrpo", "MoLE + HGRPO: MoRSE (Table 2 row D)"),
    "single_agent": Variant("none", "grpo", "the backbone alone, one call per task (Table 1 single agent)",
                            trains=False, single_agent=True),
    "single_agent_rl": Variant("single_lora", "grpo", "one LoRA, one call per task, GRPO (Table 4 row 2)",
                               single_agent=True, single_rank=24),
    "base": Variant("none", "grpo", "the backbone alone on the DAG, no adapters", trains=False),
}

# The dotted config fields each row sets (Table 2 / Table 4), derived from its record.
VARIANT_OVERLAYS = {name: v.overlay(name) for name, v in VARIANTS.items()}


def variant_of(cfg) -> Variant:
    return VARIANTS[cfg.variant]


def trains(cfg) -> bool:
    """Whether this run updates adapters: mode=train and a variant with adapters."""
    return cfg.mode == "train" and variant_of(cfg).has_adapters


def apply_variant(c: ml_collections.ConfigDict, name: str) -> ml_collections.ConfigDict:
    """Apply the overlay of ablation variant ``name`` (a key of VARIANTS) to ``c`` in place."""
    if name not in VARIANTS:
        raise ValueError(f"config variant: unknown {name!r}; choose one of {sorted(VARIANT_OVERLAYS)}")
    return _write_overlay(c, VARIANTS[name].overlay(name))


def _write_overlay(c: ml_collections.ConfigDict, overlay: dict) -> ml_collections.ConfigDict:
    for dotted, value in overlay.items():
        node = c
        *groups, field = dotted.split(".")
        for g in groups:
            node = node[g]
        node[field] = value
    return c


def variant_dir(name: str) -> str:
    """A file-system-friendly name for a variant ("B++" -> "Bpp")."""
    return name.replace("+", "p")


# --------------------------------------------------------------------------- MoRAgent (config.system="moragent")


@dataclasses.dataclass(frozen=True)
class AgentVariant:
    """A MoRAgent row (the paper's Tables 2, 4 and 6): what adapter sits on the backbone, how an
    item is answered, and the objective settings the row fixes.

    adapter: none | lora (one plain LoRA with MoR's trainable budget) | mor (role groups).
    protocol: direct (BFCL's own prompt, one call) | roles (the role loop, ``run.role_loop``).
    sets: the config fields (dotted, under ``moragent``) the row writes.
    """

    adapter: str
    protocol: str
    what: str
    sets: tuple[tuple[str, object], ...] = ()

    @property
    def trains(self) -> bool:
        return self.adapter != "none"

    def overlay(self, name: str) -> dict:
        out: dict = {"variant": name, **dict(self.sets)}
        if not self.trains:
            out["mode"] = "eval"
        return out


AGENT_VARIANTS = {
    "base": AgentVariant("none", "direct", "the backbone alone with BFCL's prompting-mode prompt (Table 2/6 Base)"),
    "lora": AgentVariant("lora", "roles", "one plain LoRA with MoR's trainable-parameter budget, same data and "
                         "role loop (Table 6 LoRA)"),
    "mor": AgentVariant("mor", "roles", "MoR: role groups with token routers, balance + orthogonality losses "
                        "(Table 2 MoRAgent)"),
    "mor_no_router": AgentVariant("mor", "roles", "MoR without routers: uniform weights over each group's LoRAs",
                                  sets=(("moragent.routers", False),)),
    "mor_no_balance": AgentVariant("mor", "roles", "MoR without the balance loss (Table 4, alpha1 = 0)",
                                   sets=(("moragent.balance_weight", 0.0),)),
    "mor_no_orth": AgentVariant("mor", "roles", "MoR without the orthogonality loss (Table 4, alpha2 = 0)",
                                sets=(("moragent.orth_weight", 0.0),)),
}


def agent_variant_of(cfg) -> AgentVariant:
    return AGENT_VARIANTS[cfg.variant]


def apply_agent_variant(c: ml_collections.ConfigDict, name: str) -> ml_collections.ConfigDict:
    """Apply MoRAgent row ``name`` (a key of AGENT_VARIANTS) to ``c`` in place."""
    if name not in AGENT_VARIANTS:
        raise ValueError(f"config variant: unknown MoRAgent variant {name!r}; choose one of {sorted(AGENT_VARIANTS)}")
    return _write_overlay(c, AGENT_VARIANTS[name].overlay(name))
