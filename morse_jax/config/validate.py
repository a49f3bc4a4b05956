"""Validate a resolved config before anything heavy starts; every error is one line naming the field."""

from __future__ import annotations

import numbers
from pathlib import Path

import ml_collections

from morse_jax.config.defaults import MODES, get_config as defaults
from morse_jax.config.variants import AGENT_VARIANTS, VARIANTS

SYSTEMS = ("morse", "moragent")
AGENT_MODES = ("train", "eval")
# moragent.train_data values that name a built-in source rather than a JSON Lines file
GENERATED_DATA = ("synthetic", "questions", "bfcl_live", "synthetic+bfcl_live")
# the built-in sources that train on BFCL's live categories (so may not score them)
LIVE_DATA = ("bfcl_live", "synthetic+bfcl_live")


class ConfigError(ValueError):
    """A config field is unknown, of the wrong type, out of range, or names a missing path."""


def _walk(cfg, ref, prefix="config"):
    for key in cfg.keys():
        name = f"{prefix}.{key}"
        if key not in ref:
            raise ConfigError(f"{name}: unknown field (known: {', '.join(sorted(ref.keys()))})")
        value, want = cfg[key], ref[key]
        if isinstance(want, ml_collections.ConfigDict):
            if not isinstance(value, ml_collections.ConfigDict):
                raise ConfigError(f"{name}: must be a group of fields, got {type(value).__name__}")
            _walk(value, want, name)
        elif isinstance(want, bool):
            if not isinstance(value, bool):
                raise ConfigError(f"{name}: must be a bool, got {value!r}")
        elif isinstance(want, numbers.Integral):
            if isinstance(value, bool) or not isinstance(value, numbers.Integral):
                raise ConfigError(f"{name}: must be an int, got {value!r}")
        elif isinstance(want, numbers.Real):
            if isinstance(value, bool) or not isinstance(value, numbers.Real):
                raise ConfigError(f"{name}: must be a number, got {value!r}")
        elif isinstance(want, str):
            if not isinstance(value, str):
                raise ConfigError(f"{name}: must be a string, got {value!r}")
        elif isinstance(want, (tuple, list)):
            if not isinstance(value, (tuple, list)):
                raise ConfigError(f"{name}: must be a list, got {value!r}")


def _positive(cfg, *names):
    for n in names:
        group, field = n.split(".")
        v = cfg[group][field]
        if v < 1:
            raise ConfigError(f"config.{n}: must be >= 1, got {v}")


def _choice(cfg, dotted, choices):
    group, field = dotted.split(".")
    if cfg[group][field] not in choices:
        raise ConfigError(f"config.{dotted}: must be one of {choices}, got {cfg[group][field]!r}")


def _derived_objects(cfg) -> None:
    """Build what the job derives from several fields (sampler buckets, expert bank) so their
    constraints fail here, in one line naming the field, instead of after the weights load."""
    from morse_jax.config.derived import bank_spec, sampler_config

    for build, group in ((bank_spec, "mole"), (sampler_config, "sampler")):
        try:
            build(cfg)
        except ValueError as e:
            msg = str(e).splitlines()[0]
            raise ConfigError(msg if msg.startswith("config.") else
                              f"config.{msg}" if msg.startswith(f"{group}.") else f"config.{group}: {msg}") from e


