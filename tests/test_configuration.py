"""Config files load for every variant; bad configs fail fast with one line naming the field."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import ml_collections
import pytest

from morse_jax.config.validate import ConfigError, validate_config
from morse_jax.config.defaults import get_config as defaults
from morse_jax.config.variants import VARIANT_OVERLAYS

REPO = Path(__file__).resolve().parents[1]
# MoRSE configs (MoRAgent's, config.system="moragent", have their own rows: tests/test_moragent_job.py)
CONFIGS = sorted(p for p in (REPO / "configs").glob("*.py") if not p.stem.startswith("moragent_"))


def _load(path: Path, *args):
    spec = importlib.util.spec_from_file_location(path.stem, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.get_config(*args)


def _with(cfg, dotted: str, value):
    """A copy of ``cfg`` with one field replaced, bypassing ConfigDict's type checks."""
    d = cfg.to_dict()
    node = d
    *groups, field = dotted.split(".")
    for g in groups:
        node = node[g]
    node[field] = value
    return ml_collections.ConfigDict(d)


def test_config_files_exist_for_every_backbone_and_benchmark():
    names = {p.stem for p in CONFIGS}
    for backbone in ("qwen3_4b", "llama31_8b", "gemma4_31b"):
        for bench in ("srdd", "scicode"):
            assert f"{backbone}_{bench}" in names
    assert "quickstart" in names


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.stem)
@pytest.mark.parametrize("variant", sorted(VARIANT_OVERLAYS))
def test_every_config_and_variant_validates(path, variant):
    cfg = _load(path, variant)
    assert cfg.variant == variant
    if not cfg.model.path:  # paper configs: the user gives the checkpoint
        with pytest.raises(ConfigError, match=r"^config\.model\.path: required"):
            validate_config(cfg, check_paths=False)
        cfg.model.path = "/ckpt/model"
    validate_config(cfg, check_paths=False)
    if variant in ("A", "single_agent", "base"):
        assert cfg.mode == "eval"  # the paper's untrained rows only evaluate
    else:
        assert cfg.mode == "train"
    assert cfg.rollout.single_agent == variant.startswith("single_agent")


def test_paper_config_has_app_e_hyperparameters():
    cfg = _load(REPO / "configs" / "qwen3_4b_srdd.py")
    assert (cfg.mole.n_adapt, cfg.mole.rank, cfg.mole.alpha, cfg.mole.num_subtask, cfg.mole.top_k) == (8, 8, 16.0, 4, 2)
    assert (cfg.rollout.routes, cfg.rollout.candidates, cfg.rollout.top_p) == (4, 4, 0.95)
    assert (cfg.train.lora_lr, cfg.train.router_lr, cfg.train.alpha_pi) == (8e-5, 3e-5, 0.15)
    assert (cfg.train.clip_advantage, cfg.train.min_std) == (5.0, 5e-4)
    assert _load(REPO / "configs" / "qwen3_4b_srdd.py", "B++").mole.single_rank == 48


PAPER = [p for p in CONFIGS if p.stem not in ("quickstart", "learn_cpu")]  # CPU configs, not paper ones


@pytest.mark.parametrize("path", PAPER, ids=lambda p: p.stem)
def test_paper_configs_follow_app_i(path):
    """App. I: every method decodes with an 8192-token budget, temperature 0.2, top-p 0.95; at most
    3 attempts on SRDD, no revision at SciCode evaluation; every problem of every split is used.
    Alg. 1: mergers follow the same B x M loop; Sec. 3.1 / App. E: the planner makes every DAG."""
    cfg = _load(path)
    r = cfg.rollout
    assert (r.eval_temperature, r.eval_top_p, r.eval_max_new_tokens) == (0.2, 0.95, 8192)
    assert r.eval_max_attempts == (1 if cfg.data.family == "scicode" else 3)
    assert r.merge_candidates == "routes_x_candidates"
    assert cfg.data.skip_slow_steps is False
    if cfg.data.family == "scicode":
        assert r.scicode_dag == "planner"
    else:
        assert (r.min_nodes, r.max_nodes) == (5, 8)  # the authors' SRDD planner
        assert cfg.srdd.planner_hint and cfg.srdd.use_gate


