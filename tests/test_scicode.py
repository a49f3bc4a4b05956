"""SciCode family: loaders, gate, target rebuild + cache, h5 targets, verifier, metrics.

Steps that execute code go through the real sandbox. The default set only runs fast steps
(1.1, 10.3, 10.7, 29.3 ...); the full ground-truth check over all 15 development problems is
``slow`` (it includes 51.4, 47.4 and 10.11).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest

from morse_jax.tasks.scicode import family as sc
from morse_jax.tasks.base import Task
from morse_jax.tasks.metrics import StepResult, mean_step_pass, problem_pass, scicode_metrics, step_pass

SPLIT_DIR = Path(__file__).resolve().parents[2] / "shared" / "data" / "morse-reference" / "scicode" / "data"
FAST = sc.ExecLimits(timeout_s=60.0, test_timeout_s=30.0)


@pytest.fixture(scope="module")
def dev():
    return {p.problem_id: p for p in sc.load_problems("package:dev")}


@pytest.fixture(scope="module")
def targets(tmp_path_factory):
    return sc.RebuiltTargets(tmp_path_factory.mktemp("scicode-cache"))


@pytest.fixture(scope="module")
def family(targets):
    return sc.SciCodeFamily(targets, limits=FAST)


def gold_artifact(problem, step_id, code=None):
    step = problem.step(step_id)
    return sc.join_program(sc.gold_upstream(problem, step_id), step_id,
                           step.ground_truth if code is None else code)


def node(problem, step_id):
    return sc.SciCodeFamily(None).fixed_plan(sc.problem_to_task(problem)).node(step_id)


# ------------------------------------------------------------------------------ loaders


def test_package_dev_counts(dev):
    s = sc.summarize(list(dev.values()))
    assert s == {"problems": 15, "steps": 50, "tests": 167, "problems_with_ground_truth": 15}
    assert sorted(dev, key=int) == ["1", "3", "4", "6", "7", "10", "19", "29", "38", "44", "47", "49",
                                    "51", "70", "78"]
    assert [st.step_id for st in dev["10"].steps] == [f"10.{i}" for i in range(1, 12)]


def test_package_all_counts_and_supplied_steps():
    probs = {p.problem_id: p for p in sc.load_problems("package:all")}
    s = sc.summarize(list(probs.values()), sc.RebuiltTargets("/nonexistent-never-written"))
    # 65 + 15 problems, 288 + 50 = 338 testable steps (SciCode's count); no ground truth here.
    assert (s["problems"], s["steps"], s["tests"], s["problems_with_ground_truth"]) == (65, 288, 915, 0)
    assert s["scorable_steps"] == 0
    for sid in ("13.6", "62.1", "76.3"):
        step = probs[sid.split(".")[0]].step(sid)
        assert not step.testable and ("def " in step.supplied_code or "class " in step.supplied_code)
    plan = sc.SciCodeFamily(None).fixed_plan(sc.problem_to_task(probs["13"]))
    ids = [n.id for n in plan.nodes]
    assert "13.6" not in ids and plan.node("13.7").depends_on == ("13.5",)


@pytest.mark.skipif(not SPLIT_DIR.is_dir(), reason=f"MoRSE reference splits not found at {SPLIT_DIR} "
                    "(the checkout's ../shared/data, as in CI)")
def test_morse_splits():
    got = {name: sc.load_split(name, SPLIT_DIR) for name in sc.SPLITS}
    assert {k: len(v) for k, v in got.items()} == {"morse_train": 60, "morse_test": 20,
                                                   "ood_train": 64, "ood_test": 16}
    assert [p.problem_id for p in got["morse_test"]] == [
        "7", "12", "13", "14", "18", "24", "28", "30", "37", "39", "44", "45", "47", "53", "54", "58",
        "62", "70", "74", "77"]
    for a, b in (("morse_train", "morse_test"), ("ood_train", "ood_test")):
        ids_a, ids_b = {p.problem_id for p in got[a]}, {p.problem_id for p in got[b]}
        assert not ids_a & ids_b and len(ids_a | ids_b) == 80
    assert sum(len(p.testable_steps) for p in got["morse_train"] + got["morse_test"]) == 338


@pytest.mark.parametrize("line, field", [
    ('{"problem_id": "1"', "invalid JSON"),
    ('{"problem_id": "1", "problem_description_main": "d", "required_dependencies": "", "sub_steps": []}',
     "'sub_steps' is empty"),
    ('{"problem_id": "1", "required_dependencies": "", "sub_steps": [{}]}', "'problem_description_main'"),
    ('{"problem_id": "1", "problem_description_main": "d", "required_dependencies": "", "sub_steps": '
     '[{"step_number": "1.1", "step_description_prompt": "s", "function_header": "def f(x):", '
     '"test_cases": "assert True"}]}', "'test_cases' must be list"),
    ('{"problem_id": "1", "problem_description_main": "d", "required_dependencies": "", "sub_steps": '
     '[{"step_number": "1.1", "step_description_prompt": "s", "function_header": "x = 1", '
     '"test_cases": ["assert True"]}]}', "'function_header'"),
    ('{"problem_id": "1", "problem_description_main": "d", "required_dependencies": "", "sub_steps": '
     '[{"step_number": "1.1", "step_description_prompt": "s", "function_header": "def f(x):", '
     '"test_cases": []}]}', "no test_cases and no supplied code"),
])
def test_loader_rejects_bad_records(tmp_path, line, field):
    path = tmp_path / "bad.jsonl"
    path.write_text(line + "\n")
    with pytest.raises(sc.SciCodeDataError, match=field) as e:
        sc.load_problems(path, supplied_code_dir=tmp_path)
    assert str(path) in str(e.value)


def test_loader_rejects_bad_source_and_duplicates(tmp_path):
    with pytest.raises(sc.SciCodeDataError, match="unknown source"):
        sc.load_problems("package:nope")
    with pytest.raises(sc.SciCodeDataError, match="not found"):
        sc.load_problems(tmp_path / "missing.jsonl")
    with pytest.raises(sc.SciCodeDataError, match="unknown SciCode split"):
        sc.split_path("train", tmp_path)
    rec = json.loads(next(open(sc.package_data_dir() / "problems_dev.jsonl")))
    (tmp_path / "dup.jsonl").write_text((json.dumps(rec) + "\n") * 2)
    with pytest.raises(sc.SciCodeDataError, match="duplicate problem_id"):
        sc.load_problems(tmp_path / "dup.jsonl")


# ------------------------------------------------------------------------------ code handling


def test_extract_code_variants():
    assert sc.extract_code("text\n```python\ndef f():\n    return 1\n```\nmore") == "def f():\n    return 1"
    two = "```python\nimport math\n```\nand\n```python\ndef f():\n    return math.pi\n```"
    assert sc.extract_code(two, "f") == "import math\n\ndef f():\n    return math.pi"
    assert sc.extract_code("```python\ndef f():\n    return (1\n", "f") == "def f():\n    return (1"
    assert sc.extract_code("def f():\n    return 2\n") == "def f():\n    return 2"
    assert sc.extract_code("```bash\nls\n```\n```\ndef g(): pass\n```") == "def g(): pass"


def test_gate_diagnostics(dev):
    header = dev["1"].step("1.1").function_header  # def cg(A, b, x, tol):
    assert sc.check_gate(dev["1"].step("1.1").ground_truth, header) is None
    d = sc.check_gate("def cg(A, b, x, tol:\n    return x", header)
    assert d.startswith("the code does not parse: SyntaxError") and "line 1" in d
    d = sc.check_gate("def solve(A, b):\n    return b\n", header)
    assert "`def cg`" in d and "solve" in d
    d = sc.check_gate("def cg(A, b):\n    return b\n", header)
    assert "parameters (A, b, x, tol)" in d
    assert sc.check_gate("def cg(A, b, x, tol, maxiter=10):\n    return x\n", header) is None
    assert "no implementation" in sc.check_gate("def cg(A, b, x, tol):\n    '''doc'''\n    pass\n", header)
    assert "no Python code" in sc.check_gate("  \n", header)
    cls = "class Box:\n    def __init__(self, n):\n        '''doc'''\n    def volume(self):\n        '''v'''"
    assert sc.check_gate("class Box:\n    def __init__(self, n):\n        self.n = n\n"
                         "    def volume(self):\n        return self.n ** 3\n", cls) is None
    assert "method `volume`" in sc.check_gate("class Box:\n    def __init__(self, n):\n        self.n = n\n", cls)
    assert "`class Box`" in sc.check_gate("def Box(n):\n    return n\n", cls)


def _decide(test, events, target, error=""):
    """check_test on hand-made recorded events (what the sandbox half would report)."""
    return sc.check_test(sc.split_test(test, "t"), sc.sandbox_record.CaseRecord(error, tuple(events)), target)


def test_split_test_keeps_values_in_the_sandbox_and_comparisons_here():
    s = sc.split_test("x = 1\nassert np.allclose(f(x), target)", "t")
    assert "__record__(0, f(x))" in s.sandbox_code and "assert" not in s.sandbox_code
    assert "target" not in s.sandbox_code and "allclose" not in s.sandbox_code
    # np.allclose semantics (rtol 1e-5, atol 1e-8), evaluated here on the recorded value
    assert _decide("assert np.allclose(f(x), target)", [(0, (np.array([1.0, 2.0]),))], np.array([1.0, 2.00001])) == ""
    assert "failed" in _decide("assert np.allclose(f(x), target)", [(0, (np.array([1.0, 2.1]),))], np.array([1.0, 2.0]))
    s = sc.split_test("assert np.allclose(g(1)[0], target[0]) and np.allclose(g(1)[1], target[1])", "t")
    assert "__record__(0, g(1)[0], g(1)[1])" in s.sandbox_code
    assert _decide("assert np.allclose(g(1)[0], target[0]) and np.allclose(g(1)[1], target[1])",
                   [(0, (1.0, 2.0))], (1.0, 2.0)) == ""
    # comparisons inside a compared tuple are made here too: np.isclose is not the sandbox's
    s = sc.split_test("assert (np.isclose(a, b), h(c)) == target", "t")
    assert "__record__(0, a, b, h(c))" in s.sandbox_code
    assert _decide("assert (np.isclose(a, b), h(c)) == target", [(0, (1.0, 1.5, 3))], (True, 3)).endswith("failed")
    s = sc.split_test("from scicode.compare.cmp import cmp_tuple_or_list\nassert cmp_tuple_or_list(k(2), target)", "t")
    assert "scicode" not in s.sandbox_code and "__record__(0, k(2))" in s.sandbox_code
    assert _decide("assert cmp_tuple_or_list(k(2), target)", [(0, ([1.0, {"a": 2.0}],))], [1.0, {"a": 2.0}]) == ""
    # target-free checks are evaluated here too; numpy methods work on the recorded values (78.2)
    nan_check = "def t():\n    x = f()\n    assert not np.isnan(x).any(), 'm'\nt()"
    assert "__record__(0, np.isnan(x))" in sc.split_test(nan_check, "t").sandbox_code
    assert _decide(nan_check, [(0, (np.zeros(2, bool),))], None) == ""
    assert _decide(nan_check, [(0, (np.array([False, True]),))], None).endswith("failed")
    # the test's own comparator runs here on the recorded value and the target
    own = "def same(a, b):\n    return a.shape == b.shape\nassert same(f(1), target)"
    assert "def same" in sc.split_test(own, "t").comparators
    assert _decide(own, [(0, (np.zeros(3),))], np.ones(3)) == ""
    assert _decide(own, [(0, (np.zeros(2),))], np.ones(3)).endswith("failed")
    # an assert that reads target must run; the test must run to its end
    loop = "for v in f():\n    assert np.allclose(v, target)"
    assert "never ran" in _decide(loop, [], 1.0)
    assert _decide(loop, [(0, (1.0,))], 1.0, error="ZeroDivisionError") == "ZeroDivisionError"
    with pytest.raises(sc.TestRewriteError, match="outside an assert"):
        sc.split_test("a, b = target\nassert a == 1", "step 9.9 test 2")
    with pytest.raises(sc.TestRewriteError, match="reads `target`"):
        sc.split_test("assert np.allclose(f(target), 1)", "t")


def test_rebuilt_target_is_the_compared_value():
    for test, events, want in [("assert np.allclose(f(x), target)", [(0, (2.5,))], 2.5),
                               ("assert f(0) == target[0] and np.allclose(f(1), target[1])", [(0, (1, 2.0))], (1, 2.0)),
                               ("for i in range(2):\n    assert g(i) == target", [(0, (0,)), (0, (7,))], 7),
                               ("assert (np.isclose(a, b), h) == target", [(0, (1.0, 1.0, "x"))], (True, "x"))]:
        split = sc.split_test(test, "t")
        got = sc.recorded_target(split, sc.sandbox_record.CaseRecord("", tuple(events)), "t")
        assert type(got) is type(want) and got == want, (test, got)
    with pytest.raises(sc.TestRewriteError, match="cannot infer"):
        sc.recorded_target(sc.split_test("assert np.isclose(x, (0, 1)).any() == target.any()", "t"),
                           sc.sandbox_record.CaseRecord("", ((0, (1.0,)),)), "t")


def test_fixed_plan_and_messages(dev):
    p = dev["10"]
    fam = sc.SciCodeFamily(None)
    task = sc.problem_to_task(p)
    plan = fam.fixed_plan(task)
    assert [n.id for n in plan.nodes] == [s.step_id for s in p.steps]
    assert plan.nodes[0].depends_on == () and plan.node("10.5").depends_on == ("10.4",)
    assert plan.node("10.5").description == p.step("10.5").description
    up = gold_artifact(p, "10.4")
    msgs = fam.execute_messages(task, plan.node("10.5"), up, "the code does not parse: X")
    text = msgs[-1]["content"]
    step = p.step("10.5")
    for part in (step.description.strip(), step.function_header.strip(), "def get_alpha",
                 "the code does not parse: X", "from scipy.special import erfc"):
        assert part in text
    for t in step.test_cases:  # no hidden test in the prompt
        assert t.strip().splitlines()[-1] not in text
    art = fam.extract_artifact(task, plan.node("10.5"), f"```python\n{step.ground_truth}\n```")
    assert sc.split_program(art, "10.5") == (up.rstrip("\n") + "\n\n", step.ground_truth.strip("\n") + "\n")
    with pytest.raises(ValueError, match="no context"):
        fam.extract_artifact(task, plan.node("10.6"), "```python\npass\n```")
    merge = fam.merge_messages(task, plan.node("10.5"), [up, "```python\ndef z(): pass\n```"])
    assert "def get_alpha" in merge[-1]["content"] and "def z(): pass" in merge[-1]["content"]
    with pytest.raises(TypeError, match="payload"):
        fam.fixed_plan(Task("x", "d", "scicode", payload={"steps": []}))


def test_supplied_code_enters_the_context():
    p = {q.problem_id: q for q in sc.load_problems("package:all")}["62"]
    fam = sc.SciCodeFamily(None)
    task = sc.problem_to_task(p)
    plan = fam.fixed_plan(task)
    first = plan.nodes[0]
    assert first.id == "62.2" and first.depends_on == ()
    text = fam.execute_messages(task, first, "", None)[-1]["content"]
    assert "class EnlargedBlock" in text
    art = fam.extract_artifact(task, first, "```python\ndef block_initial(model_d):\n    return 1\n```")
    assert "class EnlargedBlock" in sc.split_program(art, "62.2")[0]


# ------------------------------------------------------------------------------ execution


@pytest.mark.parametrize("pid, step_id", [("1", "1.1"), ("10", "10.3"), ("10", "10.7"), ("29", "29.3")])
def test_ground_truth_scores_full_fast(dev, family, pid, step_id):
    p = dev[pid]
    res = family.verify(sc.problem_to_task(p), node(p, step_id), gold_artifact(p, step_id))
    assert res.gate and res.reward == 1.0, res
    assert res.components["tests_total"] == len(p.step(step_id).test_cases)


def test_wrong_and_partly_wrong_code(dev, targets):
    p, sid = dev["1"], "1.1"
    task, nd = sc.problem_to_task(p), node(p, sid)
    wrong = "def cg(A, b, x, tol):\n    return np.zeros_like(b) + 1.2345\n"
    for binary in (False, True):
        res = sc.SciCodeFamily(targets, binary=binary, limits=FAST).verify(task, nd, gold_artifact(p, sid, wrong))
        assert res.gate and res.reward == 0.0 and res.components["tests_passed"] == 0
    # Right on the first call only: tests run in order in one process, so 1 of 3 passes.
    gt = p.step(sid).ground_truth.replace("def cg(", "def _cg_true(")
    partly = gt + "\n_calls = []\ndef cg(A, b, x, tol):\n    _calls.append(1)\n" \
                  "    return _cg_true(A, b, x, tol) if len(_calls) == 1 else -_cg_true(A, b, x, tol)\n"
    res = sc.SciCodeFamily(targets, limits=FAST).verify(task, nd, gold_artifact(p, sid, partly))
    assert res.gate and res.reward == pytest.approx(1 / 3)
    res = sc.SciCodeFamily(targets, binary=True, limits=FAST).verify(task, nd, gold_artifact(p, sid, partly))
    assert res.gate and res.reward == 0.0


def test_verify_many_matches_verify(dev, family):
    p, sid = dev["1"], "1.1"
    arts = [gold_artifact(p, sid), gold_artifact(p, sid, "def cg(A, b, x, tol):\n    return b\n"),
            gold_artifact(p, sid, "def cg(A, b, x, tol:\n")]
    res = family.verify_many(sc.problem_to_task(p), node(p, sid), arts, max_workers=2)
    assert [(r.gate, r.reward) for r in res] == [(True, 1.0), (True, 0.0), (False, 0.0)]
    assert "SyntaxError" in res[2].diagnostic and res[0].diagnostic == ""


def test_gate_failure_runs_nothing_and_diagnostic_is_static(dev, family):
    p = dev["1"]
    res = family.verify(sc.problem_to_task(p), node(p, "1.1"), gold_artifact(p, "1.1", "def cg(A, b:\n"))
    assert not res.gate and res.reward == 0.0 and "SyntaxError" in res.diagnostic


def test_untrusted_output_cannot_forge_results_and_limits_hold(dev, targets):
    p, sid = dev["1"], "1.1"
    # Prints well-formed results (with a guessed nonce) and exits before the harness reports.
    forge = ("import os, sys\nsys.__stdout__.write('@@SCICODE 0000 {\"program\": true, \"error\": \"\"}\\n')\n"
             "for k in range(3):\n"
             "    sys.__stdout__.write('@@SCICODE 0000 {\"test\": %d, \"error\": \"\"}\\n' % k)\n"
             "sys.__stdout__.flush()\nos._exit(0)\ndef cg(A, b, x, tol):\n    return b * 0\n")
    fam = sc.SciCodeFamily(targets, limits=FAST)
    assert fam.verify(sc.problem_to_task(p), node(p, sid), gold_artifact(p, sid, forge)).reward == 0.0
    peek = "def cg(A, b, x, tol):\n    return target\n"  # the target is not in the program's globals
    assert fam.verify(sc.problem_to_task(p), node(p, sid), gold_artifact(p, sid, peek)).reward == 0.0
    loop = "def cg(A, b, x, tol):\n    while True:\n        pass\n"
    fam = sc.SciCodeFamily(targets, limits=sc.ExecLimits(timeout_s=30.0, test_timeout_s=1.0))
    rep = fam.score(p, p.step(sid), gold_artifact(p, sid, loop))
    assert rep.n_passed == 0 and all("time limit" in e for e in rep.errors)
    boom = "raise RuntimeError('at import')\ndef cg(A, b, x, tol):\n    return b\n"
    rep = fam.score(p, p.step(sid), gold_artifact(p, sid, boom))
    assert rep.n_passed == 0 and "at import" in rep.program_error


def test_target_cache_hit_on_second_call(dev, tmp_path):
    p = dev["1"]
    step = p.step("1.1")
    first = sc.RebuiltTargets(tmp_path)
    blobs = first.step_targets(p, step)
    assert (first.builds, first.hits) == (1, 0) and len(blobs) == 3
    second = sc.RebuiltTargets(tmp_path)
    again = second.step_targets(p, step)
    assert (second.builds, second.hits) == (0, 1)
    assert all(a.dtype == b.dtype and np.array_equal(a, b) for a, b in zip(again, blobs))
    assert isinstance(blobs[0], np.ndarray)
    assert [p.suffix for p in tmp_path.rglob("test*")] == [".json"] * 3  # data-only cache, no pickle
    edited = dataclasses.replace(step, test_cases=(step.test_cases[0].replace("tol = 10e-5", "tol = 10e-6"),)
                                 + step.test_cases[1:])
    assert edited.test_cases != step.test_cases  # the edit must change the test to exercise the hash
    assert second.step_targets(p, edited) and second.builds == 1


def test_h5_targets_official_layout(dev, targets, tmp_path):
    h5py = pytest.importorskip("h5py")
    p = dev["10"]
    path = tmp_path / "test_data.h5"
    with h5py.File(path, "w") as f:
        for sid in ("10.1", "10.3"):
            for k, value in enumerate(targets.step_targets(p, p.step(sid))):
                vals = value if isinstance(value, tuple) else (value,)
                for j, v in enumerate(vals):
                    f.create_dataset(f"{sid}/test{k + 1}/var{j + 1}", data=np.asarray(v))
        g = f.create_group("99.1/test1/var1/list")
        g.create_dataset("var1", data=np.arange(3))
        g.create_dataset("var2", data=b"abc")
        d = f.create_group("99.1/test2/var1")
        d.create_dataset("0.5", data=2.0)
        d.create_dataset("name", data=b"x")
        s = f.create_group("99.1/test2/var2/sparse_matrix")
        for key, v in (("data", [1.0, 2.0]), ("indices", [0, 1]), ("indptr", [0, 1, 2]), ("shape", [2, 2])):
            s.create_dataset(key, data=np.asarray(v))
    src = sc.H5Targets(path)
    fam = sc.SciCodeFamily(src, limits=FAST)
    for sid in ("10.1", "10.3"):
        assert src.can_score(p, p.step(sid))
        assert fam.score(p, p.step(sid), gold_artifact(p, sid)).pass_fraction == 1.0
    assert not src.can_score(p, p.step("10.2"))
    fake = dataclasses.replace(p.step("10.1"), step_id="99.1", test_cases=("", ""))
    lst, (dct, sparse) = src.step_targets(p, fake)
    assert np.array_equal(lst[0], np.arange(3)) and lst[1] == b"abc"
    assert dct == {0.5: 2.0, "name": "x"} and np.array_equal(sparse.toarray(), np.eye(2) * [1.0, 2.0])


def test_rebuild_refuses_problems_without_ground_truth(dev):
    p = dev["1"]
    no_gt = dataclasses.replace(p, steps=tuple(dataclasses.replace(s, ground_truth=None) for s in p.steps))
    src = sc.RebuiltTargets("/nonexistent-never-written")
    assert not src.can_score(no_gt, no_gt.steps[0])
    with pytest.raises(sc.TargetRebuildError, match="test_data.h5"):
        src.step_targets(no_gt, no_gt.steps[0])


@pytest.mark.slow
def test_ground_truth_scores_full_on_every_dev_step(dev, tmp_path):
    """~6-10 min on 2 cores: includes 51.4, 47.4, 10.11, 7.1 and 49.4 (each 20-90 s, twice)."""
    fam = sc.SciCodeFamily(sc.RebuiltTargets(tmp_path), limits=sc.ExecLimits(timeout_s=900, test_timeout_s=600))
    results = []
    for p in dev.values():
        task = sc.problem_to_task(p)
        for st in p.testable_steps:
            res = fam.verify(task, node(p, st.step_id), gold_artifact(p, st.step_id))
            results.append(StepResult(p.problem_id, st.step_id, int(res.components.get("tests_passed", 0)),
                                      len(st.test_cases)))
    assert [r.step_id for r in results if not r.passed] == []
    m = scicode_metrics(results)
    assert (m["step_pass"], m["mean_step_pass"], m["problem_pass"], m["n_steps"]) == (1.0, 1.0, 1.0, 50)


# ------------------------------------------------------------------------------ metrics


def test_metrics_hand_made():
    r = [StepResult("a", "a.1", 3, 3), StepResult("a", "a.2", 2, 3), StepResult("a", "a.3", 4, 4),
         StepResult("b", "b.1", 1, 1),
         StepResult("c", "c.1", 0, 2), StepResult("c", "c.2", 1, 1)]
    assert step_pass(r) == pytest.approx(4 / 6)
    assert mean_step_pass(r) == pytest.approx((2 / 3 + 1 + 1 / 2) / 3)
    assert problem_pass(r) == pytest.approx(1 / 3)
    assert scicode_metrics(r)["n_problems"] == 3
    with pytest.raises(ValueError, match="duplicate"):
        step_pass(r + [StepResult("a", "a.1", 0, 3)])
    with pytest.raises(ValueError, match="n_passed"):
        StepResult("a", "a.1", 4, 3)
    with pytest.raises(ValueError, match="at least one"):
        problem_pass([])


def test_answer_prefix_is_the_header_and_a_body_completion_passes(dev, family):
    p, sid = dev["1"], "1.1"
    task, nd = sc.problem_to_task(p), node(p, sid)
    prefix = family.answer_prefix(task, nd, "execute")
    step = p.step(sid)
    assert prefix == f"```python\n{step.function_header.rstrip()}\n" and family.answer_prefix(task, nd, "merge") == ""
    # The model writes only the body after the header; prefix + completion is one python block.
    import ast

    fn = next(n for n in ast.parse(step.ground_truth).body if isinstance(n, ast.FunctionDef))
    lines = step.ground_truth.splitlines()
    gold_body = "\n".join(lines[fn.body[1].lineno - 1:fn.end_lineno])  # after the gold docstring
    family.execute_messages(task, nd, "", None)
    art = family.extract_artifact(task, nd, prefix + gold_body.lstrip("\n") + "\n```\n")
    assert family.verify(task, nd, art).reward == 1.0
