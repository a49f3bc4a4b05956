"""Planner: JSON extraction, plan validation/repair, re-planning and fallback, fixed-step plans."""

from __future__ import annotations

import json
import logging
import random

import networkx as nx
import pytest

from morse_jax.tomas.planner import loop as P
from morse_jax.tasks.plan import Plan, step_chain_plan
from morse_jax.tasks.srdd.family import SOFTWARE_PROJECT_HINT


def node(nid, deps=(), desc=None, title=None):
    d = {"id": nid, "description": desc if desc is not None else f"do {nid}", "depends_on": list(deps)}
    d["title"] = title if title is not None else f"T{nid}"
    return d


def deps_of(plan: Plan) -> dict:
    return {n.id: list(n.depends_on) for n in plan.nodes}


def assert_valid_dag(plan: Plan):
    ids = [n.id for n in plan.nodes]
    assert len(set(ids)) == len(ids)
    pos = {n: i for i, n in enumerate(ids)}
    for n in plan.nodes:
        assert n.description.strip()
        for p in n.depends_on:
            assert pos[p] < pos[n.id], f"{p} must precede {n.id}"
    assert nx.is_directed_acyclic_graph(plan.graph())


GOOD = {"nodes": [node("n1"), node("n2", ["n1"]), node("n3", ["n1"]), node("n4", ["n2", "n3"])]}


# ------------------------------------------------------------------------------- extraction

EXTRACT_CASES = [
    ("bare", json.dumps(GOOD), GOOD),
    ("prose around", "Sure! Here is the plan:\n" + json.dumps(GOOD) + "\nHope this helps {really}.", GOOD),
    ("fence + trailing text", "```json\n" + json.dumps(GOOD, indent=2) + "\n```\nNote: n4 joins.", GOOD),
    ("plain fence", "```\n" + json.dumps(GOOD) + "\n```", GOOD),
    ("trailing commas", '{"nodes": [{"id": "a", "description": "x", "depends_on": [],},]}',
     {"nodes": [{"id": "a", "description": "x", "depends_on": []}]}),
    ("braces inside strings", '{"nodes": [{"id": "a", "description": "use {x} and }", "depends_on": []}]}',
     {"nodes": [{"id": "a", "description": "use {x} and }", "depends_on": []}]}),
    ("top-level list", '[{"id": "a", "description": "x"}]', {"nodes": [{"id": "a", "description": "x"}]}),
    ("citation list skipped", 'As in [1], {"nodes": []}', {"nodes": []}),
    ("unparseable span then object", "set {a, b} then {\"k\": 1}", {"k": 1}),
    ("mismatched bracket in prose", 'a ] b [ c } {"k": 2}', {"k": 2}),
    ("quote in prose", 'the "best" plan: {"k": 3}', {"k": 3}),
]


@pytest.mark.parametrize("name,text,expected", EXTRACT_CASES, ids=[c[0] for c in EXTRACT_CASES])
def test_extract_json_object(name, text, expected):
    assert P.extract_json_object(text) == expected


EXTRACT_ERRORS = [
    ("no JSON", "I cannot do that.", "no JSON object"),
    ("empty", "", "no JSON object"),
    ("truncated", '{"nodes": [{"id": "n1", "description": "abc"', "truncated"),
    ("truncated in fence", '```json\n{"nodes": [1, 2\n```', "truncated"),
    ("not JSON", "{this is not json}", "does not parse"),
    ("deep nesting", "[" * 100000 + "]" * 100000, "does not parse"),
]


@pytest.mark.parametrize("name,text,why", EXTRACT_ERRORS, ids=[c[0] for c in EXTRACT_ERRORS])
def test_extract_errors(name, text, why):
    with pytest.raises(P.PlanParseError, match=why):
        P.extract_json_object(text)


def test_extract_prefer_keys_skips_echoed_example():
    text = 'e.g. {"id": "x"} ... answer: {"nodes": [1]}'
    assert P.extract_json_object(text) == {"id": "x"}
    assert P.extract_json_object(text, prefer_keys=("nodes",)) == {"nodes": [1]}
    assert P.extract_json_object('{"id": "x"}', prefer_keys=("nodes",)) == {"id": "x"}


# ------------------------------------------------------------------------------- validation

def nodes(*ns):
    return {"nodes": list(ns)}


