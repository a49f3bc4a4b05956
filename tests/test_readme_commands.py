"""Every command the README lists for the embedded model runs where torch cannot be imported, as in
the environment ``make quickstart`` builds (no torch). Tiny budgets: one task, one step, few tokens.

torch is made unimportable by ``sys.modules["torch"] = None`` before anything else runs: ``import
torch`` then raises ImportError and ``importlib.util.find_spec("torch")`` answers None, which is
what libraries that probe for torch (transformers) see when it is not installed.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
NO_TORCH = ("import sys, runpy; sys.modules['torch'] = None; sys.argv = ['morse_jax.main', *sys.argv[1:]]; "
            "runpy.run_module('morse_jax.main', run_name='__main__', alter_sys=True)")
TINY = ["--config.data.train_ids=('19',)", "--config.data.eval_ids=('19',)", "--config.data.tasks_per_step=1",
        "--config.rollout.routes=2", "--config.rollout.candidates=1", "--config.rollout.max_attempts=1",
        "--config.rollout.eval_max_attempts=1", "--config.rollout.max_new_tokens=16",
        "--config.rollout.eval_max_new_tokens=16", "--config.rollout.planner_max_new_tokens=16",
        "--config.rollout.max_replans=0", "--config.train.steps=1"]
TASK = "A command-line calculator that adds two numbers read from the arguments."


def run_without_torch(config: str, *args: str, workdir: Path | None = None) -> subprocess.CompletedProcess:
    extra = [f"--config.workdir={workdir}", f"--config.data.cache_dir={workdir.parent / 'cache'}"] if workdir else []
    r = subprocess.run([sys.executable, "-c", NO_TORCH, "--config", config, *extra, *args], cwd=REPO,
                       capture_output=True, text=True, timeout=1800)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    return r


def test_the_blocker_blocks_torch():
    code = "import sys; sys.modules['torch'] = None\nimport importlib.util\n" \
           "assert importlib.util.find_spec('torch') is None\ntry:\n import torch\nexcept ImportError:\n print('blocked')"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.stdout.strip() == "blocked", r.stderr


@pytest.mark.skipif(not (REPO.parent / "shared" / "data" / "morse-reference").is_dir(), reason="no reference data")
def test_describe_a_paper_config_without_torch():
    """Fast: no model directory to read (the paper configs leave model.path to the user)."""
    r = run_without_torch("configs/qwen3_4b_scicode.py", "--config.mode=describe")
    assert "train tasks: 60" in r.stdout and "eval tasks: 20" in r.stdout


@pytest.mark.slow
@pytest.mark.gguf
def test_describe_the_embedded_model_without_torch():
    r = run_without_torch("configs/quickstart.py", "--config.mode=describe")
    assert "train tasks: 2" in r.stdout and "trainable parameters: 1.25M" in r.stdout


@pytest.mark.slow
@pytest.mark.gguf
def test_train_eval_and_a_variant_without_torch(tmp_path):
    wd = tmp_path / "run"
    r = run_without_torch("configs/quickstart.py", *TINY, workdir=wd)
    assert "report:" in r.stdout and "train split 'package:dev': 1 tasks" in r.stdout
    r = run_without_torch("configs/quickstart.py", *TINY, "--config.mode=eval", workdir=wd)
    assert "evaluating: checkpoint step 1" in r.stdout
    r = run_without_torch("configs/quickstart.py", "--config.mode=diagnose", *TINY, workdir=wd)
    assert "diagnose: wrote" in r.stdout
    r = run_without_torch("configs/quickstart.py:B", *TINY, workdir=tmp_path / "run_B")
    assert "report:" in r.stdout


@pytest.mark.slow
@pytest.mark.gguf
def test_plan_and_solve_without_torch(tmp_path):
    r = run_without_torch("configs/quickstart.py", "--config.mode=plan", f"--config.task={TASK}", *TINY,
                          workdir=tmp_path / "plan")
    assert "Plan" in r.stdout or "n1" in r.stdout
    r = run_without_torch("configs/quickstart.py", "--config.mode=solve", f"--config.task={TASK}", *TINY,
                          workdir=tmp_path / "solve")
    assert "(srdd)" in r.stdout and "gate " in r.stdout
    r = run_without_torch("configs/quickstart.py", "--config.mode=solve", "--config.task=scicode:19", *TINY,
                          workdir=tmp_path / "solve_sc")
    assert "Task 19 (scicode)" in r.stdout