def validate_config(cfg: ml_collections.ConfigDict, *, check_paths: bool = True) -> None:
    """Raise ConfigError (one line, naming the field) unless the config is usable."""
    _walk(cfg, defaults())
    if cfg.mode not in MODES:
        raise ConfigError(f"config.mode: must be one of {MODES}, got {cfg.mode!r}")
    if cfg.system not in SYSTEMS:
        raise ConfigError(f"config.system: must be one of {SYSTEMS}, got {cfg.system!r}")
    if cfg.system == "moragent":
        return _validate_moragent(cfg, check_paths=check_paths)
    if cfg.variant not in VARIANTS:
        raise ConfigError(f"config.variant: must be one of {sorted(VARIANTS)}, got {cfg.variant!r}")
    _positive(cfg, "rollout.routes", "rollout.candidates", "rollout.max_attempts", "rollout.max_new_tokens",
              "rollout.eval_max_new_tokens", "mole.rank", "mole.n_adapt", "mole.top_k", "train.micro_batch",
              "train.checkpoint_every", "data.tasks_per_step", "sampler.max_batch")
    if cfg.train.steps < 0:
        raise ConfigError(f"config.train.steps: must be >= 0, got {cfg.train.steps}")
    _positive(cfg, "rollout.eval_max_attempts", "rollout.planner_max_new_tokens", "rollout.min_nodes",
              "sampler.chunk", "mole.single_rank")
    _choice(cfg, "rollout.merge_candidates", ("routes_x_candidates", "candidates"))
    _choice(cfg, "rollout.scicode_dag", ("chain", "planner"))
    _choice(cfg, "srdd.completeness_mode", ("ast", "line_rule"))
    _choice(cfg, "mole.merge_mode", ("union", "random_subset"))
    if VARIANTS[cfg.variant].orchestration in ("mole", "flat_mole"):  # a routed bank: K of K_s experts
        from morse_jax.mole.router import check_top_k

        try:
            check_top_k(cfg.mole.top_k, cfg.mole.num_subtask, "config.mole.top_k", "config.mole.num_subtask")
        except ValueError as e:
            raise ConfigError(str(e)) from e
    if cfg.sampler.get("prefill_rows", 0) < 0:
        raise ConfigError(f"config.sampler.prefill_rows: must be >= 0 (0: by backend), got {cfg.sampler.prefill_rows}")
    if cfg.sampler.cpu_kernels not in ("auto", "on", "off"):
        raise ConfigError(f"config.sampler.cpu_kernels: must be auto, on or off, got {cfg.sampler.cpu_kernels!r}")
    if cfg.sampler.get("block_weights", "auto") not in ("auto", "off"):
        raise ConfigError(f"config.sampler.block_weights: must be auto or off, got {cfg.sampler.block_weights!r}")
    for name in ("top_p", "eval_top_p"):
        if not 0 < cfg.rollout[name] <= 1:
            raise ConfigError(f"config.rollout.{name}: must be in (0, 1], got {cfg.rollout[name]}")
    for name in ("temperature", "eval_temperature"):
        if cfg.rollout[name] < 0:
            raise ConfigError(f"config.rollout.{name}: must be >= 0, got {cfg.rollout[name]}")
    if cfg.rollout.verify_workers < 0:
        raise ConfigError(f"config.rollout.verify_workers: must be >= 0 (0 = one per CPU), got {cfg.rollout.verify_workers}")
    if cfg.rollout.min_nodes > cfg.rollout.max_nodes:
        raise ConfigError(f"config.rollout.min_nodes: {cfg.rollout.min_nodes} exceeds "
                          f"config.rollout.max_nodes={cfg.rollout.max_nodes}")
    if cfg.mode == "train" and not VARIANTS[cfg.variant].has_adapters:
        raise ConfigError(f"config.mode: variant {cfg.variant!r} has no adapters to train; use mode=eval")
    _derived_objects(cfg)
    for name in ("lora_lr", "router_lr"):
        if cfg.train[name] <= 0:
            raise ConfigError(f"config.train.{name}: must be > 0, got {cfg.train[name]}")
    _positive(cfg, "train.ppo_epochs")
    if cfg.train.max_grad_norm < 0:
        raise ConfigError(f"config.train.max_grad_norm: must be >= 0 (0 = off), got {cfg.train.max_grad_norm}")
    if cfg.train.loss_normalisation not in ("sequence_mean", "sequence_sum"):
        raise ConfigError(f"config.train.loss_normalisation: must be sequence_mean or sequence_sum, "
                          f"got {cfg.train.loss_normalisation!r}")
    _choice(cfg, "train.remat", ("none", "layer"))
    from morse_jax.tasks.registry import FAMILIES

    if cfg.data.family not in FAMILIES:
        raise ConfigError(f"config.data.family: must be one of {FAMILIES}, got {cfg.data.family!r}")
    if cfg.data.family == "pyfuncs":
        from morse_jax.tasks.pyfuncs.data import SPLITS

        for field in ("train", "eval"):
            if cfg.data[field] and cfg.data[field] not in SPLITS:
                raise ConfigError(f"config.data.{field}: pyfuncs splits are {SPLITS}, got {cfg.data[field]!r}")
    if cfg.mode in ("solve", "plan") and not cfg.task.strip():
        raise ConfigError(f"config.task: mode={cfg.mode} needs a task description (--config.task=\"...\")")
    if cfg.train.epochs < 0:
        raise ConfigError(f"config.train.epochs: must be >= 0, got {cfg.train.epochs}")
    if len(cfg.parallel.mesh) != 3 or any(not isinstance(v, int) or (v < 1 and v != -1) for v in cfg.parallel.mesh):
        raise ConfigError(f"config.parallel.mesh: must be 3 ints (data, fsdp, tensor), each >= 1 or -1, "
                          f"got {tuple(cfg.parallel.mesh)}")
    _model_path(cfg, check_paths)
    if not check_paths:
        return
    if cfg.mode in ("train", "eval", "diagnose") and cfg.data.family != "pyfuncs":
        for field in ("train", "eval"):
            src = cfg.data[field]
            if not src or src.startswith("package:"):
                continue
            p = Path(src).expanduser()
            if p.suffix in (".jsonl", ".csv"):
                if not p.exists():
                    raise ConfigError(f"config.data.{field}: file {src} does not exist")
            elif not Path(cfg.data.dir).expanduser().exists():
                raise ConfigError(f"config.data.dir: {cfg.data.dir} does not exist (needed for split {src!r})")
    if (cfg.data.family == "scicode" and cfg.mode in ("train", "eval") and not cfg.data.scicode_h5
            and any(src and not src.startswith("package:") for src in (cfg.data.train, cfg.data.eval))):
        raise ConfigError("config.data.scicode_h5: required for the MoRSE SciCode splits (the official "
                          "test_data.h5; without it only the 'package:dev' problems can be scored)")
    if cfg.data.scicode_h5 and not Path(cfg.data.scicode_h5).expanduser().exists():
        raise ConfigError(f"config.data.scicode_h5: {cfg.data.scicode_h5} does not exist")