# (name, obj, expected deps after repair in topological order, substrings expected in repairs)
REPAIR_CASES = [
    ("valid diamond", GOOD, {"n1": [], "n2": ["n1"], "n3": ["n1"], "n4": ["n2", "n3"]}, []),
    ("2-cycle", nodes(node("a", ["b"]), node("b", ["a"])), {"a": [], "b": ["a"]}, ["cycle a -> b -> a"]),
    ("3-cycle", nodes(node("a", ["c"]), node("b", ["a"]), node("c", ["b"])),
     {"a": [], "b": ["a"], "c": ["b"]}, ["cycle a -> b -> c -> a"]),
    ("two cycles", nodes(node("a", ["b"]), node("b", ["a"]), node("c", ["d"]), node("d", ["c"]), node("e", ["b", "d"])),
     {"a": [], "b": ["a"], "c": [], "d": ["c"], "e": ["b", "d"]}, ["cycle a -> b -> a", "cycle c -> d -> c"]),
    ("overlapping cycles", nodes(node("a", ["c"]), node("b", ["a", "c"]), node("c", ["b"])),
     {"a": [], "b": ["a"], "c": ["b"]}, ["to break the cycle", "to break the cycle"]),
    ("unknown dep", nodes(node("a"), node("b", ["a", "zz"])), {"a": [], "b": ["a"]}, ["unknown dependency 'zz'"]),
    ("self loop", nodes(node("a", ["a"]), node("b", ["a", "b"])), {"a": [], "b": ["a"]}, ["itself", "itself"]),
    ("repeated dep", nodes(node("a"), node("b", ["a", "a"])), {"a": [], "b": ["a"]}, ["repeated"]),
    ("depends_on string",
     nodes(node("a"), node("c"), {"id": "b", "description": "x", "title": "t", "depends_on": "a, c"}),
     {"a": [], "c": [], "b": ["a", "c"]}, ["string 'a, c'"]),
    ("depends_on int", nodes(node(1), {"id": 2, "description": "x", "title": "t", "depends_on": 1}),
     {"1": [], "2": ["1"]}, ["number 1"]),
    ("depends_on null", nodes(node("a"), {"id": "b", "description": "x", "title": "t", "depends_on": None}),
     {"a": [], "b": []}, []),
    ("int ids coerced", nodes(node(1), node(2, [1])), {"1": [], "2": ["1"]}, []),
    ("alias deps key", nodes(node("a"), {"id": "b", "description": "x", "title": "t", "dependencies": ["a"]}),
     {"a": [], "b": ["a"]}, ["field 'dependencies'"]),
    ("alias subtasks", {"subtasks": [node("a"), node("b", ["a"])]}, {"a": [], "b": ["a"]}, ["key 'subtasks'"]),
    ("bare list", [node("a"), node("b", ["a"])], {"a": [], "b": ["a"]}, []),
    ("missing title", nodes(node("a"), {"id": "b", "description": "Write the parser. Then test.", "depends_on": []}),
     {"a": [], "b": []}, ["derived 'Write the parser.'"]),
    ("topological reorder", nodes(node("c", ["b"]), node("b", ["a"]), node("a")),
     {"a": [], "b": ["a"], "c": ["b"]}, []),
]


@pytest.mark.parametrize("name,obj,expected,repair_bits", REPAIR_CASES, ids=[c[0] for c in REPAIR_CASES])
def test_validate_repairs(name, obj, expected, repair_bits, caplog):
    with caplog.at_level(logging.INFO, logger="morse_jax.planner"):
        plan = P.validate_plan(obj)
    assert_valid_dag(plan)
    assert deps_of(plan) == expected
    assert list(deps_of(plan)) == list(expected)  # the order too
    assert len(plan.repairs) == len(repair_bits)
    for bit, rep in zip(repair_bits, plan.repairs):
        assert bit in rep
    logged = [r.getMessage() for r in caplog.records if r.name == "morse_jax.planner"]
    assert [m for m in logged if m.startswith("plan repair")] == [f"plan repair: {r}" for r in plan.repairs]


def test_repairs_become_errors_when_disabled():
    for name, obj, _, bits in REPAIR_CASES:
        if bits:
            with pytest.raises(P.PlanValidationError, match="repairs are disabled"):
                P.validate_plan(obj, repair=False)
        else:
            P.validate_plan(obj, repair=False)


