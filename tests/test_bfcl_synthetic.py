"""The leakage-free generated function-calling sets (``synthetic``'s invented domains and
``questions``' everyday questions): deterministic, large, distinct, disjoint from BFCL (function
names and 8-word phrases), and every reference call valid under BFCL's own checker."""

from __future__ import annotations

import collections
import json
import re

import pytest

from morse_jax.tasks import bfcl
from morse_jax.tasks.bfcl import questions, synthetic

N = 4000
GENERATORS = {"synthetic": synthetic, "questions": questions}
# share of distinct request texts (the same question offered other functions is another record):
# questions' catalogue is smaller (36 tools, short value lists)
MIN_DISTINCT_QUERIES = {synthetic: 0.95, questions: 0.75}


@pytest.fixture(scope="module", params=sorted(GENERATORS))
def generator(request):
    return GENERATORS[request.param]


@pytest.fixture(scope="module")
def records(generator):
    return generator.generate(N, seed=0)


def test_deterministic_and_distinct(generator, records):
    assert generator.generate(N, seed=0) == records
    assert generator.generate(300, seed=7) == generator.generate(300, seed=7)
    assert generator.generate(300, seed=7) != generator.generate(300, seed=8)
    assert len({(r["query"], tuple(f["name"] for f in r["functions"])) for r in records}) == N
    assert len({r["query"] for r in records}) > MIN_DISTINCT_QUERIES[generator] * N
    counts = collections.Counter(r["scenario"] for r in records)
    assert set(counts) == set(synthetic.SCENARIOS) and min(counts.values()) > 0.07 * N
    with pytest.raises(ValueError, match="unknown scenario"):
        generator.generate(5, mix={"simple": 1.0, "chitchat": 1.0})


def test_no_function_name_occurs_in_any_bfcl_category(records):
    generated = {f["name"] for r in records for f in r["functions"]} | set(questions.catalogue_names())
    for seed in (0, 1, 2, 3):
        generated |= set(synthetic.catalogue_names(seed))
    bfcl_names = bfcl.function_names(bfcl.CATEGORIES)
    assert len(bfcl_names) > 1000  # all 11 categories were read
    assert not generated & bfcl_names
    # nor after BFCL's underscore/dot normalisation of names
    norm = lambda n: n.replace(".", "_").lower()  # noqa: E731
    assert not {norm(n) for n in generated} & {norm(n) for n in bfcl_names}


def test_function_docs_look_like_bfcl_prompt_docs(records):
    shown = bfcl.load("simple_python", limit=1)[0].functions[0]
    hint = shown["description"][shown["description"].index(" Note that"):]
    for r in records[:200]:
        for f in r["functions"]:
            assert f["description"].endswith(hint) and f["parameters"]["type"] == "dict"


def _ngrams(text: str, n: int = 8) -> set[tuple[str, ...]]:
    words = re.findall(r"[a-z0-9']+", text.lower())
    return {tuple(words[i:i + n]) for i in range(len(words) - n + 1)}


def test_no_query_shares_an_8_gram_with_a_bfcl_question(records):
    bfcl_grams = set()
    for c in bfcl.CATEGORIES:
        for item in bfcl.load(c):
            for m in item.question:
                bfcl_grams |= _ngrams(m["content"])
    assert len(bfcl_grams) > 10000
    shared = [r["query"] for r in records if _ngrams(r["query"]) & bfcl_grams]
    assert not shared, shared[:3]


CATEGORY = {"simple": "simple_python", "multiple": "multiple", "parallel": "parallel",
            "parallel_multiple": "parallel_multiple", "irrelevance": "irrelevance"}


def test_reference_calls_pass_bfcl_checker(records):
    """Each reference call, as text, is correct under BFCL's checker with the record's own schema as
    the function docs and the call as the only possible answer (omitted optional arguments = "")."""
    for r in records[:1500]:
        gt = None
        if r["calls"]:
            gt = []
            for call in r["calls"]:
                (name, args), = call.items()
                fn = next(f for f in r["functions"] if f["name"] == name)
                props = fn["parameters"]["properties"]
                assert set(fn["parameters"]["required"]) <= set(args) <= set(props)
                gt.append({name: {p: [args[p]] if p in args else [""] for p in props}})
            gt = tuple(gt)
        item = bfcl.BfclItem(id=r["id"], category=CATEGORY[r["scenario"]], question=({"role": "user",
                             "content": r["query"]},), functions=tuple(r["functions"]),
                             checker_functions=tuple(r["functions"]), ground_truth=gt)
        text = bfcl.format_calls(r["calls"]) if r["calls"] else "None of the functions can do that."
        result = bfcl.score(item, text)
        assert result.correct, (r, result)
        if r["scenario"] == "irrelevance":
            called = {f["name"] for f in r["functions"]}
            assert not bfcl.score(item, f"[{next(iter(called))}()]").correct


def test_every_argument_value_is_stated_in_the_query(records):
    for r in records:
        for call in r["calls"]:
            (name, args), = call.items()
            for k, v in args.items():
                if isinstance(v, bool):
                    continue  # stated by a phrase ("notifying the team" / "just once")
                for x in v if isinstance(v, list) else [v]:
                    assert str(x) in r["query"], (k, x, r["query"])


def test_cli_writes_multi_role_jsonl(tmp_path, capsys):
    from morse_jax.tasks import trajectories as data

    out = tmp_path / "train.jsonl"
    synthetic.main(["--n", "40", "--seed", "3", "--out", str(out)])
    trajs, skipped = data.load_jsonl(out)
    assert skipped == 0 and [t.turns[0].content for t in trajs] == [r["query"] for r in synthetic.generate(40, 3)]
    plain = tmp_path / "plain.jsonl"
    synthetic.main(["--n", "40", "--seed", "3", "--out", str(plain), "--plain"])
    assert [json.loads(line) for line in plain.read_text().splitlines()] == synthetic.generate(40, 3)


def test_questions_source_is_the_generated_questions_with_a_held_out_tail():
    """moragent.train_data="questions": questions.generate's records in their order, converted, the last
    heldout_examples held out; heldout_examples must leave a training example."""
    from morse_jax.config.defaults import get_config
    from morse_jax.config.validate import ConfigError, validate_config
    from morse_jax.run.agent_training import training_trajectories

    c = get_config()
    c.system, c.mode, c.variant, c.model.path = "moragent", "train", "mor", "embedded"
    m = c.moragent
    m.train_data, m.synthetic_examples, m.heldout_examples = "questions", 30, 5
    validate_config(c, check_paths=False)
    train, held = training_trajectories(c)
    expected = questions.generate(30, seed=c.seed)
    assert [t.id for t in train + held] == [r["id"] for r in expected] and len(held) == 5
    assert [t.turns[0].content for t in held] == [r["query"] for r in expected[25:]]
    m.heldout_examples = 30
    with pytest.raises(ConfigError, match="heldout_examples: 30 leaves no training example"):
        validate_config(c, check_paths=False)