@pytest.mark.parametrize("path", PAPER, ids=lambda p: p.stem)
def test_paper_configs_build_their_sampler(path):
    """sampler.max_batch=64 with buckets ending at 32 stopped every paper config in
    SamplerConfig.__post_init__; the buckets now come from the config and cover its budgets."""
    from morse_jax.config.derived import sampler_config

    cfg = _load(path)
    s = sampler_config(cfg)
    assert s.max_batch == cfg.sampler.max_batch == 64 and max(s.batch_buckets) == 64
    assert max(s.new_token_buckets) >= cfg.rollout.eval_max_new_tokens
    assert list(s.batch_buckets) == sorted(set(s.batch_buckets))


def test_sampler_buckets_end_at_any_max_batch():
    from morse_jax.config.derived import buckets_up_to

    assert buckets_up_to((1, 2, 4, 8, 16, 32), 24) == (1, 2, 4, 8, 16, 24)
    assert buckets_up_to((1, 2, 4, 8, 16, 32), 128) == (1, 2, 4, 8, 16, 32, 64, 128)
    assert buckets_up_to((1, 2, 4), 1) == (1,)


def test_prefill_rows_by_backend_or_as_configured():
    """0 = the backend's default, resolved when a batch is shaped (512 token rows per chunk on CPU,
    4096 on accelerators: a GPU run prefilled 64 x 512 tokens in 64 chunks of 8 at ~10x its FLOP
    time); a set value is used as is, and the config never asks JAX for the backend."""
    from morse_jax.config.derived import sampler_config
    from morse_jax.sampling.requests import Request, batch_shape, prefill_token_rows

    cfg = defaults()
    s = sampler_config(cfg)
    assert s.prefill_rows == 0
    assert prefill_token_rows(s, "cpu") == 512 and prefill_token_rows(s, "gpu") == 4096
    assert prefill_token_rows(s, "tpu") == 4096 and prefill_token_rows(s) == 512  # the tests run on CPU
    cfg.sampler.prefill_rows = 1024
    s = sampler_config(cfg)
    assert prefill_token_rows(s, "gpu") == 1024 and prefill_token_rows(s, "cpu") == 1024
    # 16 rows of a 256-token prompt bucket: 1024 / 16 = 64-token chunks
    reqs = [Request(list(range(1, 201)), [], [], max_new_tokens=8) for _ in range(16)]
    assert batch_shape(reqs, s).chunk == 64


@pytest.mark.parametrize("dotted,value,pattern", [
    ("rollout.min_nodes", 9, r"^config\.rollout\.min_nodes: 9 exceeds config\.rollout\.max_nodes=8$"),
    ("rollout.eval_top_p", 0.0, r"^config\.rollout\.eval_top_p: must be in \(0, 1\]"),
    ("rollout.eval_temperature", -0.1, r"^config\.rollout\.eval_temperature: must be >= 0"),
    ("rollout.eval_max_attempts", 0, r"^config\.rollout\.eval_max_attempts: must be >= 1"),
    ("rollout.merge_candidates", "all", r"^config\.rollout\.merge_candidates: must be one of"),
    ("rollout.scicode_dag", "tree", r"^config\.rollout\.scicode_dag: must be one of"),
    ("srdd.completeness_mode", "lines", r"^config\.srdd\.completeness_mode: must be one of"),
    ("mole.targets", ("q", "x"), r"^config\.mole\.targets: unknown \['x'\]"),
    ("sampler.chunk", 0, r"^config\.sampler\.chunk: must be >= 1"),
    ("sampler.prefill_rows", -1, r"^config\.sampler\.prefill_rows: must be >= 0"),
])
def test_cross_field_and_range_errors_name_the_field(dotted, value, pattern):
    with pytest.raises(ConfigError, match=pattern):
        validate_config(_with(defaults(), dotted, value), check_paths=False)


def test_training_a_variant_without_adapters_fails_naming_mode():
    cfg = _with(_with(defaults(), "variant", "base"), "mode", "train")
    with pytest.raises(ConfigError, match=r"^config\.mode: variant 'base' has no adapters to train"):
        validate_config(cfg, check_paths=False)


