"""Orchestrator: batched waves, merge inheritance, regeneration, grouping, planning (scripted fakes)."""

from __future__ import annotations

import json
import re
import threading

import numpy as np
import pytest

from morse_jax.mole.experts import ExpertBankSpec, execute_set
from morse_jax.sampling.sampler import Completion
from morse_jax.tasks.base import Task, VerifyResult
from morse_jax.tomas.orchestrator import (Orchestrator, OrchestratorConfig, RouteDraw, SamplingSettings,
                                          render_trace)
from morse_jax.tasks.plan import Plan, PlanNode

SPEC = ExpertBankSpec()  # roles execute (0), merge (1); subtask experts 0..3 -> bank ids 2..5
SINGLE = ExpertBankSpec(role_names=("single",), num_subtask=0, rank=24)

DIAMOND = Plan((PlanNode("a", "A", "do a"), PlanNode("b", "B", "do b", ("a",)),
                PlanNode("c", "C", "do c", ("a",)), PlanNode("d", "D", "do d", ("b", "c"))))
CHAIN = Plan.chain([PlanNode("x", "X", "do x"), PlanNode("y", "Y", "do y"), PlanNode("z", "Z", "do z")])
ONE = Plan((PlanNode("n1", "N", "do the one thing"),))


def good_plan_json(*ids):
    nodes = [{"id": i, "title": i.upper(), "description": f"work on {i}",
              "depends_on": [ids[k - 1]] if k else []} for k, i in enumerate(ids)]
    return json.dumps({"nodes": nodes})


class FakeFamily:
    """Prompts are JSON so the fake generator can read them back; 'BAD' in an artifact fails the gate;
    'R=<x>' sets the reward."""

    name = "fake"

    def __init__(self, barrier: threading.Barrier | None = None, raise_on: str | None = None):
        self.barrier, self.raise_on = barrier, raise_on

    def fixed_plan(self, task):
        return (task.payload or {}).get("plan")

    def execute_messages(self, task, node, context, diagnostic):
        body = {"kind": "exec", "task": task.task_id, "node": node.id, "context": context, "diag": diagnostic}
        return [{"role": "system", "content": "sys"}, {"role": "user", "content": json.dumps(body)}]

    def merge_messages(self, task, node, parent_artifacts):
        body = {"kind": "merge", "task": task.task_id, "node": node.id, "parents": list(parent_artifacts)}
        return [{"role": "user", "content": json.dumps(body)}]

    def extract_artifact(self, task, node, completion):
        return completion.strip()

    def verify(self, task, node, artifact):
        if self.barrier is not None:
            self.barrier.wait()
        if self.raise_on and self.raise_on in artifact:
            raise RuntimeError("verifier crashed")
        if "BAD" in artifact:
            return VerifyResult(False, 0.0, f"bad output at {node.id}")
        m = re.search(r"R=([0-9.]+)", artifact)
        return VerifyResult(True, float(m.group(1)) if m else 1.0)


