"""The main job end to end on the embedded SmolLM2 (slow): train → eval → checkpoint → report,
resume on rerun, eval from the checkpoint, fresh start, and the solve mode on a SciCode problem."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
pytestmark = [pytest.mark.slow, pytest.mark.gguf]

TINY = ["--config.data.train_ids=('19',)", "--config.data.eval_ids=('19',)", "--config.data.tasks_per_step=1",
        "--config.rollout.routes=2", "--config.rollout.candidates=2", "--config.rollout.max_attempts=1",
        "--config.rollout.max_new_tokens=48", "--config.rollout.eval_max_new_tokens=48",
        "--config.rollout.planner_max_new_tokens=64"]


def _main(workdir: Path, *args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "morse_jax.main", "--config", "configs/quickstart.py",
           f"--config.workdir={workdir}", f"--config.data.cache_dir={workdir.parent / 'cache'}", *TINY, *args]
    r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=1800)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    return r


def _train_steps(workdir: Path) -> list[int]:
    return [json.loads(line)["step"] for line in (workdir / "metrics.jsonl").read_text().splitlines()
            if json.loads(line)["kind"] == "train"]


def test_train_resume_eval_and_fresh(tmp_path):
    wd = tmp_path / "run"
    _main(wd, "--config.train.steps=1")
    for name in ("report.md", "report.json", "config.json", "metrics.jsonl", "reward.png"):
        assert (wd / name).is_file(), name
    assert sorted(p.name for p in (wd / "checkpoints").iterdir() if p.name.isdigit()) == ["1"]
    report = json.loads((wd / "report.json").read_text())
    assert report["evals"][0]["variant"] == "D" and "step_pass" in report["evals"][0]

    r = _main(wd, "--config.train.steps=2")  # same workdir: resumes at step 1, runs step 2 only
    assert "resumed from" in r.stdout and "at step 1" in r.stdout
    assert _train_steps(wd) == [1, 2]
    assert sorted(p.name for p in (wd / "checkpoints").iterdir() if p.name.isdigit()) == ["1", "2"]

    r = _main(wd, "--config.mode=eval")
    assert "evaluating: checkpoint step 2" in r.stdout

    _main(wd, "--config.train.steps=1", "--config.fresh=True")
    assert _train_steps(wd) == [1]
    assert sorted(p.name for p in (wd / "checkpoints").iterdir() if p.name.isdigit()) == ["1"]


def test_solve_prints_dag_and_artifacts_for_a_scicode_problem(tmp_path):
    r = _main(tmp_path / "solve", "--config.mode=solve", "--config.task=scicode:19")
    out = r.stdout
    assert "Task 19 (scicode)" in out and "Plan:" in out
    assert "execute experts" in out and ("artifact:" in out or "rejected output:" in out)


def test_solve_free_text_task_runs_the_srdd_family(tmp_path):
    r = _main(tmp_path / "solve_txt", "--config.mode=solve",
              "--config.task=A command-line calculator that adds two numbers read from the arguments.")
    assert "(srdd)" in r.stdout and "Plan:" in r.stdout and "gate " in r.stdout
