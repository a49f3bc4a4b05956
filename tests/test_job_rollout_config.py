"""Job.orchestrator's settings come from cfg.rollout: every eval decoding knob, attempts, merges, DAGs."""

from __future__ import annotations

import pytest

from morse_jax.config.validate import ConfigError, validate_config
from morse_jax.config.defaults import get_config
from morse_jax.config.derived import orchestrator_config
from morse_jax.tomas.config import SamplingSettings


def _cfg(**rollout):
    c = get_config()
    c.model.path = "embedded"
    for k, v in rollout.items():
        c.rollout[k] = v
    return c


def test_eval_decoding_and_attempts_come_from_the_config():
    """App. I: temperature 0.2, top-p 0.95, 8192 new tokens, no revision -- each knob reaches the orchestrator."""
    c = _cfg(eval_temperature=0.2, eval_top_p=0.95, eval_max_new_tokens=8192, eval_max_attempts=1,
             max_attempts=3, temperature=0.7, top_p=0.9, max_new_tokens=512)
    ev = orchestrator_config(c, "eval", stop_token_ids=(2,))
    assert ev.eval_sampling == SamplingSettings(0.2, 0.95, 8192)
    assert ev.attempts == 1 and ev.eval_max_attempts == 1 and ev.stop_token_ids == (2,)
    tr = orchestrator_config(c, "train")
    assert tr.train_sampling == SamplingSettings(0.7, 0.9, 512) and tr.attempts == 3


@pytest.mark.parametrize("dag, want", [("chain", "keep"), ("planner", "planner")])
def test_merge_candidates_dag_and_healing_are_wired(dag, want):
    c = _cfg(merge_candidates="candidates", scicode_dag=dag, heal_answer_prefix=False)
    o = orchestrator_config(c, "train")
    assert o.merge_candidates == "candidates" and o.fixed_plan_dependencies == want and not o.heal_answer_prefix
    assert orchestrator_config(get_config(), "train").merge_candidates == "routes_x_candidates"  # Alg. 1


@pytest.mark.parametrize("field, value", [("eval_top_p", 0.0), ("eval_top_p", 1.5), ("eval_max_attempts", 0),
                                          ("eval_temperature", -0.1), ("merge_candidates", "all"),
                                          ("scicode_dag", "tree")])
def test_bad_rollout_fields_are_one_line_errors(field, value):
    with pytest.raises(ConfigError, match=f"config.rollout.{field}:"):
        validate_config(_cfg(**{field: value}), check_paths=False)
