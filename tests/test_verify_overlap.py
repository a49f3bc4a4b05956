"""Verification overlapped with generation (issue 20): same rewards and traces as verifying after
generation, a crash or timeout in one verification costs only its candidate, at most
``verify_workers`` verifications in flight, and verification really starts before generation ends.

The generators here report their micro-batches through ``on_ready`` like ``Sampler.generate``
(in an order other than the request order, as the sampler's length sort does).
"""

from __future__ import annotations

import re
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from morse_jax.config.defaults import get_config
from morse_jax.config.derived import orchestrator_config
from morse_jax.config.validate import ConfigError, validate_config
from morse_jax.mole.experts import ExpertBankSpec
from morse_jax.sampling.sampler import Completion
from morse_jax.tasks.base import Task, VerifyResult
from morse_jax.tasks.plan import Plan, PlanNode
from morse_jax.tasks.pyfuncs import data as pd
from morse_jax.tasks.pyfuncs.family import PyFuncsFamily, merged_reference
from morse_jax.tasks.pyfuncs.verify import Limits
from morse_jax.tomas.orchestrator import Orchestrator, OrchestratorConfig, render_trace
from morse_jax.tomas.verification import WaveVerification, verify_threads

SINGLE = ExpertBankSpec(role_names=("single",), num_subtask=0, rank=24)
TAG = re.compile(r"\[\[task=(\S+) node=(\S+) role=(\S+)\]\]")


class Generator:
    """encode_fn + a generate_fn with ``on_ready``: requests go in micro-batches of ``mb``, taken
    from the end of the wave backwards; ``answer(task, node, role, k)`` writes candidate k of a call."""

    def __init__(self, answer, mb: int = 3, between=None):
        self.answer, self.mb, self.between = answer, mb, between
        self.prompts: list[list[dict]] = []
        self.reported: list[list[int]] = []  # per micro-batch: its request indices

    def encode(self, messages):
        self.prompts.append([dict(m) for m in messages])
        return [len(self.prompts) - 1]

    def _text(self, requests, i, seen):
        tid, node, role = TAG.search(self.prompts[requests[i].prompt_ids[0]][0]["content"]).groups()
        k = seen[(tid, node, role)] = seen.get((tid, node, role), -1) + 1
        return self.answer(tid, node, role, k)

    def generate(self, requests, on_ready=None):
        seen: dict = {}
        texts = [self._text(requests, i, seen) for i in range(len(requests))]
        out = [Completion([5, 6], t, np.full(2, -0.5, np.float32), "eos", 1) for t in texts]
        order = list(range(len(requests)))[::-1]
        for n, start in enumerate(range(0, len(order), self.mb)):
            if n and self.between is not None:
                self.between(n)  # "generating" micro-batch n
            idx = order[start:start + self.mb]
            self.reported.append(idx)
            if on_ready is not None:
                on_ready(idx, [out[i] for i in idx])
        return out


def tagged(messages, task, node, role):
    """The family's messages with a tag the fake generator reads back (the system message)."""
    msgs = [dict(m) for m in messages]
    msgs[0]["content"] = f"[[task={task.task_id} node={node.id} role={role}]] {msgs[0]['content']}"
    return msgs


class TaggedPyFuncs(PyFuncsFamily):
    """PyFuncs with its real sandboxed verifier; prompts carry a tag for the fake generator."""

    def execute_messages(self, task, node, context, diagnostic):
        return tagged(super().execute_messages(task, node, context, diagnostic), task, node, "execute")

    def merge_messages(self, task, node, parent_artifacts):
        return tagged(super().merge_messages(task, node, parent_artifacts), task, node, "merge")


def fence(code: str) -> str:
    return f"```python\n{code}\n```"


def pyfuncs_answers(tasks):
    """Per call: candidate 0 the reference, odd ones wrong; in task 0's first helper call
    candidate 1 crashes its sandbox (os.abort) and candidate 2 hangs past the run's time limit."""
    by_id = {t.task_id: PyFuncsFamily.payload(t) for t in tasks}
    first = tasks[0].task_id

    def answer(tid, node, role, k):
        p = by_id[tid]
        if role == "merge":
            return fence(merged_reference(p) if k % 2 == 0 else "def nothing():\n    return 1\n")
        spec = p.step(node).spec
        if tid == first and node == p.helpers[0].node_id and k in (1, 2):
            body = ("    import os\n    os.abort()\n" if k == 1 else
                    "    import signal, time\n    signal.signal(signal.SIGALRM, signal.SIG_IGN)\n"
                    "    while True:\n        time.sleep(0.01)\n")
            return fence(f"{spec.header}\n{body}")
        if k % 2 == 1:
            return fence(f"{spec.header}\n    return None\n")  # parses, passes the gate, fails the tests
        return fence(spec.reference)

    return answer


