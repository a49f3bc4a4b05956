"""Config files load for every variant; bad configs fail fast with one line naming the field."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import ml_collections
import pytest

from morse_jax.configuration import ConfigError, validate_config
from morse_jax.default_config import VARIANT_OVERLAYS, VARIANTS, get_config as defaults

REPO = Path(__file__).resolve().parents[1]
CONFIGS = sorted((REPO / "configs").glob("*.py"))


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
    if not VARIANTS[variant][2]:
        assert cfg.mode == "eval"  # variants that do not train only evaluate


def test_paper_config_has_app_e_hyperparameters():
    cfg = _load(REPO / "configs" / "qwen3_4b_srdd.py")
    assert (cfg.mole.n_adapt, cfg.mole.rank, cfg.mole.alpha, cfg.mole.num_subtask, cfg.mole.top_k) == (8, 8, 16.0, 4, 2)
    assert (cfg.rollout.routes, cfg.rollout.candidates, cfg.rollout.top_p) == (4, 4, 0.95)
    assert (cfg.train.lora_lr, cfg.train.router_lr, cfg.train.alpha_pi) == (8e-5, 3e-5, 0.15)
    assert (cfg.train.clip_advantage, cfg.train.min_std) == (5.0, 5e-4)
    assert _load(REPO / "configs" / "qwen3_4b_srdd.py", "B++").mole.single_rank == 48


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
