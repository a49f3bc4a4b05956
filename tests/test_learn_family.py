"""PyFuncs task family (issue 16): generation, splits, verification in the sandbox, metrics, config."""

from __future__ import annotations

import ast
import subprocess
import sys
import types
from pathlib import Path

import pytest

from morse_jax.tasks.pyfuncs import data as pd
from morse_jax.tasks.pyfuncs.family import PyFuncsFamily, merged_reference, pyfuncs_metrics
from morse_jax.tasks.pyfuncs.templates import OOD_TEMPLATES, TEMPLATES, reference_function
from morse_jax.tasks.pyfuncs.verify import same_value, score_calls
from morse_jax.tasks.sandbox import wire_format

ROOT = Path(__file__).resolve().parents[1]
FAM = PyFuncsFamily()


def _perturbed(spec) -> str:
    """A plausible wrong solution: the reference, its result changed by type (never equal to it)."""
    return (spec.reference.replace(f"def {spec.name}(", "def _ref(", 1) +
            f"\ndef {spec.name}({spec.param}):\n    y = _ref({spec.param})\n"
            "    if isinstance(y, bool) or not isinstance(y, (int, str, list, dict)):\n        return None\n"
            "    if isinstance(y, int):\n        return y + 1\n    if isinstance(y, str):\n        return y + '!'\n"
            "    if isinstance(y, list):\n        return y + [0]\n    return {**y, 'zz_extra': 1}\n")


def test_generator_is_deterministic_per_seed_across_processes():
    code = ("from morse_jax.tasks.pyfuncs.data import make_task; import hashlib\n"
            "print(hashlib.sha256(repr([(t.description, t.payload) for t in "
            "(make_task(s, i) for s in ('train', 'iid', 'ood') for i in range(15))]).encode()).hexdigest())")
    outs = {subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True,
                           env={"PYTHONHASHSEED": seed, "PATH": "/usr/bin:/bin"}).stdout for seed in ("1", "2")}
    assert len(outs) == 1
    again = pd.make_task.__wrapped__("train", 3)  # uncached: drawn anew from its seed
    assert again == pd.make_task("train", 3)
    assert pd.make_task("train", 3) != pd.make_task("train", 4)
    assert pd.make_task("train", 3) != pd.make_task("iid", 3)


def test_tasks_have_two_to_three_helpers_of_distinct_kinds_that_chain():
    tasks = pd.load_split("train", 200)
    assert {len(t.payload.helpers) for t in tasks} == {2, 3}
    for t in tasks:
        specs = [s.spec for s in t.payload.helpers]
        assert len({s.kind for s in specs}) == len(specs)
        assert all(a.out_type == b.in_type for a, b in zip(specs, specs[1:]))
        assert t.payload.solve.spec.in_type == specs[0].in_type
    # several kinds, many templates and thousands of distinct tasks
    assert len({s.spec.kind for t in tasks for s in t.payload.helpers}) == 5
    assert len({t.description for t in pd.load_split("train")}) > 2000


def test_splits_are_disjoint_and_ood_templates_never_reach_training():
    train, iid, ood = pd.load_split("train"), pd.load_split("iid"), pd.load_split("ood")
    assert len(train) == pd.SPLIT_SIZES["train"] and len(iid) == pd.SPLIT_SIZES["iid"]
    train_texts = {t.description for t in train}
    assert not train_texts & {t.description for t in iid}
    assert not train_texts & {t.description for t in ood}
    assert not {t.task_id for t in train} & {t.task_id for t in iid}
    for t in train + iid:
        assert not set(t.payload.templates) & set(OOD_TEMPLATES)
        assert not any(TEMPLATES[k].name in t.description for k in OOD_TEMPLATES)
    assert all(set(t.payload.templates) & set(OOD_TEMPLATES) for t in ood)


def _round_trip(n: int):
    for split in pd.SPLITS:
        for t in pd.load_split(split, n):
            for s in t.payload.steps:
                src = merged_reference(t.payload) + "\n" + s.spec.reference if s.node_id == pd.SOLVE else s.spec.reference
                fn = reference_function(src, s.spec.name)
                for c in (*s.examples, *s.tests):
                    got = wire_format.loads(wire_format.dumps(fn(ast.literal_eval(c.input_repr))))
                    assert same_value(got, c.expected), (t.task_id, s.node_id)


def test_test_cases_round_trip_through_the_literal_and_encoding_the_sandbox_uses():
    """In process: the reference applied to the literal-parsed input, sent through the sandbox's
    wire format, equals the stored expected value exactly (what the sandbox comparison relies
    on); the first 150 tasks of each split."""
    _round_trip(150)


@pytest.mark.slow
def test_every_task_of_every_split_round_trips():
    _round_trip(0)