class Harness:
    """encode_fn / generate_fn / route_fn fakes that record every call."""

    def __init__(self, script=None, planner_script=None, routes=None):
        self.prompts: list[list[dict]] = []
        self.gen_calls: list[list[dict]] = []  # per generate call: decoded request infos
        self.route_calls: list[dict] = []
        self.script = script or (lambda info: f"{info['kind']}:{info['task']}:{info['node']}")
        self.planner_script = planner_script or (lambda text, info: good_plan_json("p1", "p2"))
        self.routes = routes  # callable (description, s, S) -> tuple of k router indices

    def encode(self, messages):
        self.prompts.append([dict(m) for m in messages])
        return [1000 + len(self.prompts) - 1]

    def generate(self, requests):
        infos, out = [], []
        for r in requests:
            msgs = self.prompts[r.prompt_ids[0] - 1000]
            try:
                last = next(m for m in reversed(msgs) if m["role"] != "assistant")  # skip an answer prefix
                info = json.loads(last["content"].split("\n\nYour previous answer")[0])
            except ValueError:
                info = {"kind": "plan"}
            info.update(expert_ids=tuple(r.expert_ids), expert_weights=tuple(r.expert_weights),
                        temperature=r.temperature, messages=msgs, index=len(infos))
            if info["kind"] == "plan":
                text = self.planner_script("\n".join(m["content"] for m in msgs), info)
            else:
                text = self.script(info)
            infos.append(info)
            out.append(Completion([7, 8, 9], text, np.full(3, -0.5, np.float32), "eos", 1))
        self.gen_calls.append(infos)
        return out

    def route(self, descriptions, *, num_samples, greedy):
        self.route_calls.append(dict(descriptions=list(descriptions), num_samples=num_samples, greedy=greedy))
        n, S = len(descriptions), num_samples
        members = np.zeros((n, S, 2), np.int32)
        for i, d in enumerate(descriptions):
            for s in range(S):
                members[i, s] = self.routes(d, s, S) if self.routes else ((s % 4), (s + 1) % 4)
        logp = -0.1 * (np.arange(S)[None, :] + 1) - np.arange(n)[:, None]
        return RouteDraw(members, logp.astype(np.float32), np.full((n, 4), 0.25, np.float32))

    def orchestrator(self, family=None, spec=SPEC, **cfg):
        return Orchestrator({"fake": family or FakeFamily()}, spec, self.generate, self.route, self.encode,
                            OrchestratorConfig(**cfg))

    def requests_of(self, kind=None, node=None):
        return [i for call in self.gen_calls for i in call
                if (kind is None or i["kind"] == kind) and (node is None or i.get("node") == node)]


def task(tid, plan=None, desc=None):
    return Task(tid, desc or f"task {tid} description", "fake", {"plan": plan} if plan else None)


# ------------------------------------------------------------------------------------- waves


def test_one_generate_call_per_wave_for_all_tasks():
    h = Harness()
    res = h.orchestrator(mode="eval").run([task("T1", DIAMOND), task("T2", CHAIN)])
    assert res.counters.waves == len(h.gen_calls) == res.counters.generate_calls == 4
    waves = [sorted((i["kind"], i["task"], i["node"]) for i in call) for call in h.gen_calls]
    assert waves == [
        [("exec", "T1", "a"), ("exec", "T2", "x")],
        [("exec", "T1", "b"), ("exec", "T1", "c"), ("exec", "T2", "y")],
        [("exec", "T2", "z"), ("merge", "T1", "d")],
        [("exec", "T1", "d")],
    ]
    assert res.counters.requests_per_wave == [2, 3, 2, 1]
    # one batched, greedy router call per wave, holding exactly that wave's execute nodes
    assert [len(c["descriptions"]) for c in h.route_calls] == [2, 3, 1, 1]
    assert all(c["greedy"] and c["num_samples"] == 1 for c in h.route_calls)
    for t in res.traces.values():
        assert t.all_passed
    assert res.traces["T1"].nodes["d"].merge_attempts == 1
    assert res.traces["T1"].final_artifact == "exec:T1:d"
    assert res.groups == []  # eval mode makes no training groups


def test_train_wave_sizes_and_progress():
    h, seen = Harness(), []
    res = h.orchestrator(mode="train", routes_per_node=2, candidates_per_route=3).run(
        [task("T1", DIAMOND), task("T2", CHAIN)], progress=seen.append)
    # execute calls: B*M = 6 requests; merge calls: M = 3 requests
    assert res.counters.requests_per_wave == [12, 18, 9, 6]
    assert [s.wave for s in seen] == [1, 2, 3, 4]
    assert seen[-1].tasks_done == 2 and seen[-1].nodes_passed == 7 and seen[0].nodes_passed == 2
    assert len(res.groups) == 8  # 7 execute groups + 1 merge group


def test_verifications_of_a_wave_run_concurrently():
    barrier = threading.Barrier(2, timeout=5)
    h = Harness()
    orch = h.orchestrator(FakeFamily(barrier=barrier), mode="eval", raise_verifier_errors=True, verify_workers=2)
    # the two root artifacts of wave 1 can only pass the barrier if verified at the same time
    plan = Plan((PlanNode("a", "A", "do a"), PlanNode("b", "B", "do b")))
    res = orch.run([task("T1", plan)])
    assert res.traces["T1"].all_passed and res.counters.verifier_calls == 2


