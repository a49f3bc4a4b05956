"""``mode=describe``: every paper config x variant is described without weights, with the split
counts of App. I and trainable-parameter counts from the LoRA definition (Eq. 4, App. E)."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import pytest

from morse_jax.config.variants import VARIANT_OVERLAYS
from morse_jax.run.describe import describe

REPO = Path(__file__).resolve().parents[1]
DATA = REPO.parent / "shared" / "data" / "morse-reference"
# MoRSE paper configs (not the CPU ones, not MoRAgent's)
PAPER = sorted(p for p in (REPO / "configs").glob("*.py") if p.stem not in ("quickstart", "learn_cpu")
               and not p.stem.startswith("moragent_"))
needs_data = pytest.mark.skipif(not DATA.is_dir(), reason="reference data (../shared/data) not present")

# Qwen3-4B-Instruct-2507's config.json, the fields the decoder reads (no weights).
QWEN3_4B = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 2560,
            "intermediate_size": 9728, "num_hidden_layers": 36, "num_attention_heads": 32,
            "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936, "max_position_embeddings": 262144,
            "rms_norm_eps": 1e-6, "rope_theta": 5000000, "tie_word_embeddings": True, "hidden_act": "silu",
            "torch_dtype": "bfloat16"}


def _load(path: Path, *args):
    spec = importlib.util.spec_from_file_location(path.stem, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.get_config(*args)


def _field(text: str, name: str) -> str:
    m = re.search(rf"^{re.escape(name)}: (.*)$", text, re.M)
    assert m, f"no line '{name}: ...' in:\n{text}"
    return m.group(1)


@needs_data
@pytest.mark.parametrize("path", PAPER, ids=lambda p: p.stem)
@pytest.mark.parametrize("variant", sorted(VARIANT_OVERLAYS))
def test_every_paper_config_and_variant_is_described_without_weights(path, variant):
    """No model directory, no test_data.h5: describe still answers, and says what it could not know."""
    text = describe(_load(path, variant))
    assert _field(text, "variant").startswith(variant + ":")
    assert "could not determine" in _field(text, "model")
    assert re.match(r"\d+$", _field(text, "train tasks")) and re.match(r"\d+$", _field(text, "eval tasks"))
    for line in ("B (routes per node)", "ranks", "learning rates", "train decoding", "eval decoding",
                 "regeneration budgets", "steps", "memory plan", "what trains"):
        _field(text, line)


def _scicode(split_train: str, split_eval: str):
    cfg = _load(REPO / "configs" / "qwen3_4b_scicode.py")
    cfg.data.dir = str(DATA)
    cfg.data.train, cfg.data.eval = split_train, split_eval
    return cfg


@needs_data
def test_paper_scicode_configs_count_every_problem():
    """App. I: the official 60 / 20 problem split and the 64 / 16 OOD split, every problem used
    (data.skip_slow_steps left out problem 10 of the test split and 10, 51 of the train split)."""
    text = describe(_scicode("morse_train", "morse_test"))
    assert (_field(text, "train tasks"), _field(text, "eval tasks")) == ("60", "20")
    assert "none left out" in text
    text = describe(_scicode("ood_train", "ood_test"))
    assert (_field(text, "train tasks"), _field(text, "eval tasks")) == ("64", "16")
    # 5 epochs over 60 problems, 4 per step
    assert _field(describe(_scicode("morse_train", "morse_test")), "steps").startswith(f"{5 * 15} ")


@needs_data
def test_skipped_problems_are_named_with_the_reason():
    cfg = _scicode("morse_train", "morse_test")
    cfg.data.skip_slow_steps = True
    text = describe(cfg)
    assert _field(text, "train tasks") == "58" and _field(text, "eval tasks") == "19"
    assert re.search(r"left out 2 \((10, 51|51, 10)\): data\.skip_slow_steps", text)


def _lora_params(rank: int, experts: int, layers: int = 8) -> int:
    """Eq. 4 / App. E: each expert is a rank-rho (A, B) pair on q, v, o of the last L_adapt blocks;
    a pair on a d_in -> d_out projection holds rho * (d_in + d_out) numbers."""
    d, q, kv = QWEN3_4B["hidden_size"], 32 * 128, 8 * 128
    per_layer = rank * ((d + q) + (d + kv) + (q + d))
    return experts * layers * per_layer


@pytest.mark.parametrize("variant,experts,rank,routed", [("D", 6, 8, True), ("B", 1, 24, False),
                                                          ("B++", 1, 48, False), ("single_agent_rl", 1, 24, False)])
def test_trainable_parameters_from_config_json_only(tmp_path, variant, experts, rank, routed):
    """Table 4: rank 24 x 1 = 3.24M, rank 48 x 1 and 8 x (2 + 4) = 6.49M on Qwen3-4B; the router
    (projection d -> 128 with bias, 4 prototypes of 128) trains only where it routes."""
    (tmp_path / "config.json").write_text(json.dumps(QWEN3_4B))
    cfg = _load(REPO / "configs" / "qwen3_4b_srdd.py", variant)
    cfg.model.path = str(tmp_path)
    cfg.data.dir = str(tmp_path / "no_data")  # splits unknown: said, not fatal
    text = describe(cfg)
    router = (2560 * 128 + 128 + 4 * 128) if routed else 0
    want = _lora_params(rank, experts) + router
    assert _field(text, "trainable parameters").startswith(f"{want / 1e6:.2f}M")
    assert "could not determine" in _field(text, "train tasks")
    assert "qwen3, 36 layers" in _field(text, "model")
    assert "peak" in text  # the memory plan from the config alone


def test_lora_count_matches_table_4():
    assert f"{_lora_params(24, 1) / 1e6:.2f}M" == "3.24M" and f"{_lora_params(8, 6) / 1e6:.2f}M" == "6.49M"