@pytest.mark.parametrize("split,index", [("train", 0), ("train", 7), ("iid", 1), ("ood", 2)])
def test_reference_scores_one_and_a_wrong_solution_less_in_the_sandbox(split, index):
    task = pd.make_task(split, index)
    plan = FAM.fixed_plan(task)
    assert [n.id for n in plan.nodes][-1] == pd.SOLVE and plan.is_join(pd.SOLVE)
    for node in plan.nodes:
        ref = FAM.verify(task, node, FAM.reference_artifact(task, node))
        assert ref.gate and ref.reward == 1.0, (node.id, ref)
        step = task.payload.step(node.id)
        if node.id == pd.SOLVE:
            wrong = FAM.extract_artifact(task, node, f"```python\n{_perturbed(step.spec)}```",
                                         context=merged_reference(task.payload))
        else:
            wrong = _perturbed(step.spec)
        bad = FAM.verify(task, node, wrong)
        assert bad.gate and bad.reward < 1.0, (node.id, bad)
    merge = FAM.verify_merge(task, plan.node(pd.SOLVE), merged_reference(task.payload))
    assert merge.gate and merge.reward == 1.0
    dropped = FAM.verify_merge(task, plan.node(pd.SOLVE), task.payload.helpers[0].spec.reference)
    assert not dropped.gate and dropped.reward == 0.0


def test_same_value_is_exact_and_typed():
    """The PyFuncs comparison, from its definition: same type at every level, equal scalars."""
    assert same_value(3, 3) and same_value("a", "a") and same_value(None, None)
    assert not same_value(True, 1) and not same_value(1, True) and not same_value(3.0, 3)
    assert same_value([1, [2, "x"]], [1, [2, "x"]]) and not same_value([1, 2], (1, 2))
    assert not same_value([1, 2], [1, 2, 3]) and not same_value([1, 2], [2, 1])
    assert same_value({"a": 1, "b": 2}, {"b": 2, "a": 1})  # dict items are order-free
    assert not same_value({"a": 1}, {"a": 1, "b": 2}) and not same_value({1: 1}, {"1": 1})
    assert not same_value({"a": 1}, {"a": True})


def test_score_calls_keeps_expected_values_out_of_the_sandbox(monkeypatch):
    """One check in one function: the family's verifier goes through record.check_outputs, and
    what enters the sandbox (program and call expressions) holds no expected value."""
    from morse_jax.tasks.sandbox import runner

    seen = []
    real = runner.run_python

    def spy(code, files=None, **kw):
        seen.append((code, {k: v if isinstance(v, str) else v.decode() for k, v in (files or {}).items()}))
        return real(code, files=files, **kw)

    monkeypatch.setattr(runner, "run_python", spy)
    secret = "expected-9f3a1c"
    assert score_calls("def f(x):\n    return x + '!'\n", [("f", "'a'", "a!"), ("f", "'b'", secret)]) == [True, False]
    assert len(seen) == 1
    code, files = seen[0]
    assert secret not in code and not any(secret in v for v in files.values())
    assert any("f('a')" in v for v in files.values())


def test_gate_rejects_unparsable_or_missing_function_with_zero_reward():
    task = pd.make_task("train", 0)
    node = FAM.fixed_plan(task).nodes[0]
    name = task.payload.step(node.id).spec.name
    for art in ("def broken(:\n", "def other(x):\n    return x\n", f"def {name}(x):\n    pass\n"):
        res = FAM.verify(task, node, art)
        assert not res.gate and res.reward == 0.0 and res.diagnostic


def test_forged_equality_cannot_pass():
    prog = ("class Eq:\n    def __eq__(self, o):\n        return True\n"
            "class FakeInt(int):\n    def __str__(self):\n        return '7'\n"
            "def f(x):\n    return Eq()\ndef g(x):\n    return FakeInt(3)\n")
    # An int subclass crosses the wire as the plain int it holds: its forged __str__ cannot make
    # 3 pass for 7 (the 3 it really is passes, as any int 3 would).
    assert score_calls(prog, [("f", "1", 1), ("g", "1", 7), ("g", "1", 3)]) == [False, False, True]
    assert score_calls("def h(x):\n    return [x, {1: 'a'}]\n", [("h", "2", [2, {1: "a"}]), ("h", "2", (2, {1: "a"}))]) \
        == [True, False]


def test_prompts_show_examples_not_hidden_tests_and_prefix_ends_at_the_colon():
    task = pd.make_task("train", 5)
    for node in FAM.fixed_plan(task).nodes:
        step = task.payload.step(node.id)
        ctx = merged_reference(task.payload) if node.id == pd.SOLVE else ""
        text = "\n".join(m["content"] for m in FAM.execute_messages(task, node, ctx, None))
        for c in step.examples:
            assert c.input_repr in text
        shown = {c.input_repr for c in step.examples}
        assert not [c for c in step.tests if c.input_repr not in shown and f"({c.input_repr})" in text]
        prefix = FAM.answer_prefix(task, node, "execute")
        assert prefix.startswith("```python\ndef ") and prefix.endswith(":") and not prefix.endswith("\n")
        merge_prefix = FAM.answer_prefix(task, node, "merge")
        if node.id == pd.SOLVE:  # a merge answer starts with its first parent's def line
            assert merge_prefix == "```python\n" + task.payload.helpers[0].spec.header
        else:
            assert merge_prefix == ""