def test_variant_training_and_structure_are_independent_settings():
    """Table 4 row 2 (single-agent LoRA RL): one LoRA, one call per task, trained with GRPO. Whether
    a variant trains is config.mode and whether it plans a DAG is rollout.single_agent."""
    from morse_jax.config.derived import bank_spec
    from morse_jax.config.variants import apply_variant, trains, variant_of

    rl = apply_variant(defaults(), "single_agent_rl")
    validate_config(rl, check_paths=False)
    assert variant_of(rl).orchestration == "single_lora" and variant_of(rl).advantage == "grpo"
    assert rl.rollout.single_agent and rl.mode == "train" and trains(rl)
    assert bank_spec(rl).rank == 24 and bank_spec(rl).num_experts == 1  # Table 4: rank 24 x 1
    assert not trains(_with(rl, "mode", "eval"))  # the same variant, evaluated only
    d_single = _with(defaults(), "rollout.single_agent", True)  # MoLE + HGRPO without a DAG
    validate_config(d_single, check_paths=False)
    assert trains(d_single)
    a_trained = _with(apply_variant(defaults(), "A"), "mode", "train")  # A's structure, trained
    validate_config(a_trained, check_paths=False)
    assert trains(a_trained)


@pytest.mark.parametrize("variant,slots", [("D", 1 + 4), ("C", 1 + 4), ("A", 1 + 4), ("B", 1), ("B++", 1),
                                           ("single_agent_rl", 1), ("base", 1), ("single_agent", 1)])
def test_expert_slots_are_one_number_for_sampler_and_trainer(variant, slots):
    """A call holds its role expert plus, at a union merge, every one of the K_s = 4 subtask
    experts (a single LoRA: its one expert; no adapters: one empty slot); sampler and update
    batches take that one number."""
    from morse_jax.config.derived import max_active, sampler_config, train_config
    from morse_jax.config.variants import apply_variant

    cfg = apply_variant(defaults(), variant)
    assert max_active(cfg) == slots
    assert sampler_config(cfg).max_active == slots and train_config(cfg).max_active == slots


def test_variant_records_set_their_rows():
    """Each variant's overlay follows from its record: untrained rows evaluate, single-agent rows
    have no DAG, single-LoRA rows fix their rank."""
    from morse_jax.config.variants import VARIANTS, apply_variant

    for name, v in VARIANTS.items():
        cfg = apply_variant(defaults(), name)
        assert cfg.variant == name and (cfg.mode == "train") == v.trains
        assert cfg.rollout.single_agent == v.single_agent
        assert cfg.mole.single_rank == (v.single_rank if v.single_rank is not None else defaults().mole.single_rank)
    with pytest.raises(ValueError, match="unknown 'Z'"):
        apply_variant(defaults(), "Z")


@pytest.mark.parametrize("variant,override,rank", [("B", None, 24), ("B++", None, 48), ("B++", 32, 32),
                                                   ("B", 40, 40), ("single_agent_rl", 16, 16)])
def test_single_lora_rank_follows_the_config(variant, override, rank):
    """The B++ rank was hard-coded to 48 in the job on top of the config; the config is the one source."""
    from morse_jax.config.derived import bank_spec
    from morse_jax.config.variants import apply_variant

    cfg = apply_variant(defaults(), variant)
    if override is not None:
        cfg.mole.single_rank = override
    spec = bank_spec(cfg)
    assert spec.rank == rank and spec.alpha == 2.0 * rank and spec.role_names == ("single",)


def test_family_options_reach_the_family(tmp_path):
    """SciCode binary reward / gold context and SRDD gate / completeness rule / planner hint are
    config fields wired to the family the job builds."""
    from morse_jax.tasks.registry import build_family
    from morse_jax.tasks.srdd.family import SOFTWARE_PROJECT_HINT

    sc = _with(_with(defaults(), "scicode.binary_reward", True), "scicode.gold_context", True)
    fam = build_family(sc, tmp_path)
    assert fam.binary and fam.gold_context
    assert not build_family(defaults(), tmp_path).binary
    srdd = _with(defaults(), "data.family", "srdd")
    fam = build_family(srdd, tmp_path)
    assert fam.reward.use_gate and fam.reward.completeness_mode == "ast" and fam.planner_hint == SOFTWARE_PROJECT_HINT
    srdd = _with(_with(_with(srdd, "srdd.use_gate", False), "srdd.completeness_mode", "line_rule"),
                 "srdd.planner_hint", False)
    fam = build_family(srdd, tmp_path)
    assert not fam.reward.use_gate and fam.reward.completeness_mode == "line_rule" and fam.planner_hint is None