ERROR_CASES = [
    ("zero nodes", nodes(), "zero nodes"),
    ("one node below min", nodes(node("a")), "1 nodes; allowed is 2 to 8"),
    ("fifty nodes", nodes(*[node(f"n{i}") for i in range(50)]), "50 nodes; allowed is 2 to 8"),
    ("duplicate ids", nodes(node("a"), node("b"), node("a")), "nodes\\[2\\]: duplicate id 'a'"),
    ("duplicate after coercion", nodes(node(1), node("1")), "duplicate id '1'"),
    ("empty description", nodes(node("a"), node("b", desc="   ")), "node 'b': field 'description'"),
    ("missing description", nodes(node("a"), {"id": "b"}), "node 'b': field 'description'"),
    ("description not string", nodes(node("a"), node("b", desc=["x"])), "node 'b': field 'description'"),
    ("missing id", nodes(node("a"), {"description": "x"}), "nodes\\[1\\]: field 'id' is missing"),
    ("empty id", nodes(node("a"), node("  ")), "nodes\\[1\\]: field 'id': is empty"),
    ("id is object", nodes(node("a"), node({"x": 1})), "nodes\\[1\\]: field 'id': must be a string"),
    ("node not object", nodes(node("a"), "b"), "nodes\\[1\\] must be an object"),
    ("depends_on object", nodes(node("a"), {"id": "b", "description": "x", "depends_on": {"a": 1}}),
     "node 'b': field 'depends_on' must be a list"),
    ("depends_on bool", nodes(node("a"), {"id": "b", "description": "x", "depends_on": True}),
     "node 'b': field 'depends_on' must be a list"),
    ("dep element object", nodes(node("a"), node("b", [{"id": "a"}])), "node 'b': field 'depends_on'\\[0\\]"),
    ("no nodes key", {"plan": []}, "no 'nodes' list"),
    ("nodes not list", {"nodes": "a, b"}, "field 'nodes' must be a list"),
    ("ambiguous aliases", {"steps": [node("a")], "tasks": [node("b")]}, "ambiguous"),
    ("ambiguous dep fields", nodes(node("a"), {"id": "b", "description": "x", "deps": [], "parents": []}), "ambiguous"),
    ("not an object", "nodes", "must be a JSON object"),
]


@pytest.mark.parametrize("name,obj,msg", ERROR_CASES, ids=[c[0] for c in ERROR_CASES])
def test_validate_errors(name, obj, msg):
    with pytest.raises(P.PlanValidationError, match=msg):
        P.validate_plan(obj)


def test_bounds_arguments_checked():
    with pytest.raises(ValueError, match="min_nodes"):
        P.validate_plan(GOOD, min_nodes=0)
    with pytest.raises(ValueError, match="max_nodes"):
        P.validate_plan(GOOD, min_nodes=3, max_nodes=2)
    assert len(P.validate_plan(nodes(*[node(f"n{i}") for i in range(50)]), max_nodes=None).nodes) == 50


def test_topological_order_is_stable_and_joins_detected():
    obj = nodes(node("x"), node("j", ["y", "x"]), node("y"), node("z", ["x"]), node("w"))
    plan = P.validate_plan(obj)
    # among ready nodes the earliest in input order goes first: j becomes ready after y
    assert [n.id for n in plan.nodes] == ["x", "y", "j", "z", "w"]
    assert plan.is_join("j") and not plan.is_join("z") and not plan.is_join("x")
    assert plan.node("j").depends_on == ("y", "x")  # parent order preserved
    text = P.render_plan(plan)
    assert "join: merge of y, x" in text and text.count("join: merge") == 1
    assert "5 nodes, 3 edges, 1 join(s)" in text
    assert "after: (root)" in text


# ------------------------------------------------------------------------------- never crash (fuzz)

def _random_json(rng: random.Random, depth=0):
    kinds = ["str", "int", "null", "bool", "list", "dict", "float"] if depth < 3 else ["str", "int", "null"]
    k = rng.choice(kinds)
    if k == "str":
        return rng.choice(["a", "b", "n1", "", " ", "1", "a, b", "{", "x" * 5])
    if k == "int":
        return rng.randint(-2, 3)
    if k == "float":
        return rng.choice([1.5, float("nan")])
    if k in ("null", "bool"):
        return rng.choice([None, True, False])
    if k == "list":
        return [_random_json(rng, depth + 1) for _ in range(rng.randint(0, 4))]
    keys = ["id", "title", "description", "depends_on", "nodes", "steps", "deps"]
    return {rng.choice(keys): _random_json(rng, depth + 1) for _ in range(rng.randint(0, 5))}