def test_metrics_count_failed_and_blocked_nodes_as_zero():
    tasks = [pd.make_task("iid", 0), pd.make_task("iid", 1)]

    def node(status, reward):
        return types.SimpleNamespace(status=status, result=types.SimpleNamespace(reward=reward))

    traces = {}
    for t, rewards in zip(tasks, ([1.0] * 4, [0.5, 0.0, 1.0, 1.0])):
        ids = [s.node_id for s in t.payload.steps]
        rewards = rewards[:len(ids)]
        nodes = {i: node("passed" if r > 0 else "failed", r if r > 0 else 0.9) for i, r in zip(ids, rewards)}
        traces[t.task_id] = types.SimpleNamespace(nodes=nodes)
    m = pyfuncs_metrics(tasks, types.SimpleNamespace(traces=traces))
    flat = [r for t, rs in zip(tasks, ([1.0] * 4, [0.5, 0.0, 1.0, 1.0])) for r in rs[:len(t.payload.steps)]]
    assert m["reward"] == pytest.approx(sum(flat) / len(flat))
    assert m["node_pass"] == pytest.approx(sum(r == 1.0 for r in flat) / len(flat))
    assert m["task_pass"] == pytest.approx(0.5)
    assert m["solve_reward"] == pytest.approx(1.0)


@pytest.mark.parametrize("variant", ["A", "B", "C", "D"])
def test_learn_cpu_config_validates_and_loads_pyfuncs_splits(variant):
    import importlib.util

    from morse_jax.config.validate import validate_config
    from morse_jax.tasks.registry import build_family, load_task_splits

    spec = importlib.util.spec_from_file_location("learn_cpu", ROOT / "configs/learn_cpu.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    cfg = mod.get_config(variant)
    validate_config(cfg)
    assert cfg.variant == variant and cfg.data.family == "pyfuncs"
    fam = build_family(cfg, Path("/tmp"))
    cfg.data.max_train_tasks = 5
    train, evals = load_task_splits(cfg, fam)
    assert len(train) == 5 and len(evals) == cfg.data.max_eval_tasks
    assert all(t.task_id.startswith("train-") for t in train) and all(t.task_id.startswith("iid-") for t in evals)


def test_config_rejects_unknown_pyfuncs_split():
    from morse_jax.config.validate import ConfigError, validate_config
    from morse_jax.config.defaults import get_config

    cfg = get_config()
    cfg.data.family, cfg.data.train = "pyfuncs", "validation"
    with pytest.raises(ConfigError, match="config.data.train"):
        validate_config(cfg)


@pytest.mark.slow
def test_reference_and_wrong_solutions_in_the_sandbox_for_many_tasks():
    for split, n in (("train", 25), ("iid", 10), ("ood", 25)):
        for t in pd.load_split(split, n):
            for node in FAM.fixed_plan(t).nodes:
                assert FAM.verify(t, node, FAM.reference_artifact(t, node)).reward == 1.0, (t.task_id, node.id)
                if node.id != pd.SOLVE:
                    assert FAM.verify(t, node, _perturbed(t.payload.step(node.id).spec)).reward < 1.0


def test_solve_answer_cannot_replace_a_merged_helper_and_top_level_calls_are_dropped():
    task = pd.make_task("train", 0)
    node = FAM.fixed_plan(task).node(pd.SOLVE)
    h1 = task.payload.helpers[0].spec
    solve = task.payload.solve.spec
    # a correct solve followed by a wrong rewrite of a helper and an example call that would raise
    reply = (f"```python\n{solve.reference}\ndef {h1.name}({h1.param}):\n    return None\n\n"
             f"print(solve(None))\n```")
    art = FAM.extract_artifact(task, node, reply, context=merged_reference(task.payload))
    assert FAM.verify(task, node, art).reward == 1.0
    assert FAM.stop_strings == ("```",)  # answers end at the closing fence (the prefix holds the opening one)


def test_no_constant_answer_passes_every_hidden_test():
    """A function that ignores its input and returns one fixed value must fail some hidden test:
    so the expected values of every step's hidden tests are not all equal. In particular
    ``word_lengths`` with ``len(w)`` sees words of different lengths (once all words had 5 letters
    and ``return {w: 5 for w in words}`` passed)."""
    lengths_seen = set()
    for split in pd.SPLITS:
        for task in pd.load_split(split):
            for step in task.payload.steps:
                assert len({repr(c.expected) for c in step.tests}) > 1, (task.id, step.node_id)
                if step.spec.template == "dict.word_lengths" and "len(w)" in step.spec.reference:
                    lengths_seen |= {v for c in step.tests for v in c.expected.values()}
    assert len(lengths_seen) >= 3
