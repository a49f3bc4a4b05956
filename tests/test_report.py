"""report.md / report.json / plots from eval and train records; metrics log drop-after on resume."""

from __future__ import annotations

import json

from morse_jax.analysis.utilisation import utilisation
from morse_jax.run.metrics_log import MetricsWriter
from morse_jax.run.report import write_report

RECORDS = [{"route": [1, 3], "probs": [.2, .3, .1, .4]}, {"route": [0, 3], "probs": [.3, .2, .1, .4]},
           {"route": [1, 3], "probs": [.2, .3, .1, .4]}, {"route": [], "probs": []}]
TRAIN = [{"step": s, "reward_mean": 0.1 * s, "reward_std": 0.2, "skipped_within": 0.5, "sequences": 4}
         for s in (1, 2, 3)]


def _eval(variant, **scores):
    return {"variant": variant, **scores, "utilisation": utilisation(RECORDS),
            "router_probs": [{"task": "t", "node": "n1", "probs": [.2, .3, .1, .4]}], "expert_sets": {"S1+S3": 2}}


def test_scicode_report_tables_json_and_plots(tmp_path):
    evals = [_eval("D", step_pass=0.25, mean_step_pass=0.5, problem_pass=0.0),
             _eval("B", step_pass=0.125, mean_step_pass=0.25, problem_pass=0.0)]
    md_path = write_report(tmp_path, family="scicode", evals=evals, train=TRAIN, run_info={"variant": "D"})
    md = md_path.read_text()
    assert "| D: MoLE + HGRPO (MoRSE) | 25.00 | 50.00 | 0.00 |" in md
    assert "| B: single LoRA (r=24) + GRPO | 12.50 | 25.00 | 0.00 |" in md
    assert "| 3 | 100.0% | 0.400 |" in md  # Table 5: expert 3 is in every routed set
    assert "3 routed subtasks (1 records without a router decision)" in md
    assert "| 3 | 0.300 | 0.200 | 0.50 | 4 |" in md
    data = json.loads((tmp_path / "report.json").read_text())
    assert data["family"] == "scicode" and len(data["evals"]) == 2 and len(data["train"]) == 3
    for png in ("reward.png", "router_probs.png", "expert_pairs.png"):
        assert (tmp_path / png).stat().st_size > 1000 and png in data["plots"]


def test_srdd_report_columns(tmp_path):
    md = write_report(tmp_path, family="srdd", evals=[{"variant": "A", "exec": 0.5, "eci_mean": 0.7,
                                                       "eci_product": 0.3}]).read_text()
    assert "| Variant | Exec (%) | ECI mean | ECI product |" in md
    assert "| A: MoRSE untrained | 50.00 | 0.700 | 0.300 |" in md


def test_metrics_drop_after_keeps_other_kinds(tmp_path):
    w = MetricsWriter(tmp_path, tensorboard=False)
    for s in (1, 2, 3):
        w.write({"x": s}, step=s, kind="train")
    w.write({"score": 1.0}, step=3, kind="eval")
    w.drop_after(1, "train")
    assert [r["step"] for r in w.read("train")] == [1] and len(w.read("eval")) == 1


def test_report_gathers_other_variants_run_on_the_same_eval_set(tmp_path):
    from morse_jax.config.defaults import get_config
    from morse_jax.run.report import comparable, sibling_evals

    cfg = get_config()
    for name, variant, model in (("quickstart_B", "B", "embedded"), ("quickstart_A", "A", "embedded"),
                                 ("other_model", "C", "/ckpt/x")):
        (tmp_path / name).mkdir()
        c = get_config()
        c.variant, c.model.path = variant, model
        (tmp_path / name / "eval.json").write_text(json.dumps({"comparable": comparable(c),
                                                               "metrics": {"variant": variant}}))
    (tmp_path / "quickstart").mkdir()
    got = sibling_evals(tmp_path / "quickstart", cfg)
    assert sorted(m["variant"] for m in got) == ["A", "B"]  # the other model's run is not comparable