def run_pyfuncs(tasks, **cfg):
    gen = Generator(pyfuncs_answers(tasks))
    fam = TaggedPyFuncs(Limits(timeout_s=3.0, call_timeout_s=0.5))
    orch = Orchestrator({fam.name: fam}, SINGLE, gen.generate, None, gen.encode,
                        OrchestratorConfig(mode="train", variant="single_lora", routes_per_node=2,
                                           candidates_per_route=2, answer_prefix=False, **cfg))
    return orch.run(tasks), gen


def candidate_view(res):
    """Everything verification decides, per rollout group and candidate, in order."""
    return [(g.task_id, g.node_id, g.role, g.attempt,
             [(c.artifact, c.result.gate, c.result.reward, c.result.diagnostic, dict(c.result.components))
              for row in g.candidates for c in row]) for g in res.groups]


def test_overlapped_pyfuncs_rewards_and_traces_match_sequential_and_faults_cost_one_candidate():
    tasks = [pd.make_task("train", 0), pd.make_task("train", 1)]
    seq, seq_gen = run_pyfuncs(tasks, verify_overlap=False, verify_workers=1)
    ovl, ovl_gen = run_pyfuncs(tasks, verify_overlap=True, verify_workers=2)
    assert len(ovl_gen.reported) > len(seq.counters.requests_per_wave)  # several micro-batches per wave
    assert candidate_view(ovl) == candidate_view(seq)
    for tid in seq.traces:
        assert render_trace(ovl.traces[tid]) == render_trace(seq.traces[tid])
    for name in ("waves", "requests_per_wave", "verifier_calls", "verifier_errors", "regenerations"):
        assert getattr(ovl.counters, name) == getattr(seq.counters, name), name
    # the faulty call: crash and timeout score 0, the reference and the wrong answer are scored as usual
    p0 = PyFuncsFamily.payload(tasks[0])
    g = next(g for g in ovl.groups if g.task_id == tasks[0].task_id and g.node_id == p0.helpers[0].node_id)
    rewards = [c.result.reward for row in g.candidates for c in row]
    assert rewards == [1.0, 0.0, 0.0, 0.0]
    assert all(c.result.gate for row in g.candidates for c in row)  # gate passed: the run itself failed
    # every node of both tasks passed on its first attempt: the faults cost nothing else
    for tr in ovl.traces.values():
        assert all(n.status == "passed" and n.execute_attempts == 1 for n in tr.nodes.values())


class FakeFamily:
    """Two-node chain; verify: 'CRASH' raises, 'R=x' sets the reward; counts verifications in flight."""

    name = "fake"

    def __init__(self, on_verify=None):
        self.lock, self.in_flight, self.max_in_flight, self.calls = threading.Lock(), 0, 0, 0
        self.on_verify = on_verify

    def fixed_plan(self, task):
        return Plan.chain([PlanNode("a", "A", "do a"), PlanNode("b", "B", "do b")])

    def execute_messages(self, task, node, context, diagnostic):
        return [{"role": "system", "content": f"[[task={task.task_id} node={node.id} role=execute]]"},
                {"role": "user", "content": f"context={context} diag={diagnostic}"}]

    def merge_messages(self, task, node, parent_artifacts):
        raise AssertionError("a chain has no merge")

    def extract_artifact(self, task, node, completion):
        return completion.strip()

    def verify(self, task, node, artifact):
        with self.lock:
            self.in_flight += 1
            self.calls += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            if self.on_verify is not None:
                self.on_verify(artifact)
            if "CRASH" in artifact:
                raise RuntimeError("verifier crashed")
            r = float(re.search(r"R=([0-9.]+)", artifact).group(1))
            return VerifyResult(r > 0, r, "" if r > 0 else "zero reward")
        finally:
            with self.lock:
                self.in_flight -= 1


def fake_answer(tid, node, role, k):
    if tid == "T0" and node == "a" and k == 3:
        return "CRASH"
    return f"{tid}/{node}/{k} R={(k * 7 + len(tid)) % 5 / 4}"


def run_fake(family, gen, **cfg):
    cfg = {"mode": "train", "variant": "single_lora", "routes_per_node": 2, "candidates_per_route": 3, **cfg}
    orch = Orchestrator({"fake": family}, SINGLE, gen.generate, None, gen.encode, OrchestratorConfig(**cfg))
    return orch.run([Task(f"T{i}", f"task {i}", "fake") for i in range(3)])


def test_a_verifier_exception_in_a_worker_costs_only_its_candidate_in_both_schedules():
    seq = run_fake(FakeFamily(), Generator(fake_answer), verify_overlap=False, verify_workers=1)
    ovl = run_fake(FakeFamily(), Generator(fake_answer), verify_overlap=True, verify_workers=3)
    assert candidate_view(ovl) == candidate_view(seq)
    assert ovl.counters.verifier_errors == seq.counters.verifier_errors == 1
    g = next(g for g in ovl.groups if (g.task_id, g.node_id) == ("T0", "a"))
    flat = [c.result for row in g.candidates for c in row]
    assert "verifier error (RuntimeError: verifier crashed)" in flat[3].diagnostic and flat[3].reward == 0.0
    expected = [(k * 7 + 2) % 5 / 4 for k in range(6)]  # from fake_answer's rule, "T0" has length 2
    assert [r.reward for i, r in enumerate(flat) if i != 3] == [x for i, x in enumerate(expected) if i != 3]


