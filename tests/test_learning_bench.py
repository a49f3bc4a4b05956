"""bench/learning.py (runner + report statistics) and bench/variance.py (Prop 3.1 estimator)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

import learning_report as lr  # noqa: E402
import variance as vb  # noqa: E402


def _run(variant, seed, rewards_iid, rewards_ood, steps=(0, 5, 10)):
    evals = [{"step": s, "iid": {"reward": ri, "node_pass": ri / 2, "task_pass": 0.0},
              "ood": {"reward": ro, "node_pass": ro / 2, "task_pass": 0.0},
              "router_entropy": 1.0, "expert_sets": {"S0+S1": 3, "S1+S2": 1}}
             for s, ri, ro in zip(steps, rewards_iid, rewards_ood)]
    return {"variant": variant, "seed": seed, "wall_s": 1.0, "evals": evals,
            "train": [{"step": 1, "skipped_within": 0.25, "reward_mean": 0.3}]}


def test_summary_deltas_curves_welch_and_headline():
    runs = [_run("A", 0, [0.30], [0.20], steps=(0,)), _run("A", 1, [0.32], [0.22], steps=(0,)),
            _run("D", 0, [0.30, 0.35, 0.45], [0.20, 0.22, 0.25]), _run("D", 1, [0.32, 0.40, 0.50], [0.22, 0.24, 0.30]),
            _run("B", 0, [0.30, 0.31, 0.33], [0.20, 0.20, 0.21]), _run("B", 1, [0.32, 0.33, 0.36], [0.22, 0.21, 0.23])]
    s = lr.summarize(runs)
    d = s["variants"]["D"]
    assert d["delta_iid"] == pytest.approx(100 * ((0.45 + 0.50) / 2 - (0.30 + 0.32) / 2))
    assert d["delta_iid_per_seed"] == {"0": pytest.approx(15.0), "1": pytest.approx(18.0)}
    assert s["steps"] == [0, 5, 10]
    assert s["variants"]["A"]["curve"]["iid"]["mean"] == pytest.approx([0.31, 0.31, 0.31])  # A: flat
    assert d["curve"]["iid"]["mean"] == pytest.approx([0.31, 0.375, 0.475])
    # Welch's t from its definition: (ma - mb) / sqrt(va/na + vb/nb), sample variances
    a, b = np.array([0.45, 0.50]), np.array([0.33, 0.36])
    t = (a.mean() - b.mean()) / math.sqrt(a.var(ddof=1) / 2 + b.var(ddof=1) / 2)
    assert s["welch_D_vs"]["B"]["iid_t"] == pytest.approx(t)
    assert 0 < s["welch_D_vs"]["B"]["iid_p"] < 1
    assert d["expert_pair_shares"] == {"S0+S1": 0.75, "S1+S2": 0.25}
    assert lr.headline(s) == "learning: D-A +16.5 points on held-out iid tasks (seeds 0 1)"
    md = lr.render_markdown(s, {"command": "x"})
    assert "| D: MoLE + HGRPO (MoRSE) | 0 1 |" in md and md.rstrip().endswith(lr.headline(s))


def test_welch_is_nan_for_a_single_seed():
    assert all(math.isnan(x) for x in lr.welch([0.4], [0.3, 0.2]))


def test_router_entropy_from_its_definition():
    p = [0.5, 0.25, 0.25, 0.0]
    want = -sum(x * math.log(x) for x in p if x > 0)
    assert lr.router_entropy([{"probs": p}, {"probs": [1, 0, 0, 0]}]) == pytest.approx(want / 2, abs=1e-9)


def test_estimator_is_the_advantage_weighted_mean_score():
    from morse_jax.rl.hgrpo import get_advantage_fn

    rewards = np.array([[1.0, 0.0, 1.0], [0.0, 0.0, 1.0]])
    grads = np.arange(2 * 3 * 2, dtype=np.float32).reshape(2, 3, 2)
    idx = np.array([[[0, 1], [1, 2]]])  # one resampling, B=2, M=2
    est, _ = vb.estimator_variance(rewards, grads, idx, get_advantage_fn("hgrpo"), normalize=False)
    u = np.array([[1.0, 0.0], [0.0, 1.0]])
    adv = u - u.mean(1, keepdims=True)  # within-route centring, Prop 3.1's unnormalised form
    g = np.stack([grads[0, [0, 1]], grads[1, [1, 2]]])
    assert est[0] == pytest.approx(np.einsum("bm,bmd->d", adv, g) / 4)
    est_f, _ = vb.estimator_variance(rewards, grads, idx, get_advantage_fn("grpo"), normalize=False)
    assert est_f[0] == pytest.approx(np.einsum("bm,bmd->d", u - u.mean(), g) / 4)


def test_hgrpo_variance_is_lower_when_routes_differ_in_quality():
    """Prop 3.1 on synthetic rollouts: route means far apart, scores independent of rewards."""
    from morse_jax.rl.hgrpo import get_advantage_fn

    rng = np.random.default_rng(0)
    rewards = np.stack([rng.binomial(1, 0.9, 16), rng.binomial(1, 0.1, 16)]).astype(float)
    grads = rng.normal(size=(2, 16, 8)).astype(np.float32)
    idx = rng.integers(0, 16, (3000, 2, 4))
    _, dh = vb.estimator_variance(rewards, grads, idx, get_advantage_fn("hgrpo"), normalize=False)
    _, df = vb.estimator_variance(rewards, grads, idx, get_advantage_fn("grpo"), normalize=False)
    ratio, lo, hi = vb.ratio_with_ci(dh[None], df[None], boots=300)
    assert lo <= ratio <= hi < 1.0


@pytest.mark.slow
def test_tiny_runner_run_end_to_end(tmp_path):
    """bench/learning.py on the embedded model, 1 step, 1 eval task per split (minutes on 2 cores)."""
    cmd = [sys.executable, str(ROOT / "bench/learning.py"), "--variants", "D", "--seeds", "0", "--steps", "1",
           "--eval-every", "1", "--eval-tasks", "1", "--workdir", str(tmp_path),
           "--set", "rollout.max_new_tokens=24", "--set", "rollout.eval_max_new_tokens=24",
           "--set", "rollout.routes=1", "--set", "rollout.candidates=2", "--set", "rollout.max_attempts=1",
           "--set", "data.tasks_per_step=1"]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=1500)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1].startswith("learning: D-A ")
    rec = json.loads((tmp_path / "learning.json").read_text())
    assert set(rec["summary"]["variants"]) == {"A", "D"}
    assert [e["step"] for e in rec["runs"][1]["evals"]] == [0, 1]
    assert (tmp_path / "learning.png").exists() and (tmp_path / "learning.md").exists()


def test_validation_split_is_the_train_tail_beyond_every_trained_task():
    """--eval-split validation: two slices from the end of the train split, and an error when the
    runs would train on them (training reads tasks_per_step tasks per step from task 0)."""
    import argparse

    import learning
    from morse_jax.tasks.pyfuncs.data import SPLIT_SIZES, make_task

    ap = argparse.ArgumentParser()
    args = argparse.Namespace(variants="D", steps=10, eval_tasks=3, set=[], config=str(ROOT / "configs/learn_cpu.py"))
    val_a, val_b = learning.validation_tasks(args, ap)
    n = SPLIT_SIZES["train"]
    assert [t.description for t in val_a] == [make_task("train", i).description for i in range(n - 3, n)]
    assert [t.description for t in val_b] == [make_task("train", i).description for i in range(n - 6, n - 3)]
    # 2 tasks per step (configs/learn_cpu.py): step n/2 - 2 would read task n - 5, inside val_b
    args.steps = n // 2 - 2
    with pytest.raises(SystemExit):
        learning.validation_tasks(args, ap)
    args.steps, args.set = 10, ["data.tasks_per_step=400"]  # 4000 tasks read: reaches the slices
    with pytest.raises(SystemExit):
        learning.validation_tasks(args, ap)


def test_records_dir_makes_a_finished_run_kept_only_with_equal_settings(tmp_path, capsys):
    """--records: a record with this invocation's settings is a kept run (copied into the run
    directory, no job built); one with other settings is not; a kept run-directory record is
    copied to the records directory."""
    import argparse

    import learning

    records = tmp_path / "records"
    args = argparse.Namespace(workdir=str(tmp_path / "work"), records=records, fresh=False, steps=20, eval_every=10,
                              eval_tasks=20, eval_split="heldout", set=[], config=str(ROOT / "configs/learn_cpu.py"))
    rec = {"variant": "B", "seed": 0, "steps": 20, "settings": learning.run_settings(args, "B"), "evals": []}
    records.mkdir()
    (records / "B_s0.json").write_text(json.dumps(rec))
    assert learning.kept_record(args, "B", 0) == rec
    assert json.loads((tmp_path / "work/B_s0/learning_run.json").read_text()) == rec
    assert learning.run_settings(args, "A")["steps"] == 0  # A never trains
    for field, value in (("eval_every", 5), ("eval_tasks", 10), ("steps", 10), ("set", ["train.lora_lr=3e-3"])):
        other = argparse.Namespace(**{**vars(args), field: value, "workdir": str(tmp_path / f"w_{field}")})
        assert learning.kept_record(other, "B", 0) is None, field
    # a legacy record (no settings) is matched on its step count; it is copied to --records
    legacy = {"variant": "C", "seed": 1, "steps": 20, "evals": []}
    (tmp_path / "work/C_s1").mkdir(parents=True)
    (tmp_path / "work/C_s1/learning_run.json").write_text(json.dumps(legacy))
    assert learning.kept_record(args, "C", 1) == legacy
    assert json.loads((records / "C_s1.json").read_text()) == legacy
    assert learning.kept_record(argparse.Namespace(**{**vars(args), "steps": 10}), "C", 1) is None


def test_an_interrupted_run_resumes_only_from_a_matching_partial_record_and_checkpoint(tmp_path, capsys):
    """resume_point: evaluations so far + wall time when the partial record's settings equal this
    invocation's and the newest checkpoint is the last evaluated step or the next chunk end;
    otherwise None (the run starts afresh)."""
    import argparse

    import jax.numpy as jnp
    import learning
    from morse_jax.checkpoint import Checkpointer

    args = argparse.Namespace(workdir=str(tmp_path), records=None, fresh=False, steps=40, eval_every=10,
                              eval_tasks=20, eval_split="heldout", set=[], config=str(ROOT / "configs/learn_cpu.py"))
    run_dir = tmp_path / "D_s1"
    run_dir.mkdir()
    assert learning.resume_point(args, "D", 1) is None  # nothing there
    evals = [{"step": 0, "iid": {"reward": 0.2}}, {"step": 10, "iid": {"reward": 0.3}}]
    partial = {"settings": learning.run_settings(args, "D"), "wall_s": 123.0, "evals": evals}
    (run_dir / learning.PARTIAL).write_text(json.dumps(partial))

    def checkpoints(*steps):
        import shutil
        shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)
        ckpt = Checkpointer(run_dir / "checkpoints", async_save=False, max_to_keep=None)
        for s in steps:
            ckpt.save(s, {"w": jnp.ones(2) * s})
        ckpt.close()

    checkpoints(10)
    assert learning.resume_point(args, "D", 1) == (evals, 123.0)
    checkpoints(10, 20)  # killed while evaluating step 20: restore 20, evaluate it
    assert learning.resume_point(args, "D", 1) == (evals, 123.0)
    checkpoints(10, 20, 30)  # step 20 never evaluated: its point cannot be recovered
    assert learning.resume_point(args, "D", 1) is None
    checkpoints(10)
    other = argparse.Namespace(**{**vars(args), "eval_every": 5})
    assert learning.resume_point(other, "D", 1) is None
    assert "other settings" in capsys.readouterr().out
    assert learning.chunk_ends(args) == [10, 20, 30, 40]
    assert learning.chunk_ends(argparse.Namespace(steps=25, eval_every=10)) == [10, 20, 25]


def test_train_records_keep_the_last_of_each_step():
    import learning

    logged = [{"step": 1, "r": 0.1, "note": "x"}, {"step": 2, "r": 0.2}, {"step": 3, "r": 0.3},
              {"step": 2, "r": 0.25}, {"step": 3, "r": 0.35}]  # steps 2-3 re-run after a resume from step 1
    assert learning.last_per_step(logged) == [{"step": 1, "r": 0.1}, {"step": 2, "r": 0.25}, {"step": 3, "r": 0.35}]
