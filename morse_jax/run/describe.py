"""``--config.mode=describe``: what a run would do, without loading weights.

Reads at most the model's ``config.json`` (or a GGUF file's metadata), the split files (SciCode
JSONL, SRDD CSV) and nothing else: no weights, no tokenizer, no ``test_data.h5`` contents.
Whatever it cannot determine it says so on its line instead of failing. The lines
``train tasks: N``, ``eval tasks: N`` and ``trainable parameters: N.NNM`` are stable for scripts.
"""

from __future__ import annotations

from pathlib import Path

from morse_jax.config.derived import bank_spec, memory_plan, sampler_config, train_steps
from morse_jax.config.variants import VARIANTS, trains, variant_of

UNKNOWN = "could not determine"


def model_config_without_weights(path: str):
    """(ModelConfig, source) from config.json / GGUF metadata; raises with the reason otherwise."""
    from morse_jax.models.hf_config import from_hf_config

    if not path:
        raise ValueError("config.model.path is empty")
    if path == "embedded":
        from morse_jax.models.loading import embedded_model_path

        p = embedded_model_path()
    else:
        p = Path(path).expanduser()
    if p.suffix == ".gguf":
        from morse_jax.models import gguf_meta

        return from_hf_config(gguf_meta.hf_config(p)), f"{p.name} metadata"
    if not (p / "config.json").is_file():
        raise ValueError(f"{p}/config.json does not exist")
    from morse_jax.models.hf_import import import_transformers

    AutoConfig = import_transformers().AutoConfig

    return from_hf_config(AutoConfig.from_pretrained(str(p), local_files_only=True)), f"{p}/config.json"