@pytest.mark.parametrize("workers", [1, 2, 3])
def test_never_more_than_verify_workers_in_flight(workers):
    # a barrier of `workers` parties: verifications only proceed `workers` at a time, so the
    # bound is reached; the counter shows it is never exceeded
    barrier = threading.Barrier(workers, timeout=20)
    fam = FakeFamily(on_verify=lambda artifact: barrier.wait())
    res = run_fake(fam, Generator(lambda tid, node, role, k: f"{tid}{node}{k} R=1", mb=4),
                   verify_overlap=True, verify_workers=workers, candidates_per_route=workers * 2)
    assert fam.calls == res.counters.verifier_calls == 2 * 3 * 2 * workers * 2  # nodes x tasks x B x M
    assert fam.max_in_flight == workers


def test_verification_starts_while_the_sampler_still_generates():
    started = threading.Event()
    waited: list[bool] = []

    def between(n):  # the sampler "generates" micro-batch n: a verification of an earlier one is running
        waited.append(started.wait(timeout=30) if all(waited) else False)  # fail once, not per micro-batch

    fam = FakeFamily(on_verify=lambda artifact: started.set())
    res = run_fake(fam, Generator(fake_answer, mb=2, between=between), verify_overlap=True, verify_workers=2)
    assert waited and all(waited)
    assert res.counters.verifier_calls == fam.calls


def test_without_overlap_nothing_is_verified_before_generation_returns():
    calls_during: list[int] = []
    fam = FakeFamily()
    gen = Generator(fake_answer, mb=2, between=lambda n: calls_during.append(fam.calls))
    run_fake(fam, gen, verify_overlap=False, verify_workers=2)
    assert calls_during and all(c % 18 == 0 for c in calls_during)  # whole earlier waves only (3 tasks x 2 x 3)


def test_generate_fn_without_on_ready_still_works_overlapped():
    gen = Generator(fake_answer)
    plain = lambda requests: gen.generate(requests)  # noqa: E731 -- no on_ready keyword
    orch = Orchestrator({"fake": FakeFamily()}, SINGLE, plain, None, gen.encode,
                        OrchestratorConfig(mode="train", variant="single_lora", routes_per_node=2,
                                           candidates_per_route=3))
    res = orch.run([Task(f"T{i}", f"task {i}", "fake") for i in range(3)])
    ref = run_fake(FakeFamily(), Generator(fake_answer), verify_overlap=False, verify_workers=1)
    assert candidate_view(res) == candidate_view(ref)


def test_wave_verification_rejects_a_generator_that_misreports():
    def extract(j, text):
        return text, None

    def verify(j, artifact):
        return VerifyResult(True, 1.0), False

    comps = [Completion([1], t, np.zeros(1, np.float32), "eos", 1) for t in ("a", "b", "c")]
    with ThreadPoolExecutor(2) as pool:
        wv = WaveVerification(3, extract, verify, pool)
        wv.arrive([1], [comps[1]])
        with pytest.raises(RuntimeError, match="twice"):
            wv.arrive([1], [comps[1]])
        with pytest.raises(RuntimeError, match="out of range"):
            wv.arrive([3], [comps[0]])
        wv2 = WaveVerification(3, extract, verify, pool)
        wv2.arrive([0], [comps[1]])  # the wrong completion for request 0
        with pytest.raises(RuntimeError, match="different completion for request 0"):
            wv2.complete(comps)
        wv3 = WaveVerification(3, extract, verify, None)
        wv3.arrive([2, 0], [comps[2], comps[0]])
        wv3.complete(comps)
        assert wv3.artifacts == ["a", "b", "c"]
        assert [v[0].reward for v in wv3.gather(pool)] == [1.0, 1.0, 1.0]


def test_config_fields_checked_and_passed_through():
    with pytest.raises(ValueError, match="orchestrator.verify_workers must be an int >= 0"):
        OrchestratorConfig(verify_workers=-1)
    with pytest.raises(ValueError, match="orchestrator.verify_overlap must be a bool"):
        OrchestratorConfig(verify_overlap=1)
    assert verify_threads(3) == 3 and verify_threads(0) >= 1
    cfg = get_config()
    cfg.model.path = "embedded"
    cfg.rollout.verify_workers, cfg.rollout.verify_overlap = 3, False
    validate_config(cfg, check_paths=False)
    o = orchestrator_config(cfg, "train")
    assert (o.verify_workers, o.verify_overlap) == (3, False)
    cfg.rollout.verify_workers = -2
    with pytest.raises(ConfigError) as e:
        validate_config(cfg, check_paths=False)
    assert str(e.value) == "config.rollout.verify_workers: must be >= 0 (0 = one per CPU), got -2"