def test_verifier_exception_is_a_counted_gate_failure():
    h = Harness(script=lambda i: "CRASH" if i["node"] == "x" else "ok")
    res = h.orchestrator(FakeFamily(raise_on="CRASH"), mode="eval", eval_max_attempts=2).run([task("T", CHAIN)])
    nx_ = res.traces["T"].nodes["x"]
    assert nx_.status == "failed" and "verifier error" in nx_.result.diagnostic
    assert res.counters.verifier_errors == 2


# ------------------------------------------------------------------------------------ merges


def _reward_by_route(target):
    """Execute text whose reward is high only under the router pair ``target[node]``."""
    def script(info):
        if info["kind"] != "exec":
            return f"merged:{info['node']}"
        sub = tuple(sorted(e - 2 for e in info["expert_ids"] if e >= 2))
        hi = target.get(info["node"]) == sub
        return f"{info['node']}:{sub}:R={0.9 if hi else 0.2}"
    return script


def test_merge_inherits_union_of_parents_routed_experts():
    routes = [(0, 1), (1, 2), (2, 3), (3, 0)]
    h = Harness(script=_reward_by_route({"b": (0, 1), "c": (2, 3)}), routes=lambda d, s, S: routes[s])
    res = h.orchestrator(mode="train", routes_per_node=4, candidates_per_route=2).run([task("T", DIAMOND)])
    tr = res.traces["T"].nodes
    assert tr["b"].route == (0, 1) and tr["c"].route == (2, 3)
    merges = h.requests_of("merge")
    assert len(merges) == 2  # M candidates, one route
    for m in merges:
        assert m["expert_ids"] == (1, 2, 3, 4, 5)  # merge role + subtask experts {0,1} ∪ {2,3}
        assert m["expert_weights"] == pytest.approx((0.2,) * 5)
        assert json.loads(m["messages"][-1]["content"])["parents"] == [tr["b"].artifact, tr["c"].artifact]
    (mg,) = [g for g in res.groups if g.role == "merge"]
    assert mg.rewards.shape == (1, 2) and mg.routes == [] and mg.route_set_logp_old.shape == (0,)
    assert tr["d"].merge_active_set == tuple(zip((1, 2, 3, 4, 5), (0.2,) * 5))
    # the execute call of d sees the merge artifact as its context
    (d_exec, *_) = h.requests_of("exec", "d")
    assert d_exec["context"] == tr["d"].merge_artifact == "merged:d"


@pytest.mark.parametrize("merge_mode", ["union", "random_subset"])
def test_merge_routes_x_candidates_follows_the_execute_loop(merge_mode):
    """Alg. 1: mergers follow the same B x M loop; a merge "route" is one draw of the inherited set."""
    routes = [(0, 1), (1, 2), (2, 3), (3, 0)]
    by_route = _reward_by_route({"b": (0, 1), "c": (2, 3)})

    def script(info):  # merge rewards 0.1, 0.3, 0.8 within each row (the merge is alone in its wave)
        return f"merged R={(0.1, 0.3, 0.8)[info['index'] % 3]}" if info["kind"] == "merge" else by_route(info)

    h = Harness(script=script, routes=lambda d, s, S: routes[s])
    res = h.orchestrator(mode="train", routes_per_node=4, candidates_per_route=3, merge_mode=merge_mode,
                         merge_candidates="routes_x_candidates", seed=3).run([task("T", DIAMOND)])
    assert len(h.requests_of("merge")) == 4 * 3
    (mg,) = [g for g in res.groups if g.role == "merge"]
    assert mg.rewards.shape == (4, 3) and mg.routes == [] and mg.route_set_logp_old.shape == (0,)
    union = {1, 2, 3, 4, 5}  # merge role + subtask experts {0,1} ∪ {2,3}
    rows = [{c.expert_ids for c in row} for row in mg.candidates]
    assert all(len(r) == 1 for r in rows)  # one active set per row (route)
    sets = [set(next(iter(r))) for r in rows]
    if merge_mode == "union":
        assert all(s == union for s in sets)
    else:
        assert all(1 in s and s <= union and len(s) >= 2 for s in sets)
    # the examples of each row form their own A_within group (Alg. 1 line 15)
    from morse_jax.rl.examples import examples_from_groups
    seqs, route_ex, _ = examples_from_groups([mg], advantage="hgrpo", num_roles=SPEC.num_roles)
    assert route_ex == []
    u = np.array([0.1, 0.3, 0.8])
    want = (u - u.mean()) / (u.std() + 1e-6)  # per row, population std (DESIGN §5)
    got = np.array([e.advantage for e in seqs]).reshape(4, 3)
    np.testing.assert_allclose(got, np.tile(want, (4, 1)), rtol=1e-4, atol=1e-4)
    # eval: still one merge candidate
    h2 = Harness(routes=lambda d, s, S: routes[s])
    h2.orchestrator(mode="eval", merge_candidates="routes_x_candidates").run([task("T", DIAMOND)])
    assert len(h2.requests_of("merge")) == 1


