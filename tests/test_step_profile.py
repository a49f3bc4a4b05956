"""The per-step time profile (run/profile.py): exclusive phases that add up to the wall, compile
time from jax's compile events, the sampler's prefill phase, the step_time records of a training
run and report.md's breakdown table."""

from __future__ import annotations

import json
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from morse_jax.run.profile import PHASES, StepProfile, breakdown
from morse_jax.run.report import write_report


class FakeClock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t

    def tick(self, s):
        self.t += s


def fake_profile(cpu=(0.0, 0.0), cores=2):
    clock = FakeClock()
    cpu_now = [(0.0, 0.0)]
    p = StepProfile(clock=clock, cpu=lambda: cpu_now[0], cores=cores, compile_events=False)
    return p, clock, lambda own, child: cpu_now.__setitem__(0, (own, child))


def test_nested_phases_are_exclusive_and_parts_add_up_to_the_wall():
    p, clock, set_cpu = fake_profile()
    p.start()
    clock.tick(1.0)  # outside any phase: other
    with p.phase("plan"):
        clock.tick(2.0)
        with p.phase("decode"):
            clock.tick(3.0)
            with p.phase("prefill"):
                clock.tick(0.5)
            p.add("compile", 1.5)  # measured elsewhere, spent inside decode
            clock.tick(1.5)
        clock.tick(0.25)
    with p.phase("update"):
        clock.tick(4.0)
    set_cpu(10.0, 3.0)
    p.stop()
    # by the definition of each phase's exclusive time
    assert p.seconds["plan"] == pytest.approx(2.25)
    assert p.seconds["decode"] == pytest.approx(3.0)
    assert p.seconds["prefill"] == pytest.approx(0.5)
    assert p.seconds["compile"] == pytest.approx(1.5)
    assert p.seconds["update"] == pytest.approx(4.0)
    assert p.wall == pytest.approx(12.25)  # the clock's ticks; add() is time inside decode
    assert p.other == pytest.approx(1.0)
    rec = p.record()
    assert sum(rec[f"time/{k}_s"] for k in (*PHASES, "other")) == pytest.approx(rec["time/wall_s"])
    assert rec["time/cpu_s"] == 10.0 and rec["time/child_cpu_s"] == 3.0
    assert rec["time/idle_share"] == pytest.approx(1 - 13.0 / (12.25 * 2))
    line = p.line()
    assert line.startswith("12.2 s = update 4.0 + decode 3.0") and "idle 47% of 2 cores" in line


def test_repeated_phases_accumulate_and_unknown_names_are_refused():
    p, clock, _ = fake_profile()
    p.start()
    for _ in range(3):
        with p.phase("verify"):
            clock.tick(0.5)
    p.stop()
    assert p.seconds["verify"] == pytest.approx(1.5) and p.other == pytest.approx(0.0)
    with pytest.raises(ValueError, match="unknown phase"):
        with p.phase("sampling"):
            pass


def test_other_threads_do_not_record():
    """A phase opened on a worker thread would corrupt the main thread's stack: it is a no-op."""
    p, clock, _ = fake_profile()
    p.start()
    with p.phase("decode"):
        def worker():
            with p.phase("verify"):
                clock.tick(2.0)
            p.add("compile", 5.0)

        t = threading.Thread(target=worker)
        t.start()
        t.join()
    p.stop()
    assert p.seconds["verify"] == 0.0 and p.seconds["compile"] == 0.0
    assert p.seconds["decode"] == pytest.approx(2.0)


def test_idle_share_is_clamped_and_stop_checks_its_state():
    p, clock, set_cpu = fake_profile(cores=1)
    p.start()
    clock.tick(1.0)
    set_cpu(3.0, 0.0)  # more CPU than wall x cores (threads of a process before affinity changed)
    p.stop()
    assert p.idle_share == 0.0
    q, _, _ = fake_profile()
    with pytest.raises(RuntimeError, match="before start"):
        q.stop()
    q.start()
    with pytest.raises(RuntimeError, match="inside phase"):
        with q.phase("plan"):
            q.stop()