def _model_path(cfg, check_paths: bool) -> None:
    if not cfg.model.path and cfg.mode != "describe":
        raise ConfigError("config.model.path: required: an HF checkpoint directory, a .gguf file, or 'embedded'")
    if not check_paths:
        return
    if cfg.model.path != "embedded" and not Path(cfg.model.path).expanduser().exists():
        raise ConfigError(f"config.model.path: {cfg.model.path} does not exist")
    if cfg.model.path == "embedded":
        from morse_jax.models.loading import embedded_model_path

        try:
            embedded_model_path()
        except FileNotFoundError as e:
            raise ConfigError(f"config.model.path: {e}") from e


def _validate_moragent(cfg, *, check_paths: bool) -> None:
    """config.system="moragent": the variant, the moragent.* fields, the model and data paths."""
    from morse_jax.models.adapters import LORA_TARGETS
    from morse_jax.tasks.bfcl.subset import SPLITS, parse_subset
    from morse_jax.tasks.bfcl.trajectories import THOUGHT_STYLES
    from morse_jax.tasks.trajectories import ROLE_NAMES

    m = cfg.moragent
    if cfg.variant not in AGENT_VARIANTS:
        raise ConfigError(f"config.variant: must be one of {sorted(AGENT_VARIANTS)} with system=moragent, "
                          f"got {cfg.variant!r}")
    if cfg.mode not in AGENT_MODES:
        raise ConfigError(f"config.mode: must be one of {AGENT_MODES} with system=moragent, got {cfg.mode!r}")
    if cfg.mode == "train" and not AGENT_VARIANTS[cfg.variant].trains:
        raise ConfigError(f"config.mode: variant {cfg.variant!r} has no adapters to train; use mode=eval")
    n = len(ROLE_NAMES)
    for name in ("routed", "top_k"):
        if len(m[name]) != n or any(not isinstance(v, int) or v < 1 for v in m[name]):
            raise ConfigError(f"config.moragent.{name}: must be {n} ints >= 1 (one per role: {', '.join(ROLE_NAMES)}), "
                              f"got {tuple(m[name])}")
    for role, k, e in zip(ROLE_NAMES, m.top_k, m.routed):
        if k > e:
            raise ConfigError(f"config.moragent.top_k: {role} keeps {k} of {e} routed LoRAs (moragent.routed)")
    bad = [t for t in m.targets if t not in LORA_TARGETS]
    if not m.targets or bad:
        raise ConfigError(f"config.moragent.targets: must be a non-empty subset of {LORA_TARGETS}, got {tuple(m.targets)}")
    _choice(cfg, "moragent.shared_gate", ("always", "sigmoid"))
    _choice(cfg, "moragent.role_choice", ("likelihood", "text"))
    _choice(cfg, "moragent.thought", THOUGHT_STYLES)
    _choice(cfg, "moragent.eval_split", SPLITS)
    _choice(cfg, "moragent.first_thought", ("generate", "closed"))  # run.role_loop.FIRST_THOUGHTS (a layer above)
    _choice(cfg, "moragent.executor", ("generate", "guided"))  # run.role_loop.EXECUTORS
    for field, value in (("first_thought", "closed"), ("executor", "guided")):
        if m[field] == value and m.train_data in GENERATED_DATA and m.thought != "names":
            raise ConfigError(f"config.moragent.{field}: {value!r} reads the \"names\" template, but the reasoner is "
                              f"trained on moragent.thought={m.thought!r}")
    _positive(cfg, "moragent.rank", "moragent.epochs", "moragent.batch_size", "moragent.micro_batch",
              "moragent.checkpoint_every", "moragent.eval_batch", "moragent.direct_max_new_tokens",
              "moragent.max_turns", "moragent.reasoner_max_new_tokens", "moragent.executor_max_new_tokens",
              "moragent.summarizer_max_new_tokens", "moragent.synthetic_examples", "moragent.max_len")
    for name in ("n_adapt", "lora_rank", "heldout_examples", "live_examples"):
        if m[name] < 0:
            raise ConfigError(f"config.moragent.{name}: must be >= 0, got {m[name]}")
    for name in ("balance_weight", "orth_weight", "scale"):
        if m[name] < 0:
            raise ConfigError(f"config.moragent.{name}: must be >= 0, got {m[name]}")
    if m.lr <= 0:
        raise ConfigError(f"config.moragent.lr: must be > 0, got {m.lr}")
    if not 0 <= m.warmup_fraction < 1:
        raise ConfigError(f"config.moragent.warmup_fraction: must be in [0, 1), got {m.warmup_fraction}")
    if m.batch_size % m.micro_batch:
        raise ConfigError(f"config.moragent.batch_size: {m.batch_size} is not a multiple of "
                          f"config.moragent.micro_batch={m.micro_batch}")
    if m.train_data in ("synthetic", "questions", "synthetic+bfcl_live") and m.heldout_examples >= m.synthetic_examples:
        raise ConfigError(f"config.moragent.heldout_examples: {m.heldout_examples} leaves no training example of "
                          f"config.moragent.synthetic_examples={m.synthetic_examples}")
    try:
        subset = parse_subset(tuple(m.eval_subset))
    except ValueError as e:
        raise ConfigError(f"config.moragent.eval_subset: {e}") from e
    live = [c for c, _ in subset if c.startswith("live_")]
    if m.train_data in LIVE_DATA and live and AGENT_VARIANTS[cfg.variant].trains:
        raise ConfigError(f"config.moragent.eval_subset: {', '.join(live)} would score items of the categories "
                          f"moragent.train_data={m.train_data!r} trains on; evaluate on non-live categories")
    _model_path(cfg, check_paths)
    if check_paths and m.train_data not in GENERATED_DATA and AGENT_VARIANTS[cfg.variant].trains:
        if not Path(m.train_data).expanduser().is_file():
            raise ConfigError(f"config.moragent.train_data: {m.train_data} is not 'synthetic', 'questions', "
                              "'bfcl_live', 'synthetic+bfcl_live' or an "
                              "existing JSON Lines file")
