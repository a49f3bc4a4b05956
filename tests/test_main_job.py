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


def quickstart_config(variant: str):
    """``configs/quickstart.py``'s config for ``variant``, loaded from its file as ``main`` does."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("quickstart", REPO / "configs" / "quickstart.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.get_config(variant)


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


# --------------------------------------------------------------------------- paper configs, tiny models

S, F = "sliding_attention", "full_attention"
# One tiny random model per backbone family of the paper configs, with the embedded model's
# tokenizer (chat template included) and 9 layers so L_adapt = 8 leaves a frozen prefix.
TINY_FAMILIES = {
    "qwen3_4b": ("Qwen3Config", dict(head_dim=8)),
    "llama31_8b": ("LlamaConfig", {}),
    "gemma4_31b": ("Gemma4TextConfig", dict(head_dim=8, global_head_dim=16, num_global_key_value_heads=1,
                                            attention_k_eq_v=True, hidden_size_per_layer_input=0,
                                            sliding_window=4, layer_types=[S, F] * 4 + [F],
                                            final_logit_softcapping=5.0)),
}


def tiny_model_dir(root: Path, backbone: str) -> Path:
    """A random HF checkpoint of ``backbone``'s family (safetensors + tokenizer files)."""
    import warnings

    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    from morse_jax.models import gguf_meta
    from morse_jax.models.loading import embedded_model_path

    out = root / f"tiny_{backbone}"
    if (out / "config.json").is_file():
        return out
    tok = gguf_meta.tokenizer(embedded_model_path())
    cls, extra = TINY_FAMILIES[backbone]
    cfg = getattr(transformers, cls)(vocab_size=len(tok), hidden_size=32, intermediate_size=48, num_hidden_layers=9,
                                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                                     tie_word_embeddings=True, **extra)
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(out)
    tok.save_pretrained(out)
    return out


PAPER_SMOKE = ["--config.train.epochs=0", "--config.train.steps=1", "--config.data.tasks_per_step=1",
               "--config.rollout.routes=2", "--config.rollout.candidates=2", "--config.rollout.max_attempts=1",
               "--config.rollout.max_new_tokens=16", "--config.rollout.eval_max_new_tokens=16",
               "--config.rollout.planner_max_new_tokens=16", "--config.rollout.max_replans=0",
               "--config.model.dtype=float32"]


@pytest.mark.parametrize("config", ["qwen3_4b_srdd", "qwen3_4b_scicode", "llama31_8b_srdd", "llama31_8b_scicode",
                                    "gemma4_31b_srdd", "gemma4_31b_scicode"])
def test_paper_config_trains_and_evaluates_on_a_tiny_model_of_its_family(tmp_path_factory, config):
    """Each paper config runs (train step, eval, report) on a random model of its backbone family
    with every App. E / App. I setting except the budgets (tokens, steps, B, M) and the data
    (SciCode: a scorable development problem; the MoRSE splits need test_data.h5)."""
    backbone, bench = config.rsplit("_", 1)
    model = tiny_model_dir(tmp_path_factory.getbasetemp(), backbone)
    wd = tmp_path_factory.mktemp(config)
    data = (["--config.data.train=package:dev", "--config.data.eval=package:dev",
             "--config.data.train_ids=('19',)", "--config.data.eval_ids=('19',)"] if bench == "scicode" else
            ["--config.data.max_train_tasks=1", "--config.data.max_eval_tasks=1"])
    cmd = [sys.executable, "-m", "morse_jax.main", "--config", f"configs/{config}.py", f"--config.model.path={model}",
           f"--config.workdir={wd}", f"--config.data.cache_dir={wd / 'cache'}", *PAPER_SMOKE, *data]
    r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=1800)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    assert "train split" in r.stdout and "report:" in r.stdout
    assert [s for s in _train_steps(wd)] == [1]


def test_single_agent_lora_rl_trains(tmp_path):
    """Table 4 row 2 (variant single_agent_rl): no planner, one LoRA, GRPO over its B x M
    candidates; one training step changes the LoRA. A stand-in verifier alternates rewards 0 / 1
    so the groups have reward variance (the 135M model rarely passes a test). On SciCode the single
    agent makes one call per step, in order (SciCode's protocol; the tests score steps)."""
    import itertools

    import jax
    import numpy as np

    from morse_jax.config.validate import validate_config
    from morse_jax.run.build import Job
    from morse_jax.run.metrics_log import MetricsWriter
    from morse_jax.run.train_loop import train
    from morse_jax.tasks.base import VerifyResult

    cfg = quickstart_config("single_agent_rl")
    cfg.workdir, cfg.data.cache_dir = str(tmp_path / "run"), str(tmp_path / "cache")
    cfg.data.train_ids, cfg.data.eval_ids, cfg.data.tasks_per_step = ("19",), ("19",), 1
    cfg.rollout.routes, cfg.rollout.candidates, cfg.rollout.max_attempts = 2, 2, 1
    cfg.rollout.max_new_tokens, cfg.train.steps = 16, 1
    validate_config(cfg)
    job = Job(cfg)
    assert job.trains and job.spec.rank == 24 and job.spec.num_experts == 1

    calls, real = itertools.count(), job.family

    class AlternatingReward:
        name = real.name

        def __getattr__(self, attr):
            return getattr(real, attr)

        def verify(self, task, node, artifact):
            return VerifyResult(gate=True, reward=float(next(calls) % 2))

    job.family = AlternatingReward()
    before = [np.asarray(x).copy() for x in jax.tree.leaves(job.trainable["bank"])]
    last = train(job, MetricsWriter(tmp_path / "run", enabled=False))
    steps = [s.step_id for s in job.train_tasks[0].payload.testable_steps]
    assert last["nodes_total"] == len(steps)
    assert last["sequences"] >= 4 and last["sequences"] % 4 == 0  # B x M candidates per call, single LoRA
    after = [np.asarray(x) for x in jax.tree.leaves(job.trainable["bank"])]
    assert any(not np.array_equal(a, b) for a, b in zip(before, after))