def test_fuzz_never_crashes():
    rng = random.Random(0)
    for _ in range(1500):
        if rng.random() < 0.5:
            obj = {"nodes": [{"id": rng.choice(["a", "b", "c", "d", 1, 2]), "description": rng.choice(["x", "", 3]),
                              "depends_on": _random_json(rng, 1)} for _ in range(rng.randint(0, 6))]}
        else:
            obj = _random_json(rng)
        text = json.dumps(obj)
        if rng.random() < 0.3:
            text = text[: rng.randint(0, len(text))]
        try:
            plan = P.validate_plan(P.extract_json_object(text), min_nodes=1)
        except (P.PlanParseError, P.PlanValidationError):
            continue
        assert_valid_dag(plan)


# ------------------------------------------------------------------------------- plan_task

class Scripted:
    def __init__(self, *outputs):
        self.outputs, self.calls = list(outputs), []

    def __call__(self, messages):
        self.calls.append(messages)
        return self.outputs.pop(0)


TASK = "Build a command-line todo app with add, list and delete commands, saving to a JSON file."


def test_planner_messages_content():
    msgs = P.planner_messages(TASK, min_nodes=3, max_nodes=5, roles_hint=SOFTWARE_PROJECT_HINT)
    assert [m["role"] for m in msgs] == ["system", "user"]
    user = msgs[1]["content"]
    assert "3 to 5 subtasks" in user and TASK in user and "every requirement" in user
    assert '"depends_on"' in user and "standard library" in user
    assert "- rule A" in P.planner_messages(TASK, roles_hint=["rule A"])[1]["content"]
    for bad in ("", "   ", None):
        with pytest.raises(ValueError, match="task_description"):
            P.planner_messages(bad)


def test_plan_task_success_first_try():
    gen = Scripted("```json\n" + json.dumps(GOOD) + "\n```")
    plan = P.plan_task(TASK, gen)
    assert len(gen.calls) == 1 and [n.id for n in plan.nodes] == ["n1", "n2", "n3", "n4"]
    assert plan.repairs == ()


def test_plan_task_replans_after_garbage(caplog):
    gen = Scripted("I am not sure what you mean.", json.dumps(nodes(node("a", ["b"]), node("b", ["a"]))))
    with caplog.at_level(logging.INFO, logger="morse_jax.planner"):
        plan = P.plan_task(TASK, gen)
    assert len(gen.calls) == 2
    second = gen.calls[1]
    assert second[:2] == gen.calls[0]
    assert second[2] == {"role": "assistant", "content": "I am not sure what you mean."}
    assert "rejected" in second[3]["content"] and "no JSON object" in second[3]["content"]
    assert [n.id for n in plan.nodes] == ["a", "b"]
    assert "attempt 1 rejected" in plan.repairs[0] and "cycle" in plan.repairs[1]
    assert any("attempt 1 rejected" in r.getMessage() for r in caplog.records)


def test_plan_task_falls_back_to_single_node():
    gen = Scripted("nope", '{"nodes": [', json.dumps(nodes(node("a"))))  # garbage, truncated, too few
    log = logging.getLogger("test.planner.custom")
    plan = P.plan_task(TASK, gen, max_replans=2, log=log)
    assert len(gen.calls) == 3
    assert len(plan.nodes) == 1 and plan.nodes[0].description == TASK and plan.nodes[0].depends_on == ()
    assert len(plan.repairs) == 4 and "single-node" in plan.repairs[-1]
    assert "truncated" in plan.repairs[1] and "1 nodes" in plan.repairs[2]


def test_plan_task_rejects_echoed_example():
    echo = P.extract_json_object(P.planner_messages(TASK)[1]["content"])
    gen = Scripted(json.dumps(echo), json.dumps(GOOD))
    plan = P.plan_task(TASK, gen)
    assert len(gen.calls) == 2 and "placeholder" in plan.repairs[0]
    assert [n.id for n in plan.nodes] == ["n1", "n2", "n3", "n4"]


def test_extract_prefers_keyed_object_over_fenced_example():
    text = '```json\n{"id": "x"}\n```\nAnswer: {"nodes": [1]}'
    assert P.extract_json_object(text, prefer_keys=("nodes",)) == {"nodes": [1]}
    assert P.extract_json_object(text) == {"id": "x"}


def test_plan_task_zero_replans_and_bad_generate():
    plan = P.plan_task(TASK, Scripted("garbage"), max_replans=0)
    assert len(plan.nodes) == 1
    with pytest.raises(TypeError, match="generate_fn must return a str"):
        P.plan_task(TASK, lambda m: None)
    with pytest.raises(ValueError, match="max_replans"):
        P.plan_task(TASK, Scripted(), max_replans=-1)


