"""bench/gpu.py: the GPU figures script (issue 21) runs its real code paths at tiny sizes on CPU.

The smoke test runs the script as the device would (parent + one process per phase) and checks
that the JSON holds every measured field with sane values; the FLOP count is checked against a
count written out from its definition, and the transformers peer against our parameter count.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _bench():
    spec = importlib.util.spec_from_file_location("bench_gpu", ROOT / "bench" / "gpu.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _positive(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


def _run_tiny(tmp_path, *extra) -> tuple[dict, str]:
    """bench/gpu.py --tiny as a subprocess, as the device runs it (parent + one process per phase).
    XLA's optimisations are off: they change no code path and take most of the compile time."""
    out = tmp_path / "gpu.json"
    env = dict(os.environ, JAX_DISABLE_MOST_OPTIMIZATIONS="1")
    proc = subprocess.run([sys.executable, "bench/gpu.py", "--tiny", "--models", "qwen3-4b", "--out", str(out),
                           "--budget", "900", *extra], cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text())["models"]["Qwen3-4B"], proc.stdout


def _check_ours(phases: dict, stdout: str) -> None:
    for name, res in phases.items():
        assert res["status"] == "ok", (name, res)
        assert not res.get("skipped") and not res.get("errors"), (name, res)

    sample = phases["sample"]
    assert sample["backend"] == "cpu" and _positive(sample["params"])
    row = sample["rows"]["2"]  # the tiny batch
    for side in ("adapters", "base"):
        for key in ("decode_tok_s", "e2e_tok_s", "prefill_s", "decode_s", "decode_ms_step", "first_call_s", "hbm_tb_s"):
            assert _positive(row[side][key]), (side, key, row[side])
        # decode-only excludes prefill: never slower than end to end
        assert row[side]["decode_tok_s"] >= row[side]["e2e_tok_s"]
    assert row["adapters_vs_base"] == pytest.approx(row["adapters"]["decode_tok_s"] / row["base"]["decode_tok_s"])
    mem = row["memory"]
    assert _positive(mem["plan_bytes"])
    assert mem["peak_bytes"] is None and mem["ratio"] is None  # CPU: no device memory stats

    up = phases["update"]["update"]
    assert up["micro_batch"] == 2 and up["seq"] == 64 and up["sequences"] == 4
    for key in ("update_s", "first_update_s", "tokens_s", "generated_tokens_s", "tflop_s", "token_nll"):
        assert _positive(up[key]), (key, up)
    assert up["tokens_s"] == pytest.approx(up["sequences"] * up["seq"] / up["update_s"])
    assert 0 < up["mfu"] < 1
    assert up["flops"]["total"] == pytest.approx(sum(v for k, v in up["flops"].items() if k != "total"))
    assert _positive(up["memory"]["plan_bytes"]) and up["memory"]["peak_bytes"] is None
    assert "update: 4 x 64 tokens, micro-batch 2" in stdout


def test_tiny_run_reports_every_measured_field(tmp_path):
    phases, stdout = _run_tiny(tmp_path, "--no-hf")
    assert set(phases) == {"sample", "update"}
    _check_ours(phases, stdout)


@pytest.mark.slow
def test_tiny_run_with_the_transformers_peer(tmp_path):
    pytest.importorskip("transformers")
    pytest.importorskip("torch")
    phases, stdout = _run_tiny(tmp_path)
    assert set(phases) == {"sample", "update", "hf"}
    _check_ours(phases, stdout)
    h = phases["hf"]["rows"]["2"]["hf"]
    for key in ("decode_tok_s", "e2e_tok_s", "first_call_s", "prefill_s"):
        assert _positive(h[key]), (key, h)


def test_update_flops_counted_from_the_definition():
    g = _bench()
    from morse_jax.models.config import ModelConfig
    from morse_jax.mole.experts import ExpertBankSpec

    d, f, H, K, D, V = 8, 16, 2, 1, 4, 10
    cfg = ModelConfig(family="llama", vocab_size=V, hidden_size=d, intermediate_size=f, num_layers=3, num_heads=H,
                      num_kv_heads=K, head_dim=D)
    spec = ExpertBankSpec(n_adapt=2, rank=2)  # q, v, o
    rows, seq, comp, active = 2, 3, 2, 3
    got = g.gpu_phases.update_flops(cfg, spec, rows=rows, seq=seq, completion=comp, n_active=active)
    tokens, layers = rows * seq, 2
    # projections [d_in, d_out]: q 8x8, k 8x4, v 8x4, o 8x8, gate / up 8x16, down 16x8
    macs = 64 + 32 + 32 + 64 + 128 + 128 + 128
    assert got["frozen_linear"] == (2 + 2) * macs * layers * tokens  # forward + input gradient
    lora_macs = 2 * (8 + 8) + 2 * (8 + 4) + 2 * (8 + 8)  # rank x (d_in + d_out) for q, v, o
    assert got["lora"] == (2 + 4) * lora_macs * active * layers * tokens
    pairs = sum(t + 1 for t in range(seq))  # causal (query, key) pairs of one row
    attn_forward = 2 * (D + D) * H * pairs  # q.k and p.v: D multiply-adds each, per head
    assert got["attention"] == 3 * attn_forward * layers * rows
    assert got["lm_head"] == (2 + 2) * d * V * rows * comp
    assert got["total"] == sum(v for k, v in got.items() if k != "total")


@pytest.mark.parametrize("name", ["qwen3-4b", "llama-3.1-8b"])
def test_transformers_peer_has_our_shapes(name):
    pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    from transformers import AutoModelForCausalLM

    from morse_jax.models.params import num_params

    g = _bench()
    cfg = g.model_config(name, tiny=True)
    model = AutoModelForCausalLM.from_config(g.gpu_phases.hf_model_config(cfg))
    n = sum(p.numel() for p in model.parameters())  # tied embeddings are one parameter
    assert n == num_params(cfg)
    assert isinstance(model.model.layers[0].self_attn.q_proj, torch.nn.Linear)
    assert model.model.layers[0].self_attn.q_proj.out_features == cfg.num_heads * cfg.head_dim
