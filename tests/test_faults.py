"""Faults and bad input: each costs what it must and no more, and says what happened.

* A verifier run that crashes, hangs, is killed (as by the OOM killer) or cannot even be set up
  costs only its candidate (reward 0, reason logged), never the batch.
* A kill during a metrics write leaves a cut last line: it is dropped, a resumed run has each
  step's record exactly once.
* A full disk during a checkpoint write: the error names the newest complete step, which a
  restore then returns (the partial write is skipped with a warning).
* Malformed data files fail with one line naming the file, the line and the field.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import shutil
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import numpy as np
import pytest

from morse_jax.run.metrics_log import MetricsWriter
from morse_jax.tasks.sandbox import runner as sandbox
from morse_jax.tasks.scicode import family as sc
from morse_jax.tasks.srdd import data as srdd_data, scoring as srdd_scoring

REPO = Path(__file__).resolve().parents[1]
HEADER = "def cg(A, b, x, tol):\n"


@pytest.fixture(scope="module")
def step11(tmp_path_factory):
    p = {q.problem_id: q for q in sc.load_problems("package:dev")}["1"]
    fam = sc.SciCodeFamily(sc.RebuiltTargets(tmp_path_factory.mktemp("faults-cache")),
                           limits=sc.ExecLimits(timeout_s=10.0, test_timeout_s=3.0, memory_mb=1024))
    task = sc.problem_to_task(p)
    return p, fam, task, fam.fixed_plan(task).node("1.1")


def test_verifier_worker_faults_cost_only_their_candidate(step11, monkeypatch, caplog):
    p, fam, task, nd = step11
    gold = p.step("1.1").ground_truth
    faults = {
        "crash": "import os\n" + HEADER + "    os.abort()\n",
        "hang": ("import signal, time\nsignal.signal(signal.SIGALRM, signal.SIG_IGN)\n" + HEADER +
                 "    while True:\n        time.sleep(0.01)\n"),  # ignores the per-test alarm: the run's limit ends it
        "oom_killed": "import os, signal\n" + HEADER + "    os.kill(os.getpid(), signal.SIGKILL)\n",
        "cannot_start": "# SANDBOX-SETUP-FAILS\n" + gold,
    }
    real = sandbox._execute

    def flaky(job):  # the infrastructure fails for one job (e.g. no space for its run directory)
        if "SANDBOX-SETUP-FAILS" in job.files["program.py"]:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(job)

    monkeypatch.setattr(sandbox, "_execute", flaky)
    arts = [sc.join_program(sc.gold_upstream(p, "1.1"), "1.1", code) for code in [gold, *faults.values(), gold]]
    with caplog.at_level(logging.INFO):
        res = fam.verify_many(task, nd, arts, max_workers=2)
    assert [r.reward for r in res] == [1.0, 0.0, 0.0, 0.0, 0.0, 1.0]
    assert all(r.gate for r in res)
    text = caplog.text
    assert "No space left on device" in text and "scores 0" in text  # the setup failure, logged
    assert text.count("scicode: 0/3 tests passed") == 4  # each faulty candidate's reason, logged


def test_srdd_smoke_run_that_cannot_start_fails_alone(monkeypatch):
    real = sandbox._execute
    monkeypatch.setattr(sandbox, "_execute", lambda job: (_ for _ in ()).throw(OSError("bwrap: setup failed"))
                        if "BROKEN" in job.files["main.py"] else real(job))
    out = srdd_scoring.smoke_run_many([{"main.py": "print('ok')\n"}, {"main.py": "# BROKEN\nprint('ok')\n"}],
                                      timeout_s=10.0, max_workers=2)
    assert [(o.ran, o.reason) for o in out] == [(True, "exit0"), (False, "crash")]
    assert "bwrap: setup failed" in out[1].detail


def test_metrics_line_cut_by_a_kill_is_dropped_and_resume_has_each_step_once(tmp_path, caplog):
    w = MetricsWriter(tmp_path, tensorboard=False)
    for step in (1, 2, 3):
        w.write({"reward_mean": step / 10}, step=step, kind="train")
    w.write({"step_pass": 0.5}, step=0, kind="eval")
    with (tmp_path / "metrics.jsonl").open("a") as f:
        f.write('{"kind": "train", "step": 4, "rew')  # killed in the middle of step 4's record
    with caplog.at_level(logging.WARNING):
        w2 = MetricsWriter(tmp_path, tensorboard=False)  # the restarted job
    assert "incomplete" in caplog.text
    w2.drop_after(2, "train")  # the last complete checkpoint was step 2
    for step in (3, 4):
        w2.write({"reward_mean": step / 10}, step=step, kind="train")
    assert [r["step"] for r in w2.read("train")] == [1, 2, 3, 4]
    assert [r["kind"] for r in w2.read("eval")] == ["eval"]
    (tmp_path / "metrics.jsonl").write_text('{"kind": "train", "step": 1}\nnot json\n{"kind": "train", "step": 2}\n')
    with pytest.raises(ValueError, match=r"metrics.jsonl:2: not a JSON record"):
        w2.read()


def test_checkpoint_write_failure_names_the_step_a_resume_restarts_from(tmp_path, monkeypatch):
    from morse_jax import checkpoint as ck

    state = {"w": np.arange(4.0, dtype=np.float32)}
    c = ck.Checkpointer(tmp_path, async_save=False)
    c.save(1, state, metadata={"step": 1})
    real_save = c._manager.save

    def full_disk(step, *a, **k):  # the write starts, then the disk is full
        (tmp_path / f"{step}.orbax-checkpoint-tmp-123").mkdir()
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(c._manager, "save", full_disk)
    with pytest.raises(ck.CheckpointWriteError, match="writing step 2 .* newest complete checkpoint is step 1"):
        c.save(2, {"w": state["w"] + 1}, metadata={"step": 2})
    monkeypatch.setattr(c._manager, "save", real_save)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        restored = ck.Checkpointer(tmp_path).restore_latest_valid(state)
    assert restored.step == 1 and np.array_equal(restored.state["w"], state["w"])
    assert any("incomplete write" in str(x.message) for x in caught)


@pytest.mark.slow
@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None, reason="needs root to mount a small tmpfs")
def test_real_disk_full_during_checkpoint_write(tmp_path):
    """~20 s: a 2.5 MB tmpfs fills up while orbax writes step 2 (real ENOSPC, async save)."""
    script = textwrap.dedent("""
        import sys, warnings, numpy as np
        from morse_jax.checkpoint import Checkpointer, CheckpointWriteError
        d = sys.argv[1]
        state = lambda v: {"w": np.random.default_rng(v).random(400_000, dtype=np.float32)}
        c = Checkpointer(d)
        c.save(1, state(1), metadata={"step": 1}); c.wait()
        try:
            c.save(2, state(2), metadata={"step": 2}); c.wait()
            print("RESULT saved")
        except CheckpointWriteError as e:
            print("RESULT", e)
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            r = Checkpointer(d).restore_latest_valid(state(0))
        ok = np.array_equal(r.state["w"], state(1)["w"])
        print("RESTORED", r.step, ok, any("incomplete write" in str(x.message) for x in w))
    """)
    (tmp_path / "df.py").write_text(script)
    mnt = tmp_path / "small"
    mnt.mkdir()
    cmd = (f"mount -t tmpfs -o size=2500k tmpfs {mnt} && PYTHONPATH={REPO} {sys.executable} {tmp_path / 'df.py'} "
           f"{mnt / 'ck'}")
    r = subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-c", cmd], capture_output=True,
                       text=True, timeout=600)
    if "mount:" in r.stderr and r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr[-200:]}")
    lines = {ln.split(" ", 1)[0]: ln for ln in r.stdout.splitlines() if ln.startswith(("RESULT", "RESTORED"))}
    assert "newest complete checkpoint is step 1" in lines.get("RESULT", ""), r.stdout + r.stderr[-3000:]
    assert lines.get("RESTORED") == "RESTORED 1 True True", r.stdout + r.stderr[-3000:]


# ------------------------------------------------------------------------------ malformed data


_PROBLEM = {"problem_id": "1", "problem_description_main": "d", "required_dependencies": "",
            "sub_steps": [{"step_number": "1.1", "step_description_prompt": "s", "function_header": "def f(x):",
                           "test_cases": ["assert True"]}]}


def _jsonl(*recs) -> bytes:
    return b"".join((r if isinstance(r, bytes) else json.dumps(r).encode()) + b"\n" for r in recs)


@pytest.mark.parametrize("content, where, field", [
    (_jsonl(_PROBLEM)[:-20], ":1", "cut short"),  # truncated line
    (_jsonl(_PROBLEM, {**_PROBLEM, "problem_id": "2", "problem_description_main": 5}), ":2",
     "'problem_description_main' must be str"),  # wrong type
    (_jsonl({k: v for k, v in _PROBLEM.items() if k != "sub_steps"}), ":1", "missing field 'sub_steps'"),
    (_jsonl(_PROBLEM, _PROBLEM), ":2", "duplicate problem_id '1'"),
    (_jsonl(_PROBLEM) + b'{"problem_id": "\xff"}\n', ":2", "not UTF-8"),  # bad encoding
])
def test_malformed_scicode_jsonl_fails_with_file_line_and_field(tmp_path, content, where, field):
    path = tmp_path / "problems.jsonl"
    path.write_bytes(content)
    with pytest.raises(sc.SciCodeDataError) as e:
        sc.load_problems(path, supplied_code_dir=tmp_path)
    msg = str(e.value)
    assert "\n" not in msg and f"{path}{where}" in msg and field in msg, msg


@pytest.mark.parametrize("content, where, field", [
    (b'Name,Description,Category\nA,"an app,Tools\n', "line 2", "malformed CSV"),  # truncated quoted line
    (b"Name,Description,Category\nA,an app,Tools\nB,a game\n", "record 2", "'Category' missing"),
    (b"Name,Description,Category\nA,,Tools\n", "record 1", "field 'Description' is empty"),
    (b"Name,Description,Category\nA,an app,Tools\nB,caf\xe9,Tools\n", "line 3", "not UTF-8"),
    (b"Name,Description\nA,an app\n", "header", "expected ['Name', 'Description', 'Category']"),
])
def test_malformed_srdd_csv_fails_with_file_line_and_field(tmp_path, content, where, field):
    path = tmp_path / "split.csv"
    path.write_bytes(content)
    with pytest.raises(ValueError) as e:
        srdd_data.load_srdd(path)
    msg = str(e.value)
    assert "\n" not in msg and str(path) in msg and where in msg and field in msg, msg


# ------------------------------------------------------------------------------ fuzzed planner outputs

hypothesis = pytest.importorskip("hypothesis")
st = hypothesis.strategies
_KEYS = st.sampled_from(["nodes", "steps", "subtasks", "id", "title", "description", "depends_on", "deps",
                         "parents", "role"])
_LEAF = st.none() | st.booleans() | st.integers(-3, 10**20) | st.floats() | st.text(max_size=12)
_JSONISH = st.recursive(_LEAF, lambda c: st.lists(c, max_size=5) | st.dictionaries(_KEYS | st.text(max_size=6), c,
                                                                                   max_size=5), max_leaves=25)
_NODE = st.fixed_dictionaries({"id": st.text(max_size=4) | st.integers(0, 5) | st.none(),
                               "description": st.text(max_size=20) | st.integers() | st.none()},
                              optional={"depends_on": st.lists(st.text(max_size=4) | st.integers(0, 5), max_size=4)
                                        | st.text(max_size=4) | st.none(), "title": _LEAF})
_NODES = st.lists(_NODE, max_size=8).map(lambda ns: {"nodes": ns})


@st.composite
def _planner_output(draw):
    obj = draw(_NODES | _JSONISH)
    text = json.dumps(obj, allow_nan=True)
    text = draw(st.sampled_from(["{}", "```json\n{}\n```", "Here is the plan: {} Done.", "{}{}", "[{}]"])).format(
        text, text)
    if draw(st.booleans()):
        text = text[:draw(st.integers(0, len(text)))]  # cut by the token limit
    return draw(st.just(text) | st.text(max_size=200))


@hypothesis.settings(max_examples=120, deadline=None, derandomize=True,
                     suppress_health_check=list(hypothesis.HealthCheck))
@hypothesis.given(outputs=st.lists(_planner_output(), min_size=2, max_size=2))
def test_fuzzed_planner_outputs_never_crash_the_orchestrator(outputs):
    """Whatever the planner writes, the orchestrator plans (repairing, re-planning or falling
    back to one node, with a note), and runs the plan."""
    import networkx as nx
    from test_orchestrator import Harness, task

    answers = iter(outputs)
    h = Harness(planner_script=lambda text, info: next(answers))
    res = h.orchestrator(mode="eval", max_replans=1).run([task("A")])
    plan = res.traces["A"].plan
    ids = [n.id for n in plan.nodes]
    assert ids and len(set(ids)) == len(ids) and nx.is_directed_acyclic_graph(plan.graph())
    assert all(n.description.strip() for n in plan.nodes)
    if res.counters.plan_fallbacks:
        assert any("fell back" in r for r in plan.repairs)  # the fallback is recorded (and logged)
    assert res.traces["A"].all_passed  # every node of whatever plan came out was executed


@hypothesis.settings(max_examples=120, deadline=None, derandomize=True,
                     suppress_health_check=list(hypothesis.HealthCheck))
@hypothesis.given(text=_planner_output())
def test_fuzzed_dependency_inference_keeps_the_fixed_steps(text):
    """SciCode's DAG inference over fixed steps: any reply gives a DAG over exactly those steps."""
    import networkx as nx
    from morse_jax.tomas.planner.fixed import parse_inferred_dependencies

    steps = [("1.1", "first"), ("1.2", "second"), ("1.3", "third")]
    plan = parse_inferred_dependencies(text, steps)
    assert [n.id for n in plan.nodes] == ["1.1", "1.2", "1.3"] and nx.is_directed_acyclic_graph(plan.graph())