def test_merge_random_subset_is_nonempty_subset_of_union():
    routes = [(0, 1), (2, 3)]
    h = Harness(script=_reward_by_route({"b": (0, 1), "c": (2, 3)}), routes=lambda d, s, S: routes[s])
    plans = [task(f"T{i}", DIAMOND) for i in range(6)]
    h.orchestrator(mode="train", routes_per_node=2, candidates_per_route=1, merge_mode="random_subset",
                   seed=3).run(plans)
    for m in h.requests_of("merge"):
        ids = m["expert_ids"]
        assert ids[0] == 1 and 1 <= len(ids) - 1 <= 2 and set(ids[1:]) <= {2, 3, 4, 5}
        assert m["expert_weights"] == pytest.approx((1 / len(ids),) * len(ids))
    assert len(h.requests_of("merge")) == 6


def test_merge_failure_is_regenerated_then_fails_node():
    h = Harness(script=lambda i: "BAD merge" if i["kind"] == "merge" else f"ok {i['node']}")
    plan = Plan((*DIAMOND.nodes, PlanNode("e", "E", "do e", ("d",))))
    res = h.orchestrator(mode="eval", eval_max_attempts=2).run([task("T", plan)])
    tr = res.traces["T"].nodes
    merges = h.requests_of("merge")
    assert len(merges) == 2 and "bad output at d" in merges[1]["messages"][-1]["content"]
    assert "Your previous answer" not in merges[0]["messages"][-1]["content"]
    assert tr["d"].status == "failed" and tr["d"].merge_attempts == 2 and tr["d"].execute_attempts == 0
    assert tr["e"].status == "blocked" and tr["e"].blocked_by == "d"
    assert h.requests_of("exec", "d") == [] and h.requests_of("exec", "e") == []


# ------------------------------------------------------------------------------ regeneration


@pytest.mark.parametrize("mode, calls", [("eval", 1), ("train", 3)])
def test_eval_uses_eval_max_attempts(mode, calls):
    """App. I: no revision at evaluation -- eval_max_attempts=1 gives one call; training keeps max_attempts."""
    h = Harness(script=lambda i: "BAD" if i["node"] == "y" else f"good {i['node']}")
    res = h.orchestrator(mode=mode, max_attempts=3, eval_max_attempts=1, routes_per_node=1,
                         candidates_per_route=1).run([task("T", CHAIN)])
    tr = res.traces["T"].nodes
    assert len(h.requests_of("exec", "y")) == calls and tr["y"].execute_attempts == calls
    assert tr["y"].status == "failed" and res.counters.regenerations == calls - 1


@pytest.mark.parametrize("mode", ["eval", "train"])
def test_regeneration_bound_diagnostic_and_blocking(mode):
    h = Harness(script=lambda i: "BAD" if i["node"] == "y" else f"good {i['node']}")
    res = h.orchestrator(mode=mode, max_attempts=3, eval_max_attempts=3, routes_per_node=2,
                         candidates_per_route=2).run([task("T", CHAIN)])
    tr = res.traces["T"].nodes
    per_attempt = 1 if mode == "eval" else 4
    ys = h.requests_of("exec", "y")
    assert len(ys) == 3 * per_attempt and tr["y"].execute_attempts == 3
    diags = [i["diag"] for i in ys]
    assert diags[:per_attempt] == [None] * per_attempt
    assert all(d == "bad output at y" for d in diags[per_attempt:])
    assert tr["y"].status == "failed" and tr["y"].artifact is None
    assert tr["z"].status == "blocked" and tr["z"].blocked_by == "y" and h.requests_of("exec", "z") == []
    assert res.counters.regenerations == 2 and res.counters.waves == 4
    assert [a.passed for a in tr["y"].history] == [False] * 3
    if mode == "train":
        assert [g.attempt for g in res.groups if g.node_id == "y"] == [1, 2, 3]