def test_srdd_planner_hint_reaches_the_planner_prompt(tmp_path):
    """The orchestrator asks the family for ``planner_hint``; SRDD's rules were defined but never
    passed. The planner's prompt now carries them."""
    from morse_jax.tasks.base import Task
    from morse_jax.tasks.registry import build_family
    from morse_jax.tomas.orchestrator import Orchestrator
    from morse_jax.tasks.srdd.family import SOFTWARE_PROJECT_HINT
    from morse_jax.tomas.config import OrchestratorConfig

    fam = build_family(_with(defaults(), "data.family", "srdd"), tmp_path)
    seen = []

    def generate(requests):
        raise AssertionError("the planner goes through plan_fn here")

    orch = Orchestrator({"srdd": fam}, None, generate, None, lambda m: seen.append(m) or [1],
                        OrchestratorConfig(mode="eval", variant="none", max_replans=0))
    try:
        orch.plan([Task("t", "A calculator.", "srdd")])
    except Exception:
        pass  # the fake model answers nothing useful; only the prompt matters
    assert seen and any(SOFTWARE_PROJECT_HINT in m["content"] for msgs in seen for m in msgs)


def test_unknown_field_fails_naming_it():
    cfg = defaults()
    cfg.train.unlock()
    cfg.train.stepz = 3
    with pytest.raises(ConfigError, match=r"^config\.train\.stepz: unknown field"):
        validate_config(cfg, check_paths=False)


@pytest.mark.parametrize("dotted,value,pattern", [
    ("rollout.routes", "4", r"^config\.rollout\.routes: must be an int"),
    ("train.lora_lr", "fast", r"^config\.train\.lora_lr: must be a number"),
    ("fresh", 1, r"^config\.fresh: must be a bool"),
    ("mole.targets", "q", r"^config\.mole\.targets: must be a list"),
])
def test_wrong_type_fails_naming_the_field(dotted, value, pattern):
    with pytest.raises(ConfigError, match=pattern):
        validate_config(_with(defaults(), dotted, value), check_paths=False)


@pytest.mark.parametrize("dotted", ["rollout.routes", "rollout.candidates", "mole.top_k", "train.micro_batch"])
def test_counts_below_one_fail(dotted):
    with pytest.raises(ConfigError, match=rf"^config\.{dotted.replace('.', '[.]')}: must be >= 1, got 0"):
        validate_config(_with(defaults(), dotted, 0), check_paths=False)


def test_range_errors():
    with pytest.raises(ConfigError, match=r"^config\.mode: must be one of"):
        validate_config(_with(defaults(), "mode", "fly"), check_paths=False)
    with pytest.raises(ConfigError, match=r"^config\.variant: must be one of"):
        validate_config(_with(defaults(), "variant", "E"), check_paths=False)
    with pytest.raises(ConfigError, match=r"^config\.mole\.top_k: 5 exceeds config\.mole\.num_subtask=4"):
        validate_config(_with(defaults(), "mole.top_k", 5), check_paths=False)
    with pytest.raises(ConfigError, match=r"^config\.sampler\.cpu_kernels: must be auto, on or off"):
        validate_config(_with(defaults(), "sampler.cpu_kernels", "yes"), check_paths=False)
    with pytest.raises(ConfigError, match=r"^config\.parallel\.mesh: must be 3 ints"):
        validate_config(_with(defaults(), "parallel.mesh", (2, 0, 1)), check_paths=False)
    with pytest.raises(ConfigError, match=r"^config\.task: mode=solve needs"):
        validate_config(_with(defaults(), "mode", "solve"), check_paths=False)


def test_missing_model_path_fails(tmp_path):
    with pytest.raises(ConfigError, match=r"^config\.model\.path: .*does not exist"):
        validate_config(_with(defaults(), "model.path", str(tmp_path / "no_such_model")))


