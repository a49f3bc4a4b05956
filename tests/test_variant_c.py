"""Variant C (MoLE + flat GRPO, every candidate its own route) end to end through the job on a tiny
random Llama with the embedded model's tokenizer (slow: the sampler and the update compile).

The tiny model writes no working code, so the SciCode verifier is replaced by a deterministic
synthetic reward that varies across candidates: the update then has LoRA and router signal.
"""

from __future__ import annotations

import json
import warnings

import pytest

from morse_jax.tasks.base import VerifyResult

pytestmark = pytest.mark.slow


def _synthetic(artifact: str) -> VerifyResult:
    return VerifyResult(True, (len(artifact) % 7) / 6.0)


def test_variant_c_trains_and_evaluates_on_a_tiny_model(tmp_path, tiny_hf_model, monkeypatch):
    from configs.quickstart import get_config
    from morse_jax.main import run
    from morse_jax.models import embedded_model_path
    from morse_jax.models.loading import load_tokenizer
    from morse_jax.tasks.scicode.family import SciCodeFamily

    tok = load_tokenizer(embedded_model_path())
    model_dir, _ = tiny_hf_model("llama", vocab_size=len(tok), num_hidden_layers=3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tok.save_pretrained(model_dir)
    monkeypatch.setattr(SciCodeFamily, "verify", lambda self, task, node, artifact: _synthetic(artifact))
    monkeypatch.setattr(SciCodeFamily, "verify_many",
                        lambda self, task, node, artifacts, max_workers=None: [_synthetic(a) for a in artifacts])

    c = get_config("C")
    assert c.variant == "C"
    c.model.path = str(model_dir)
    c.workdir = str(tmp_path / "run")
    c.data.cache_dir = str(tmp_path / "cache")
    c.data.train_ids, c.data.eval_ids, c.data.tasks_per_step = ("19",), ("19",), 1
    c.mole.n_adapt = 2
    c.rollout.routes, c.rollout.candidates, c.rollout.max_attempts = 2, 2, 1
    c.rollout.max_new_tokens = c.rollout.eval_max_new_tokens = 12
    c.rollout.planner_max_new_tokens = 12
    c.train.steps, c.train.micro_batch = 1, 8
    assert run(c) == 0

    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r["kind"] == "train"]
    assert [r["step"] for r in train] == [1]
    step = train[0]
    assert step["skipped_update"] == 0.0 and step["sequences"] > 0
    # flat GRPO with per-candidate routes: one route example per sampled candidate
    assert step["routes"] >= step["sequences"]
    assert step["grad_norm_lora"] > 0 and step["grad_norm_router"] > 0
    assert any(r["kind"] == "eval" for r in records)
    report = json.loads((tmp_path / "run" / "report.json").read_text())
    assert report["evals"][0]["variant"] == "C"