def test_failing_artifacts_never_propagate():
    waves_seen: dict[tuple, set] = {}

    def script(info):
        seen = waves_seen.setdefault((info["task"], info["node"]), set())
        seen.add(len(h.gen_calls))  # the index of the generate call (wave) in progress
        if info["node"] == "a" and len(seen) == 1:
            return "a BAD first try"
        if info["node"] == "x":  # mixed candidates: some fail, the best passing one propagates
            return ["x BAD R=5", "x ok R=0.3", "x best R=0.8", "x tie R=0.8"][info["index"] % 4]
        return f"{info['node']} fine R=0.5"

    h = Harness(script=script)
    res = h.orchestrator(mode="train", routes_per_node=2, candidates_per_route=2).run(
        [task("T1", DIAMOND), task("T2", CHAIN)])
    for r in h.requests_of("exec") + h.requests_of("merge"):
        assert "BAD" not in json.dumps(r.get("context")) and "BAD" not in json.dumps(r.get("parents"))
    t1, t2 = res.traces["T1"].nodes, res.traces["T2"].nodes
    assert t1["a"].execute_attempts == 2 and t1["a"].artifact == "a fine R=0.5"
    assert {r["context"] for r in h.requests_of("exec", "b")} == {"a fine R=0.5"}
    assert t2["x"].artifact == "x best R=0.8"  # highest passing reward; the tie goes to the first
    assert {r["context"] for r in h.requests_of("exec", "y")} == {"x best R=0.8"}
    (gx,) = [g for g in res.groups if g.node_id == "x"]
    np.testing.assert_allclose(gx.rewards, [[0.0, 0.3], [0.8, 0.8]])


# ---------------------------------------------------------------------------------- grouping


def test_mole_train_groups_are_B_routes_by_M_candidates():
    h = Harness(script=lambda i: f"n1 R={0.1 * (i['index'] + 1):.1f}")
    res = h.orchestrator(mode="train", variant="mole", routes_per_node=2, candidates_per_route=3).run(
        [task("T", ONE)])
    (g,) = res.groups
    assert h.route_calls == [dict(descriptions=["do the one thing"], num_samples=2, greedy=False)]
    assert g.role == "execute" and g.description == "do the one thing" and g.attempt == 1
    assert g.routes == [(0, 1), (1, 2)]
    np.testing.assert_allclose(g.route_set_logp_old, [-0.1, -0.2])
    assert g.rewards.shape == (2, 3)
    np.testing.assert_allclose(g.rewards, np.arange(1, 7).reshape(2, 3) / 10, atol=1e-6)
    for b, row in enumerate(g.candidates):
        want = execute_set(SPEC, g.routes[b])
        for c in row:
            assert list(zip(c.expert_ids, c.expert_weights)) == want
            assert list(c.token_ids) == [7, 8, 9] and c.logprobs.shape == (3,) and len(c.prompt_ids) == 1
    tr = res.traces["T"].nodes["n1"]
    assert tr.route == (1, 2) and tr.artifact == "n1 R=0.6" and tr.route_probs.shape == (4,)


def test_flat_mole_groups_have_one_route_per_candidate():
    h = Harness()
    res = h.orchestrator(mode="train", variant="flat_mole", routes_per_node=2, candidates_per_route=3).run(
        [task("T", ONE)])
    (g,) = res.groups
    assert h.route_calls[0]["num_samples"] == 6
    assert g.rewards.shape == (6, 1) and len(g.routes) == 6 and g.route_set_logp_old.shape == (6,)
    for b, (row, route) in enumerate(zip(g.candidates, g.routes)):
        assert len(row) == 1 and list(zip(row[0].expert_ids, row[0].expert_weights)) == execute_set(SPEC, route)