def test_missing_data_paths_fail(tmp_path):
    cfg = _with(_with(defaults(), "data.train", str(tmp_path / "missing.jsonl")), "model.path", str(tmp_path))
    with pytest.raises(ConfigError, match=r"^config\.data\.train: file .* does not exist"):
        validate_config(cfg)
    cfg = _with(_with(defaults(), "data.family", "srdd"), "data.train", "iid_train")
    cfg = _with(_with(cfg, "data.dir", str(tmp_path / "nowhere")), "model.path", str(tmp_path))
    with pytest.raises(ConfigError, match=r"^config\.data\.dir: .* does not exist"):
        validate_config(cfg)
    cfg = _with(_with(defaults(), "data.train", "morse_train"), "model.path", str(tmp_path))
    cfg = _with(cfg, "data.dir", str(tmp_path))
    with pytest.raises(ConfigError, match=r"^config\.data\.scicode_h5: required"):
        validate_config(cfg)


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "morse_jax.main", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=120)


@pytest.mark.parametrize("args,expected", [
    (("--config.rollout.routes=0",), "config error: config.rollout.routes: must be >= 1, got 0"),
    (("--config.train.stepz=3",), "config error: config.train.stepz: unknown field"),
    (("--config.rollout.routes=x",), "config error: flag --config.rollout.routes=x: invalid literal"),
    (("--config.model.path=/no/such/ckpt",), "config error: config.model.path: /no/such/ckpt does not exist"),
])
def test_cli_fails_fast_with_one_line(args, expected):
    r = _cli("--config", "configs/quickstart.py", *args)
    assert r.returncode == 2, r.stderr[-2000:]
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith(expected), r.stderr[-2000:]


def test_cli_bad_config_file_and_variant():
    r = _cli("--config", "configs/no_such_file.py")
    assert r.returncode == 2 and r.stderr.strip() == "config error: --config: no such config file 'configs/no_such_file.py'"
    r = _cli("--config", "configs/quickstart.py:Z")
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.returncode == 2 and len(lines) == 1 and "unknown 'Z'" in lines[0], r.stderr[-2000:]


@pytest.mark.slow  # ~1-3 min: converting the GGUF tokenizer and building the model
@pytest.mark.gguf
def test_a_paper_config_job_starts_on_a_tiny_model(tmp_path):
    """The job builds (backbone, experts, sampler with the paper's max_batch=64 and 8192-token eval
    budget) from a paper config: this stopped in SamplerConfig.__post_init__ before."""
    pytest.importorskip("torch")
    from test_main_job import tiny_model_dir

    from morse_jax.run.build import Job

    cfg = _load(REPO / "configs" / "qwen3_4b_srdd.py")
    cfg.model.path, cfg.model.dtype, cfg.workdir = str(tiny_model_dir(tmp_path, "qwen3_4b")), "float32", str(tmp_path / "w")
    validate_config(cfg, check_paths=False)
    job = Job(cfg, load_tasks=False)
    assert job.sampler.config.max_batch == 64 and max(job.sampler.config.new_token_buckets) >= 8192
    assert job.spec.rank == 8 and job.spec.num_subtask == 4 and job.trains


def test_job_memory_plan_counts_the_backends_prefill_chunk():
    """The plan's sampling activations use the prefill token rows the sampler will use on that
    backend (512 on CPU, 4096 on a GPU), not the plan function's default."""
    from morse_jax import parallel as par
    from morse_jax.config.derived import bank_spec, memory_plan
    from morse_jax.parallel.memory import PRESETS

    cfg = defaults()
    model = PRESETS["Qwen3-4B"]
    spec = bank_spec(cfg)
    plans = {b: memory_plan(cfg, model, spec, (1, 1, 1), b) for b in ("cpu", "gpu")}
    for backend, rows in (("cpu", 512), ("gpu", 4096)):
        direct = par.memory_plan(model, spec, "adamw", batch=cfg.train.micro_batch,
                                 cache_len=[p + max(cfg.rollout.max_new_tokens, cfg.rollout.eval_max_new_tokens)
                                            for p in (512, 1024, 2048)],
                                 seq_len=1024 + max(cfg.rollout.max_new_tokens, cfg.rollout.eval_max_new_tokens),
                                 mesh_shape=(1, 1, 1), dtype=cfg.model.dtype, sample_batch=cfg.sampler.max_batch,
                                 remat=cfg.train.remat, prefill_rows=rows)
        assert plans[backend].components["sampling activations"] == direct.components["sampling activations"]
    assert plans["gpu"].components["sampling activations"] > plans["cpu"].components["sampling activations"]