def test_compile_time_comes_from_jax_compile_events_and_leaves_the_enclosing_phase():
    p = StepProfile().start()
    with p.phase("update"):
        f = jax.jit(lambda x: jnp.tanh(x) * 3 + x.sum())
        f(jnp.ones((7, 13), jnp.float32)).block_until_ready()  # a shape nothing else compiled
    p.stop()
    assert p.seconds["compile"] > 0
    assert p.seconds["update"] >= 0 and p.other >= -1e-6
    assert sum(p.seconds.values()) <= p.wall + 1e-6
    q = StepProfile().start()  # after stop, compiles go to the running profile only
    g = jax.jit(lambda x: x * 5 - 1)
    g(jnp.ones((3, 11), jnp.float32)).block_until_ready()
    q.stop()
    assert q.seconds["compile"] > 0 and p.seconds["compile"] < p.wall + 1e-6


def test_sampler_times_its_prefill_inside_the_callers_decode_phase():
    from morse_jax.models import Backbone, ModelConfig, init_params
    from morse_jax.sampling.sampler import Request, Sampler, SamplerConfig

    cfg = ModelConfig(family="llama", vocab_size=64, hidden_size=16, intermediate_size=32, num_layers=2, num_heads=2,
                      num_kv_heads=1, head_dim=8)
    sampler = Sampler(Backbone(cfg, init_params(jax.random.PRNGKey(0), cfg), tokenizer=None), None,
                      SamplerConfig(batch_buckets=(2,), prompt_buckets=(8,), new_token_buckets=(4,), max_batch=2,
                                    chunk=4, max_active=1, cpu_kernels="off"))
    reqs = [Request(prompt_ids=[1, 2, 3], max_new_tokens=4, temperature=0.0)] * 2
    first = StepProfile().start()
    with first.phase("decode"):
        sampler.generate(None, reqs, key=jax.random.PRNGKey(0), profile=first)
    first.stop()
    assert sampler.compile_count == 2 and first.seconds["compile"] > 0
    second = StepProfile().start()
    with second.phase("decode"):
        sampler.generate(None, reqs, key=jax.random.PRNGKey(1), profile=second)
    second.stop()
    assert sampler.compile_count == 2  # same buckets: nothing compiled
    assert second.seconds["prefill"] > 0 and second.seconds["decode"] > 0
    for p in (first, second):
        assert all(s >= 0 for s in p.seconds.values()) and p.other >= -1e-6
    sampler.generate(None, reqs, key=jax.random.PRNGKey(2))  # without a profile: unchanged behaviour


def _step_record(**phases):
    rec = {f"time/{p}_s": 0.0 for p in (*PHASES, "other")}
    rec.update({f"time/{k}_s": v for k, v in phases.items()})
    rec["time/wall_s"] = sum(phases.values())
    rec.update({"time/idle_share": 0.25, "time/cores": 2.0})
    return rec


def test_breakdown_and_report_table(tmp_path):
    recs = [_step_record(decode=6.0, update=2.0, other=0.0), _step_record(decode=2.0, update=2.0, other=4.0)]
    rows = {p: (s, share) for p, s, share in breakdown(recs)}
    assert rows["decode"] == (pytest.approx(4.0), pytest.approx(0.5))
    assert rows["other"] == (pytest.approx(2.0), pytest.approx(0.25))
    assert sum(share for _, share in rows.values()) == pytest.approx(1.0)
    md = write_report(tmp_path, family="pyfuncs", evals=[{"variant": "D"}], step_times=recs).read_text()
    assert "## Where a step's time goes" in md
    assert "| decode | 4.00 | 50.0 % |" in md and "| **wall** | 8.00 | 100 % |" in md
    assert "Idle share of the 2 cores: 25.0 %" in md
    assert json.loads((tmp_path / "report.json").read_text())["step_times"] == recs
    assert "Where a step" not in write_report(tmp_path, family="pyfuncs", evals=[{"variant": "D"}]).read_text()