def test_single_lora_groups_have_no_router_and_one_expert():
    def no_router(*a, **k):
        raise AssertionError("route_fn must not be called without a router")

    h = Harness()
    orch = Orchestrator({"fake": FakeFamily()}, SINGLE, h.generate, no_router, h.encode,
                        OrchestratorConfig(mode="train", variant="single_lora", routes_per_node=2,
                                           candidates_per_route=3))
    res = orch.run([task("T", DIAMOND)])
    for g in res.groups:
        assert g.routes == [] and g.route_set_logp_old.shape == (0,)
        assert g.rewards.shape == ((1, 6) if g.role == "execute" else (1, 3))
    assert {(i["expert_ids"], i["expert_weights"]) for i in h.requests_of()} == {((0,), (1.0,))}


def test_no_adapter_variant_sends_empty_sets():
    h = Harness()
    orch = Orchestrator({"fake": FakeFamily()}, None, h.generate, None, h.encode,
                        OrchestratorConfig(mode="eval", variant="none"))
    res = orch.run([task("T", DIAMOND)])
    assert res.traces["T"].all_passed and h.route_calls == []
    assert {i["expert_ids"] for i in h.requests_of()} == {()}


def test_eval_uses_eval_sampling_and_greedy_route():
    h = Harness()
    cfg = dict(mode="eval", eval_sampling=SamplingSettings(0.0, 1.0, 64), stop_token_ids=(5,))
    res = h.orchestrator(**cfg).run([task("T", ONE)])
    (req,) = h.requests_of()
    assert req["temperature"] == 0.0 and req["expert_ids"] == (0, 2, 3)
    assert res.traces["T"].nodes["n1"].active_set == tuple(execute_set(SPEC, (0, 1)))


# ---------------------------------------------------------------------------------- planning


def test_planner_calls_batched_without_experts():
    h = Harness(planner_script=lambda text, info: good_plan_json("s1", "s2", "s3"))
    res = h.orchestrator(mode="eval").run([task("A"), task("B"), task("C", CHAIN)])
    assert res.counters.planner_requests == [2]  # C has a fixed plan
    plan_reqs = h.gen_calls[0]
    assert len(plan_reqs) == 2 and all(r["kind"] == "plan" and r["expert_ids"] == () for r in plan_reqs)
    assert [n.id for n in res.traces["A"].plan.nodes] == ["s1", "s2", "s3"]
    assert res.traces["C"].plan is CHAIN
    assert res.counters.generate_calls == 1 + res.counters.waves


STEPS = Plan.chain([PlanNode(f"s{i}", f"Step {i}", f"write function f{i}") for i in range(1, 5)])
S_DEPS = '{"dependencies": [{"step": "s3", "depends_on": ["s1"]}, {"step": "s4", "depends_on": ["s2", "s3"]}]}'


def test_planner_infers_dependencies_among_fixed_steps():
    """fixed_plan_dependencies="planner": the fixed steps stay the nodes, the planner draws the edges
    (s2 gets none, so it follows its predecessor, as the authors' code does) and the join runs a merge."""
    seen = []

    def planner(text, info):
        seen.append(text)
        return S_DEPS[len('{"dependencies": ['):] if info["messages"][-1]["role"] == "assistant" else S_DEPS

    for prefix in ("", '{"nodes": ['):
        seen.clear()
        h = Harness(planner_script=planner)
        res = h.orchestrator(mode="eval", fixed_plan_dependencies="planner", planner_prefix=prefix).run(
            [task("T", STEPS), task("U", ONE)])
        plan = res.traces["T"].plan
        assert [(n.id, n.title, n.description) for n in plan.nodes] == [
            (n.id, n.title, n.description) for n in STEPS.nodes]
        assert [n.depends_on for n in plan.nodes] == [(), ("s1",), ("s1",), ("s2", "s3")]
        assert any("attached to its predecessor" in r for r in plan.repairs)
        assert res.traces["U"].plan is ONE  # a one-step fixed plan has no edges to infer
        assert res.counters.planner_requests == [1] and len(seen) == 1
        assert all(f"Step ID: s{i}" in seen[0] and f"write function f{i}" in seen[0] for i in range(1, 5))
        (merge,) = h.requests_of("merge")
        assert merge["node"] == "s4" and res.traces["T"].all_passed
        last = h.requests_of("plan")[0]["messages"][-1]
        assert (last == {"role": "assistant", "content": '{"dependencies": ['}) == bool(prefix)
    h = Harness(planner_script=planner)
    assert h.orchestrator(mode="eval").run([task("T", STEPS)]).traces["T"].plan is STEPS  # "keep"
    assert h.requests_of("plan") == []