def trainable_count(cfg, model_config, spec) -> dict[str, int]:
    """Parameters that train, {"experts": n, "router": n}, from ``jax.eval_shape`` of their init (no
    arrays). Variants without a router (B, B++, single_agent_rl) carry an unused one: not counted."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from morse_jax.config.derived import train_config
    from morse_jax.rl.update import init_trainable

    shapes = jax.eval_shape(lambda k: init_trainable(k, model_config, spec, train_config(cfg), jnp.float32),
                            jax.random.key(0))
    count = {name: int(sum(np.prod(x.shape) for x in jax.tree.leaves(tree))) for name, tree in shapes.items()}
    routed = variant_of(cfg).orchestration in ("mole", "flat_mole")
    return {"experts": count["bank"], "router": count["router"] if routed else 0}


def _what_trains(cfg, spec) -> str:
    v = variant_of(cfg)
    if not trains(cfg):
        why = "mode is not train" if cfg.mode != "train" else "no adapters"
        return f"nothing ({why})"
    if v.orchestration == "single_lora":
        return f"one LoRA (rank {spec.rank}) on every call, {v.advantage.upper()} advantages"
    credit = ("HGRPO: A_within -> experts, A_cross -> router" if v.advantage == "hgrpo"
              else "flat GRPO: one advantage for experts and router")
    return (f"{len(spec.role_names)} role + {spec.num_subtask} subtask LoRA experts (rank {spec.rank}) "
            f"and the router; {credit}")


def _splits(cfg) -> tuple[list[str], int | None]:
    """Lines about the splits, and the number of training tasks (None when unknown)."""
    from morse_jax.tasks import registry

    lines, n_train = [], None
    for field in ("train", "eval"):
        source = cfg.data[field]
        if not source:
            lines.append(f"{field} tasks: 0 (config.data.{field} is empty)")
            if field == "train":
                n_train = 0
            continue
        try:
            if cfg.data.family == "scicode":
                summary, note = _scicode_summary(cfg, field)
            else:
                summary, note = registry.srdd_split(cfg, field)[1], ""
        except Exception as e:  # a missing file, an unknown split: say it, go on
            lines.append(f"{field} tasks: {UNKNOWN} ({type(e).__name__}: {str(e).splitlines()[0]})")
            continue
        lines.append(f"{field} tasks: {summary.tasks}")
        lines.append("  " + summary.line() + note)
        if field == "train":
            n_train = summary.tasks
    return lines, n_train


def _scicode_summary(cfg, field: str):
    """SciCode counts from the JSONL alone (targets assumed available), and how many problems
    could be scored with the targets the config has right now."""
    from morse_jax.tasks import registry
    from morse_jax.tasks.scicode import family as sc

    problems = registry.scicode_problems(cfg, cfg.data[field])
    used, left = [], []
    for p in problems:
        why = registry.scicode_left_out_reason(cfg, p, None)
        (used if why is None else left).append(p if why is None else (p.problem_id, why))
    tasks = registry.select_tasks([sc.problem_to_task(p) for p in used], cfg.data[f"{field}_ids"],
                             cfg.data[f"max_{field}_tasks"], f"{field}_ids")
    summary = registry.SplitSummary(field, cfg.data[field], len(tasks),
                                    sum(len(t.payload.testable_steps) for t in tasks), tuple(left))
    note = ""
    if not cfg.data.scicode_h5:
        rebuilt = sc.RebuiltTargets(cfg.data.cache_dir or None)
        ok = sum(all(rebuilt.can_score(t.payload, s) for s in t.payload.testable_steps) for t in tasks)
        if ok < len(tasks):
            note = (f" [without config.data.scicode_h5 only {ok} of {len(tasks)} can be scored "
                    f"(targets rebuilt from ground truth); the run needs test_data.h5]")
    elif not Path(cfg.data.scicode_h5).expanduser().is_file():
        note = f" [config.data.scicode_h5={cfg.data.scicode_h5} does not exist]"
    return summary, note


def described_mode(cfg) -> str:
    """The mode the described run has: ``--config.mode=describe`` replaced the config's own, so
    take the variant's (the paper's rows: A, single_agent and base evaluate, the others train)."""
    if cfg.mode != "describe":
        return cfg.mode
    v = VARIANTS.get(cfg.variant)
    return "train" if v is None or v.trains else "eval"


def describe(cfg) -> str:
    """The text ``mode=describe`` prints."""
    cfg = cfg.copy_and_resolve_references()
    with cfg.unlocked():
        cfg.mode = described_mode(cfg)
    v = variant_of(cfg)
    r, t, m = cfg.rollout, cfg.train, cfg.mole
    out = [f"describe: what this config runs (no weights loaded); workdir {cfg.workdir}",
           f"variant: {cfg.variant}: {v.what} (adapters {v.orchestration}, credit {v.advantage})",
           f"mode: {cfg.mode} (set --config.mode to describe another); structure: " + ("one call per task (rollout.single_agent)" if r.single_agent
                                                 else f"planner-made DAG of {r.min_nodes}-{r.max_nodes} nodes"
                                                 + ("" if cfg.data.family != "scicode" else
                                                    f" (SciCode: rollout.scicode_dag={r.scicode_dag})"))]
    spec = None
    try:
        spec = bank_spec(cfg)
    except ValueError as e:
        out.append(f"expert bank: {UNKNOWN} ({e})")
    out.append(f"what trains: {_what_trains(cfg, spec) if spec is not None or v.orchestration == 'none' else UNKNOWN}")
    model_cfg = None
    try:
        model_cfg, source = model_config_without_weights(cfg.model.path)
        out.append(f"model: {cfg.model.path} ({source}): {model_cfg.family}, {model_cfg.num_layers} layers, "
                   f"hidden {model_cfg.hidden_size}, vocab {model_cfg.vocab_size}, "
                   f"context {model_cfg.max_position_embeddings}, dtype {cfg.model.dtype}")
    except Exception as e:
        out.append(f"model: {UNKNOWN} ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})")
    if spec is None:
        out.append("trainable parameters: 0.00M (no adapters)" if v.orchestration == "none"
                   else f"trainable parameters: {UNKNOWN}")
    elif model_cfg is None:
        out.append(f"trainable parameters: {UNKNOWN} (needs the model's config.json)")
    else:
        try:
            n = trainable_count(cfg, model_cfg, spec)
            out.append(f"trainable parameters: {sum(n.values()) / 1e6:.2f}M (experts {n['experts'] / 1e6:.2f}M, "
                       f"router {n['router'] / 1e6:.2f}M)")
        except Exception as e:
            out.append(f"trainable parameters: {UNKNOWN} ({type(e).__name__}: {e})")
    lines, n_train = _splits(cfg)
    out += lines
    out.append(f"B (routes per node): {r.routes}, M (candidates per route): {r.candidates}, "
               f"K (routed subtask experts): {m.top_k}, K_s (subtask experts): {m.num_subtask}, "
               f"L_adapt: {m.n_adapt}, targets {'/'.join(m.targets)}")
    out.append(f"ranks: MoLE experts {m.rank} (alpha {m.alpha:g}); single LoRA (B/B++/single_agent_rl) "
               f"{m.single_rank} (alpha {2 * m.single_rank:g})" + (f"; in use: {spec.rank}" if spec else ""))
    out.append(f"learning rates: LoRA {t.lora_lr:g}, router {t.router_lr:g}, weight decay {t.weight_decay:g}; "
               f"alpha_pi {t.alpha_pi:g}, entropy {t.entropy_weight:g}, orthogonality {t.orthogonality_weight:g}")
    out.append(f"train decoding: temperature {r.temperature:g}, top-p {r.top_p:g}, {r.max_new_tokens} new tokens; "
               f"merge calls: {r.merge_candidates}")
    out.append(f"eval decoding: temperature {r.eval_temperature:g}, top-p {r.eval_top_p:g}, "
               f"{r.eval_max_new_tokens} new tokens; planner: greedy, {r.planner_max_new_tokens} new tokens")
    out.append(f"regeneration budgets: {r.max_attempts} calls per node in training, {r.eval_max_attempts} at "
               f"evaluation; planner re-plans {r.max_replans}")
    if n_train is None:
        steps = f"{t.steps}" if t.epochs == 0 else UNKNOWN + " (epochs need the train split)"
    else:
        steps = str(train_steps(cfg, n_train))
    how = (f"{t.epochs} epochs x ceil({n_train} tasks / {cfg.data.tasks_per_step} per step)" if t.epochs > 0
           else "train.steps")
    out.append(f"steps: {steps if trains(cfg) else 0} ({how if trains(cfg) else 'no training'}), "
               f"{cfg.data.tasks_per_step} tasks per step; PPO epochs per rollout: {t.ppo_epochs}; "
               f"update micro-batch {t.micro_batch}")
    s = sampler_config(cfg)
    out.append(f"sampler: batch buckets {s.batch_buckets}, new-token buckets up to {max(s.new_token_buckets)}")
    if model_cfg is not None:
        mesh = tuple(1 if x == -1 else x for x in cfg.parallel.mesh)
        try:
            import jax  # the sampler's prefill chunk, hence the plan, depends on the backend

            plan = memory_plan(cfg, model_cfg, spec, mesh, jax.default_backend()).format(None)
            note = "; -1 axes counted as 1: set parallel.mesh to plan for your devices" if -1 in cfg.parallel.mesh else ""
            out.append(f"memory plan (mesh {mesh}{note}):")
            out += ["  " + ln for ln in plan.splitlines()]
        except Exception as e:
            out.append(f"memory plan: {UNKNOWN} ({type(e).__name__}: {e})")
    else:
        out.append(f"memory plan: {UNKNOWN} (needs the model's config.json)")
    return "\n".join(out)