def test_plan_task_long_garbage_is_truncated_in_replan():
    gen = Scripted("x" * 10000, json.dumps(GOOD))
    P.plan_task(TASK, gen)
    assert len(gen.calls[1][2]["content"]) < 2000


# ------------------------------------------------------------------------------- files

def test_load_plan_file(tmp_path):
    f = tmp_path / "plan.json"
    f.write_text(json.dumps(GOOD))
    assert [n.id for n in P.load_plan_file(f).nodes] == ["n1", "n2", "n3", "n4"]
    f.write_text(json.dumps(nodes(node("only"))))
    assert len(P.load_plan_file(f).nodes) == 1
    f.write_text("{not json")
    with pytest.raises(P.PlanValidationError, match=f"{f}: not valid JSON"):
        P.load_plan_file(f)
    f.write_text(json.dumps(nodes(node("a", ["ghost"]))))
    with pytest.raises(P.PlanValidationError, match=f"{f}: node 'a': dropped unknown dependency 'ghost'"):
        P.load_plan_file(f)
    with pytest.raises(FileNotFoundError, match="missing.json"):
        P.load_plan_file(tmp_path / "missing.json")


# ------------------------------------------------------------------------------- fixed steps

STEPS = [("1.1", "Compute the Wigner function.\ndef wigner(x):"), ("1.2", "Integrate it."), ("1.3", "Plot the result.")]


def test_scicode_chain_and_step_checks():
    plan = step_chain_plan(STEPS)
    assert deps_of(plan) == {"1.1": [], "1.2": ["1.1"], "1.3": ["1.2"]}
    assert plan.nodes[0].title == "Compute the Wigner function."
    for bad, msg in [([], "non-empty"), ([("1", "a"), ("1", "b")], "duplicate step_id"),
                     ([("1", "")], "description"), ([("1",)], "pair")]:
        with pytest.raises(ValueError, match=msg):
            step_chain_plan(bad)


DEP_CASES = [
    ("good", '{"dependencies": [{"step": "1.2", "depends_on": ["1.1"]}, {"step": "1.3", "depends_on": ["1.1"]}]}',
     {"1.1": [], "1.2": ["1.1"], "1.3": ["1.1"]}, 0),
    ("join", '{"dependencies": [{"step": "1.3", "depends_on": ["1.1", "1.2"]}, '
     '{"step": "1.2", "depends_on": ["1.1"]}]}',
     {"1.1": [], "1.2": ["1.1"], "1.3": ["1.1", "1.2"]}, 0),
    ("mapping form", '{"dependencies": {"1.2": "1.1", "1.3": ["1.2"]}}',
     {"1.1": [], "1.2": ["1.1"], "1.3": ["1.2"]}, 0),
    ("forward and unknown dropped", '{"dependencies": [{"step": "1.1", "depends_on": ["1.3"]}, '
     '{"step": "1.2", "depends_on": ["9.9", "1.1"]}, {"step": "1.3", "depends_on": ["1.1"]}, '
     '{"step": "7", "depends_on": []}]}',
     {"1.1": [], "1.2": ["1.1"], "1.3": ["1.1"]}, 3),
    ("omitted step gets predecessor", '{"dependencies": [{"step": "1.3", "depends_on": ["1.1"]}]}',
     {"1.1": [], "1.2": ["1.1"], "1.3": ["1.1"]}, 1),
    ("garbage -> chain", "I think step 2 needs step 1.", {"1.1": [], "1.2": ["1.1"], "1.3": ["1.2"]}, 1),
    ("wrong schema -> chain", '{"deps": 3}', {"1.1": [], "1.2": ["1.1"], "1.3": ["1.2"]}, 1),
]


@pytest.mark.parametrize("name,text,expected,n_repairs", DEP_CASES, ids=[c[0] for c in DEP_CASES])
def test_parse_inferred_dependencies(name, text, expected, n_repairs):
    plan = P.parse_inferred_dependencies(text, STEPS)
    assert deps_of(plan) == expected and list(deps_of(plan)) == [s for s, _ in STEPS]
    assert len(plan.repairs) == n_repairs
    assert_valid_dag(plan)


def test_plan_with_fixed_nodes_uses_generate_fn():
    gen = Scripted('{"dependencies": [{"step": "1.3", "depends_on": ["1.1", "1.2"]}]}')
    plan = P.plan_with_fixed_nodes("Simulate a quantum particle.", STEPS, gen)
    assert plan.is_join("1.3") and "Step ID: 1.2" in gen.calls[0][1]["content"]
    assert "Simulate a quantum particle." in gen.calls[0][1]["content"]