def test_unusable_dependency_replies_are_re_asked_then_keep_the_fixed_edges():
    h = Harness(planner_script=lambda text, info: "no json here")
    res = h.orchestrator(mode="eval", fixed_plan_dependencies="planner", max_replans=1).run([task("T", STEPS)])
    plan = res.traces["T"].plan
    assert [n.depends_on for n in plan.nodes] == [n.depends_on for n in STEPS.nodes]
    assert res.counters.planner_requests == [1, 1] and res.counters.plan_fallbacks == 1
    assert sum(r.startswith("planner attempt") for r in plan.repairs) == 2 and "kept the fixed plan's dependencies" in plan.repairs[-1]
    assert "rejected" in h.requests_of("plan")[1]["messages"][-1]["content"]


def test_garbage_plan_replanned_then_single_node_fallback():
    def planner(text, info):
        if "task A description" in text:
            return "no json here"
        if "task C description" in text and "rejected" not in text:
            return '{"nodes": [{"id": "q1"}]}'  # no description: invalid
        return good_plan_json("p1", "p2")

    h = Harness(planner_script=planner)
    res = h.orchestrator(mode="eval", max_replans=2).run([task("A"), task("B"), task("C")])
    assert res.counters.planner_requests == [3, 2, 1]
    assert res.counters.replans == 3 and res.counters.plan_fallbacks == 1
    pa, pc = res.traces["A"].plan, res.traces["C"].plan
    assert len(pa.nodes) == 1 and pa.nodes[0].description == "task A description"
    assert any("fell back" in r for r in pa.repairs) and sum(r.startswith("planner attempt") for r in pa.repairs) == 3
    assert [n.id for n in pc.nodes] == ["p1", "p2"] and "rejected" in pc.repairs[0]
    # the re-plan prompt carries the rejected answer and the reason
    second_round = [r for r in h.gen_calls[1]]
    assert all(r["messages"][-2]["role"] == "assistant" for r in second_round)
    assert all(res.traces[t].all_passed for t in "ABC")


def test_explicit_plans_override_and_are_checked():
    h = Harness()
    orch = h.orchestrator(mode="eval")
    res = orch.run([task("A")], plans={"A": CHAIN})
    assert res.counters.planner_rounds == 0 and res.traces["A"].plan is CHAIN
    bad = Plan((PlanNode("u", "U", "do u", ("v",)), PlanNode("v", "V", "do v")))
    with pytest.raises(ValueError, match="not an earlier node"):
        orch.run([task("A")], plans={"A": bad})
    with pytest.raises(ValueError, match="unknown task"):
        orch.run([task("A")], plans={"Z": CHAIN})


def test_single_agent_mode_one_node_per_task():
    h = Harness()
    res = h.orchestrator(mode="eval", single_agent=True).run([task("A"), task("B", DIAMOND)])
    assert res.counters.planner_rounds == 0
    for tid in "AB":
        (node,) = res.traces[tid].plan.nodes
        assert node.description == f"task {tid} description"
    assert res.counters.waves == 1 and res.counters.requests_per_wave == [2]


# -------------------------------------------------------------------------------- config etc.


@pytest.mark.parametrize("kwargs, field", [
    (dict(mode="fit"), "mode"), (dict(variant="moe"), "variant"), (dict(variant="none"), "variant"),
    (dict(routes_per_node=0), "routes_per_node"), (dict(merge_mode="all"), "merge_mode"),
    (dict(max_nodes=1, min_nodes=2), "max_nodes"), (dict(train_sampling=SamplingSettings(top_p=0)), "top_p"),
    (dict(stop_token_ids=(-1,)), "stop_token_ids"), (dict(max_replans=-1), "max_replans"),
])
def test_config_rejects_bad_fields(kwargs, field):
    with pytest.raises(ValueError, match=field):
        OrchestratorConfig(**kwargs)