@pytest.mark.slow
@pytest.mark.gguf
def test_training_steps_log_a_profile_that_adds_up(tmp_path, capsys):
    """Two quickstart steps on tiny budgets: each step_time record has every phase, none
    negative, parts adding up to the wall within 5 %, the model phases non-zero, one progress
    line per step; the step walls fit in the time train() took."""
    import time

    from morse_jax.config.validate import validate_config
    from morse_jax.run.build import Job
    from morse_jax.run.metrics_log import MetricsWriter
    from morse_jax.run.train_loop import train

    from test_main_job import quickstart_config

    cfg = quickstart_config("D")
    cfg.workdir, cfg.data.cache_dir = str(tmp_path / "run"), str(tmp_path / "cache")
    cfg.data.train_ids, cfg.data.eval_ids, cfg.data.tasks_per_step = ("19",), ("19",), 1
    cfg.rollout.routes, cfg.rollout.candidates, cfg.rollout.max_attempts = 2, 1, 1
    cfg.rollout.max_new_tokens, cfg.rollout.planner_max_new_tokens, cfg.train.steps = 16, 16, 2
    validate_config(cfg)
    job = Job(cfg)
    writer = MetricsWriter(tmp_path / "run", tensorboard=False)
    t0 = time.perf_counter()
    train(job, writer)
    total = time.perf_counter() - t0
    recs = writer.read("step_time")
    assert [r["step"] for r in recs] == [1, 2]
    for r in recs:
        wall = r["time/wall_s"]
        parts = [r[f"time/{p}_s"] for p in (*PHASES, "other")]
        assert all(x >= -0.05 * wall for x in parts), r  # exclusive: nothing counted twice
        assert abs(sum(parts) - wall) <= 0.05 * wall
        assert r["time/decode_s"] > 0 and r["time/prefill_s"] > 0 and r["time/route_s"] > 0
        assert r["time/update_s"] > 0 and r["time/checkpoint_s"] > 0 and r["time/verify_s"] > 0
        assert 0.0 <= r["time/idle_share"] <= 1.0 and r["time/cpu_s"] > 0
    assert recs[0]["time/compile_s"] > 0  # the first step compiles the sampler and the update
    assert sum(r["time/wall_s"] for r in recs) <= total
    out = capsys.readouterr().out
    assert "step 1: " in out and "step 2: " in out and "idle" in out
    md = write_report(tmp_path / "run", family="scicode", evals=[{"variant": "D"}], step_times=recs).read_text()
    assert "| decode |" in md and "| other |" in md
    assert np.isfinite([r["time/wall_s"] for r in recs]).all()


def test_bench_step_table_compares_sides_and_tolerates_a_peer_without_the_profile():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "bench" / "step.py"
    spec = importlib.util.spec_from_file_location("bench_step", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    recs = [dict(_step_record(decode=6.0, update=2.0), step=1), dict(_step_record(decode=2.0, update=2.0), step=2)]
    this = {"step_time": recs, "record_walls": [8.0, 4.0],
            "train": [{"step": 1, "rollout_s": 6.0, "update_s": 2.0}, {"step": 2, "rollout_s": 2.0, "update_s": 2.0}]}
    peer = {"step_time": [], "record_walls": [12.0, 12.0],  # a checkout that predates the profile
            "train": [{"step": 1, "rollout_s": 9.0, "update_s": 3.0}, {"step": 2, "rollout_s": 9.0, "update_s": 3.0}]}
    s_this, s_peer = bench.summary([this]), bench.summary([peer])
    assert s_this["decode"] == pytest.approx(4.0) and s_this["wall, steps 2+"] == pytest.approx(4.0)
    assert s_peer["decode"] is None and s_peer["wall (records)"] == pytest.approx(12.0)
    out = bench.table({"this": s_this, "peer": s_peer})
    rows = {line[:22].strip(): line[22:] for line in out.splitlines()[1:]}
    assert rows["wall (records)"].split()[-1] == "2.00x"  # 12 / 6
    assert rows["decode"].split()[-1] == "-"  # no ratio where the peer has no value