# ------------------------------------------------------------------------------ kill -9 and resume

_TINY_JOB = ["--config.data.train_ids=('19',)", "--config.data.eval_ids=('19',)", "--config.data.tasks_per_step=1",
             "--config.rollout.routes=2", "--config.rollout.candidates=2", "--config.rollout.max_attempts=1",
             "--config.rollout.max_new_tokens=48", "--config.rollout.eval_max_new_tokens=48",
             "--config.rollout.planner_max_new_tokens=64", "--config.train.steps=3",
             "--config.train.checkpoint_every=1", "--config.train.keep_checkpoints=5"]


@pytest.mark.slow
@pytest.mark.gguf
def test_kill9_at_each_phase_resumes_from_the_last_complete_checkpoint(tmp_path):
    """~6 job starts on the embedded SmolLM2: the job is killed (SIGKILL) during sampling,
    verification, after the update, after the metrics record and during the checkpoint write;
    each rerun resumes from the newest complete checkpoint, and the finished run has exactly one
    metrics record per step."""
    from morse_jax.run.faults import KILL_AT_ENV

    wd = tmp_path / "run"

    def job(kill_at: str | None) -> subprocess.CompletedProcess:
        env = {k: v for k, v in os.environ.items() if k != KILL_AT_ENV}
        if kill_at:
            env[KILL_AT_ENV] = kill_at
        cmd = [sys.executable, "-m", "morse_jax.main", "--config", "configs/quickstart.py", f"--config.workdir={wd}",
               f"--config.data.cache_dir={tmp_path / 'cache'}", *_TINY_JOB]
        return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=3600)

    def complete_steps() -> list[int]:
        d = wd / "checkpoints"
        return sorted(int(p.name) for p in d.iterdir() if p.name.isdigit()) if d.is_dir() else []

    chain = [("sampling:1", []), ("verification:2", [1]), ("update:2", [1]), ("metrics:2", [1]),
             ("checkpoint:3", [1, 2]), (None, [1, 2, 3])]
    for kill_at, want_steps in chain:
        r = job(kill_at)
        if kill_at is None:
            assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
        else:
            assert r.returncode == -9, (kill_at, r.returncode, r.stderr[-4000:])
        done = complete_steps()
        # a write killed at step 3 may or may not have been renamed before the kill
        assert done == want_steps or (kill_at == "checkpoint:3" and done == [1, 2, 3]), (kill_at, done)
    assert "resumed from" in r.stdout
    recs = [json.loads(line) for line in (wd / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in recs if x["kind"] == "train"] == [1, 2, 3]