def test_config_from_mapping_and_spec_checks():
    cfg = OrchestratorConfig.from_mapping({"mode": "eval", "eval_sampling": {"temperature": 0.2},
                                           "stop_token_ids": [2, 3]})
    assert cfg.eval_sampling.temperature == 0.2 and cfg.stop_token_ids == (2, 3)
    with pytest.raises(ValueError, match="unknown field"):
        OrchestratorConfig.from_mapping({"modes": "eval"})
    h = Harness()
    with pytest.raises(ValueError, match="top_k"):
        h.orchestrator(spec=ExpertBankSpec(num_subtask=1))
    with pytest.raises(ValueError, match="single_lora"):
        h.orchestrator(spec=SPEC, variant="single_lora")
    with pytest.raises(ValueError, match="family 'other'"):
        h.orchestrator().run([Task("X", "x", "other")])
    assert h.orchestrator().max_active == 5


def test_render_trace_shows_dag_statuses_and_artifacts():
    h = Harness(script=lambda i: "BAD" if i["node"] == "b" else f"art {i['node']}")
    res = h.orchestrator(mode="eval", eval_max_attempts=1).run([task("T", DIAMOND)])
    text = render_trace(res.traces["T"])
    assert "Plan: 4 nodes" in text and "[join: merge of b, c]" in text
    assert "== a: A [passed]" in text and "   | art a" in text
    assert "== b: B [failed]" in text and "bad output at b" in text
    assert "   rejected output:\n   | BAD" in text  # a failed node still shows what it produced
    assert "== d: D [blocked] blocked by failed node b" in text


def test_planner_prefix_starts_the_answer_and_is_parsed_with_it():
    prefix = '{"nodes": ['
    full = good_plan_json("a1", "a2")
    assert full.startswith(prefix)
    h = Harness(planner_script=lambda text, info: full[len(prefix):])  # the model continues the prefix
    res = h.orchestrator(mode="eval", planner_prefix=prefix).run([task("A")])
    plan_prompt = h.requests_of("plan")[0]["messages"]
    assert plan_prompt[-1] == {"role": "assistant", "content": prefix}
    assert [n.id for n in res.traces["A"].plan.nodes] == ["a1", "a2"] and res.counters.replans == 0


def test_verify_collective_wraps_each_wave_once():
    # A multi-process job verifies on process 0 only: the hook gets one thunk per wave, from the
    # main thread, and its (possibly broadcast) return value is what the orchestrator uses.
    seen = []

    def collective(thunk):
        seen.append(threading.current_thread() is threading.main_thread())
        return [None if v is None else (VerifyResult(v[0].gate, v[0].reward, v[0].diagnostic), v[1])
                for v in thunk()]

    h = Harness()
    orch = Orchestrator({"fake": FakeFamily()}, SPEC, h.generate, h.route, h.encode,
                        OrchestratorConfig(mode="eval"), verify_collective=collective)
    res = orch.run([task("A"), task("B", CHAIN)])
    assert len(seen) == res.counters.waves and all(seen)
    assert all(res.traces[t].all_passed for t in "AB")


class PrefixFamily(FakeFamily):
    def answer_prefix(self, task, node, role):
        return f"START[{role}:{node.id}] " if role == "execute" else ""


def test_answer_prefix_ends_the_prompt_and_starts_the_extracted_text():
    h = Harness(script=lambda info: "body")
    res = Orchestrator({"fake": PrefixFamily()}, SPEC, h.generate, h.route, h.encode,
                       OrchestratorConfig(mode="eval")).run([task("A", CHAIN)])
    execs = h.requests_of("exec")
    assert execs and all(r["messages"][-1] == {"role": "assistant", "content": f"START[execute:{r['node']}] "}
                         for r in execs)
    assert all(n.artifact == f"START[execute:{nid}] body" for nid, n in res.traces["A"].nodes.items())
    h2 = Harness(script=lambda info: "body")
    res2 = Orchestrator({"fake": PrefixFamily()}, SPEC, h2.generate, h2.route, h2.encode,
                        OrchestratorConfig(mode="eval", answer_prefix=False)).run([task("A", CHAIN)])
    assert all(n.artifact == "body" for n in res2.traces["A"].nodes.values())
