"""The MoRAgent job: its config (variants, validation one line per error, the derived adapter and
SFT settings), the report's layout over sibling runs, and a tiny end-to-end run (SFT a few steps
-> role-loop evaluation of a handful of BFCL items -> report, then the base row beside it)."""

from __future__ import annotations

import importlib.util
import json
import time
from pathlib import Path

import pytest

from morse_jax.config import derived
from morse_jax.config.validate import ConfigError, validate_config
from morse_jax.models import ModelConfig
from morse_jax.run import moragent as ma
from morse_jax.tasks import bfcl
from morse_jax.tasks.bfcl.subset import DEFAULT_SUBSET, parse_subset, select_items, spaced

REPO = Path(__file__).resolve().parents[1]


def _config(name="moragent_quickstart", variant="mor"):
    spec = importlib.util.spec_from_file_location(name, REPO / "configs" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.get_config(variant)


def test_variants_set_their_rows():
    assert _config(variant="base").mode == "eval"
    assert _config(variant="mor_no_router").moragent.routers is False
    assert _config(variant="mor_no_balance").moragent.balance_weight == 0.0
    assert _config(variant="mor_no_orth").moragent.orth_weight == 0.0
    assert _config(variant="lora").workdir == "runs/moragent_quickstart_lora"
    paper = _config("moragent_bfcl")
    m = paper.moragent
    assert (m.epochs, m.lr, m.balance_weight, m.orth_weight, m.rank) == (4, 5e-5, 1e-3, 1e-4, 16)
    assert tuple(m.targets) == ("q", "k", "v", "o", "gate", "up", "down") and m.n_adapt == 0
    assert (tuple(m.routed), tuple(m.top_k)) == ((4, 4, 3), (3, 3, 2))


@pytest.mark.parametrize("name", ["moragent_quickstart", "moragent_bfcl"])
@pytest.mark.parametrize("variant", ["base", "lora", "mor", "mor_no_router", "mor_no_balance", "mor_no_orth"])
def test_every_config_and_variant_validates(name, variant):
    cfg = _config(name, variant)
    assert cfg.variant == variant and cfg.mode == ("eval" if variant == "base" else "train")
    if not cfg.model.path:  # the paper config: the user gives the checkpoint
        with pytest.raises(ConfigError, match=r"^config\.model\.path: required"):
            validate_config(cfg, check_paths=False)
        cfg.model.path = "/ckpt/Llama-3.2-1B-Instruct"
    validate_config(cfg, check_paths=False)


def test_derived_adapter_and_sft_settings():
    mc = ModelConfig(family="llama", vocab_size=61, hidden_size=32, intermediate_size=48, num_layers=9, num_heads=4,
                     num_kv_heads=2, head_dim=8)
    assert derived.mor_config(_config(variant="base"), mc) is None
    mor = derived.mor_config(_config(), mc)
    assert (mor.kind, mor.routing, mor.rank, mor.n_adapt, mor.use_balance, mor.use_orth) == \
        ("mor", "router", 4, 8, True, True)
    assert derived.mor_config(_config(variant="mor_no_router"), mc).routing == "uniform"
    assert derived.mor_config(_config(variant="mor_no_balance"), mc).use_balance is False
    assert derived.mor_config(_config(variant="mor_no_orth"), mc).use_orth is False
    lora = derived.mor_config(_config(variant="lora"), mc)
    assert lora.kind == "lora" and lora.rank > mor.rank  # one LoRA with the group's budget
    s = derived.sft_config(_config())
    assert (s.learning_rate, s.epochs, s.micro_batch, s.accum_steps, s.max_len) == (5e-4, 4, 4, 2, 1024)


@pytest.mark.parametrize("override,message", [
    ({"variant": "D"}, "config.variant: must be one of ['base', 'lora', 'mor', 'mor_no_balance', 'mor_no_orth', "
                       "'mor_no_router'] with system=moragent, got 'D'"),
    ({"mode": "plan"}, "config.mode: must be one of ('train', 'eval') with system=moragent, got 'plan'"),
    ({"moragent.top_k": (3, 5, 2)}, "config.moragent.top_k: executor keeps 5 of 4 routed LoRAs (moragent.routed)"),
    ({"moragent.routed": (4, 4)}, "config.moragent.routed: must be 3 ints >= 1 (one per role: reasoner, executor, "
                                  "summarizer), got (4, 4)"),
    ({"moragent.targets": ("q", "x")}, "config.moragent.targets: must be a non-empty subset of"),
    ({"moragent.shared_gate": "relu"}, "config.moragent.shared_gate: must be one of ('always', 'sigmoid'), got 'relu'"),
    ({"moragent.thought": "prose"}, "config.moragent.thought: must be one of ('names', 'plan'), got 'prose'"),
    ({"moragent.micro_batch": 3}, "config.moragent.batch_size: 8 is not a multiple of config.moragent.micro_batch=3"),
    ({"moragent.eval_subset": ("simple:5",)}, "config.moragent.eval_subset: entry 'simple:5': unknown category"),
    ({"moragent.eval_subset": ("multiple:x",)}, "config.moragent.eval_subset: entry 'multiple:x': the count"),
    ({"moragent.heldout_examples": 300}, "config.moragent.heldout_examples: 300 leaves no training example"),
    ({"moragent.train_data": "/no/such.jsonl"}, "config.moragent.train_data: /no/such.jsonl is not 'synthetic'"),
    ({"moragent.lr": 0.0}, "config.moragent.lr: must be > 0, got 0.0"),
    ({"moragent.live_examples": -1}, "config.moragent.live_examples: must be >= 0, got -1"),
    ({"moragent.train_data": "bfcl_live", "moragent.eval_subset": ("simple_python:5", "live_simple:5")},
     "config.moragent.eval_subset: live_simple would score items of the categories"),
    ({"moragent.train_data": "synthetic+bfcl_live", "moragent.eval_subset": ("live_multiple:5",)},
     "config.moragent.eval_subset: live_multiple would score items of the categories"),
    ({"system": "other"}, "config.system: must be one of ('morse', 'moragent'), got 'other'"),
])
def test_config_errors_are_one_line_naming_the_field(override, message):
    c = _config()
    for dotted, value in override.items():
        node = c
        *groups, field = dotted.split(".")
        for g in groups:
            node = node[g]
        node[field] = value
    with pytest.raises(ConfigError) as e:
        validate_config(c)
    assert str(e.value).startswith(message) and "\n" not in str(e.value)


def test_base_row_cannot_train():
    c = _config(variant="base")
    c.mode = "train"
    with pytest.raises(ConfigError, match="config.mode: variant 'base' has no adapters to train; use mode=eval"):
        validate_config(c)


def test_subset_is_fixed_and_spread():
    assert parse_subset("simple_python:3, irrelevance") == (("simple_python", 3), ("irrelevance", 0))
    assert spaced(10, 3) == [0, 3, 6] and spaced(4, 0) == [0, 1, 2, 3] and spaced(4, 9) == [0, 1, 2, 3]


@pytest.mark.parametrize("category", ["simple_python", "multiple", "parallel", "irrelevance", "live_simple"])
def test_dev_split_never_touches_any_scored_subset(category):
    """Dev items are drawn from outside issue 19's full subset (so also outside its halves, the
    quickstart's), evenly spaced and fixed; by item id, from the loaded category itself."""
    every = [it.id for it in bfcl.load(category)]
    full = dict(DEFAULT_SUBSET).get(category, 0)
    scored = set()
    for n in {full, full // 2} - {0}:
        scored |= {it.id for it in select_items(((category, n),))}
    dev = [it.id for it in select_items(((category, 12),), "dev")]
    assert len(dev) == len(set(dev)) == 12 and not scored & set(dev)
    assert dev == [it.id for it in select_items(((category, 12),), "dev")]
    pos = [every.index(i) for i in dev]
    assert pos == sorted(pos) and pos[-1] - pos[0] > len(every) // 2  # spread over the category
    with pytest.raises(ValueError, match="split must be one of"):
        select_items(((category, 1),), "val")


def _fake_run(root: Path, name: str, variant: str, verdicts: dict, subset=("simple_python:2", "irrelevance:1")):
    d = root / name
    d.mkdir()
    cfg = _config(variant=variant)
    cfg.moragent.eval_subset = subset
    settings = ma.eval_settings(cfg, "x")
    (d / ma.EVAL_RECORD).write_text(json.dumps({"settings": settings, "summary": {}}))
    with open(d / ma.ANSWERS, "w") as f:
        for i, (cat, ok) in enumerate(verdicts.items()):
            f.write(json.dumps({"id": f"{cat.split('#')[0]}_{i}", "category": cat.split("#")[0], "correct": ok}) + "\n")
    return d, cfg, settings


def test_report_has_a_row_per_comparable_sibling(tmp_path):
    _fake_run(tmp_path, "mq_base", "base", {"simple_python#0": False, "simple_python#1": False, "irrelevance": True})
    _fake_run(tmp_path, "mq_lora", "lora", {"simple_python#0": True, "simple_python#1": False, "irrelevance": True},
              subset=("simple_python:5",))  # another subset: not comparable, left out
    d, cfg, settings = _fake_run(tmp_path, "mq", "mor",
                                 {"simple_python#0": True, "simple_python#1": True, "irrelevance": False})
    report = ma.write_agent_report(d, cfg, settings, {"mode": "train"}, {"steps": 3}).read_text()
    table = report.split("| variant |")[1]
    assert "Non-live AST | Live AST | Relevance | Irrelevance | AVG |" in table
    assert "| base | 0.0 |  |  | 100.0 | 50.0 |" in report
    assert "| mor | 100.0 |  |  | 0.0 | 50.0 |" in report
    assert "| lora |" not in report
    assert "- steps: 3" in report and json.loads((d / "report.json").read_text())["rows"]["mor"]["average"] == 50.0


@pytest.mark.slow
def test_tiny_end_to_end_sft_then_bfcl_then_report(tmp_path_factory):
    """SFT a few steps of MoR on a tiny random llama (the embedded tokenizer) -> role-loop answers to
    three BFCL items -> report; then the base row beside it joins the same table."""
    from test_main_job import tiny_model_dir

    model = tiny_model_dir(tmp_path_factory.getbasetemp(), "llama31_8b")
    root = tmp_path_factory.mktemp("moragent")
    rows = {}
    for variant in ("mor", "base"):
        c = _config(variant=variant)
        c.workdir = str(root / ("mq" if variant == "mor" else "mq_base"))
        c.model.path = str(model)
        m = c.moragent
        m.synthetic_examples, m.heldout_examples, m.batch_size, m.micro_batch = 10, 2, 4, 2
        m.eval_subset = ("simple_python:2", "irrelevance:1")
        m.reasoner_max_new_tokens = m.executor_max_new_tokens = m.summarizer_max_new_tokens = 8
        m.direct_max_new_tokens, m.max_turns = 8, 2
        validate_config(c)
        wd = Path(c.workdir)
        wd.mkdir(parents=True)
        assert ma.run_moragent(c, wd, t_start=time.time()) == 0
        rows[variant] = json.loads((wd / "report.json").read_text())
        answers = ma.read_answers(wd / ma.ANSWERS)
        assert len(answers) == 3
        if variant == "mor":
            assert all(r["turns"][0][0] == "reasoner" for r in answers.values())
            train = rows["mor"]["train"]
            recs = [json.loads(line) for line in (wd / "metrics.jsonl").read_text().splitlines()]
            # one optimizer step per (length bucket, rows_per_step) batch of the 8 training examples
            assert train["steps"] == sum(r["kind"] == "sft_train" for r in recs) >= 2
            assert train["held-out CE after"] is not None and any(r["kind"] == "sft_eval" for r in recs)
    assert set(rows["base"]["rows"]) == {"base", "mor"}  # the later run's report holds both rows
