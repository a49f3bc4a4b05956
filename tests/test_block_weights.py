"""A GGUF's block-quantised weights read by the decode step (kernels.block_matmul, models.gguf_blocks,
sampler.block_weights); the kernel itself at every SIMD width is tested in test_kernels.py with
these helpers.

References come from the formats' definitions, written here (llama.cpp's ggml-quants: Q4_1
``w = d * q + m`` with q the low nibbles of a block's 16 bytes then the high ones, Q8_0
``w = d * q``, d and m float16 at the block's start), and from ``gguf.quants.dequantize``, the
loader's own dequantisation, for the file's tensors.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from morse_jax.kernels import block_matmul as bm
from morse_jax.kernels import unavailable_reason

BYTES = {"Q4_1": 20, "Q8_0": 34}


def random_blocks(kind: str, n: int, k: int, seed: int) -> np.ndarray:
    """uint8 [n, k/32 * bytes]: random values, float16 scales (and mins) of a realistic size."""
    rng = np.random.default_rng(seed)
    size = BYTES[kind]
    raw = rng.integers(0, 256, (n, k // 32 * size), dtype=np.uint8)
    blocks = raw.reshape(n, -1, size)
    blocks[..., 0:2] = (0.02 * rng.standard_normal((n, k // 32, 1))).astype(np.float16).view(np.uint8)
    if kind == "Q4_1":
        blocks[..., 2:4] = (0.1 * rng.standard_normal((n, k // 32, 1))).astype(np.float16).view(np.uint8)
    return raw


def dequantize_by_definition(raw: np.ndarray, kind: str) -> np.ndarray:
    """float64 [n, k] from the block layout, element by element."""
    size = BYTES[kind]
    n = raw.shape[0]
    blocks = raw.reshape(n, -1, size)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float64)  # [n, nb]
    if kind == "Q4_1":
        m = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float64)
        qs = blocks[..., 4:]  # [n, nb, 16]
        q = np.concatenate([qs & 15, qs >> 4], axis=-1).astype(np.float64)  # element i < 16: low nibble of byte i
        w = d[..., None] * q + m[..., None]
    else:
        q = blocks[..., 2:].copy().view(np.int8).astype(np.float64)
        w = d[..., None] * q
    return w.reshape(n, -1)


def test_from_gguf_blocks_agrees_with_ggufs_dequantisation():
    from gguf import GGMLQuantizationType, quants

    for kind in BYTES:
        raw = random_blocks(kind, 5, 64, seed=3)
        w = bm.from_gguf_blocks(raw, kind)
        ref = quants.dequantize(raw, getattr(GGMLQuantizationType, kind)).reshape(5, 64)
        np.testing.assert_array_equal(dequantize_by_definition(raw, kind).astype(np.float32), ref)
        assert bm.shape(w) == (5, 64)


def test_bad_operands_are_rejected():
    w = bm.from_gguf_blocks(random_blocks("Q4_1", 4, 64, 0), "Q4_1")
    with pytest.raises(ValueError, match="Q2_K"):
        bm.from_gguf_blocks(np.zeros((4, 40), np.uint8), "Q2_K")
    with pytest.raises(ValueError, match="expects uint8"):
        bm.from_gguf_blocks(np.zeros((4, 41), np.uint8), "Q4_1")
    with pytest.raises(ValueError, match=r"x \[64, B\] with 1 <= B <= 4"):
        bm.block_matmul_cols(w, jnp.zeros((64, 5), jnp.float32))
    with pytest.raises(ValueError, match=r"x \[64, B\]"):
        bm.block_matmul_cols(w, jnp.zeros((32, 1), jnp.float32))
    with pytest.raises(ValueError, match="different kinds"):
        bm.concat_rows([w, bm.from_gguf_blocks(random_blocks("Q8_0", 4, 64, 0), "Q8_0")])


def test_loaded_blocks_are_the_loaded_weights(smollm2_backbone):
    """Every projection of two layers and the embedding: the blocks, dequantised by definition, equal
    the float params exactly (so their rows are in our order: q/k's rotary permutation undone)."""
    bb = smollm2_backbone
    assert bb.blocks is not None and bb.blocks["head"] is None  # SmolLM2 ties its head to the embedding
    layers = bb.params["layers"][0]
    for i in (0, bb.config.num_layers - 1):
        lb = bb.blocks["layers"][i]
        assert sorted(lb) == ["down", "gate", "k", "o", "q", "up", "v"]
        for name, w in lb.items():
            got = _dequantize(w)
            want = np.asarray(layers[name]["kernel"][i]).T  # [out, in]
            np.testing.assert_array_equal(got, want, err_msg=f"layer {i} {name}")
    np.testing.assert_array_equal(_dequantize(bb.blocks["embed"]), np.asarray(bb.params["embed"]))


def _dequantize(w) -> np.ndarray:
    """A loaded block matrix back to float32 by the definition (the loader's arithmetic: float32)."""
    if isinstance(w, bm.Q41):
        q = np.asarray(w.nibbles).reshape(w.scale.shape[0], -1, 16)
        q = np.concatenate([q & 15, q >> 4], axis=-1).astype(np.float32)
        return (np.asarray(w.scale)[..., None] * q + np.asarray(w.min)[..., None]).reshape(q.shape[0], -1)
    q = np.asarray(w.q).reshape(w.scale.shape[0], -1, 32).astype(np.float32)
    return (np.asarray(w.scale)[..., None] * q).reshape(q.shape[0], -1)


@pytest.mark.parametrize("rows", [3, pytest.param(1, marks=pytest.mark.slow), pytest.param(8, marks=pytest.mark.slow)])
def test_sampler_with_blocks_decodes_as_with_float_weights(smollm2_backbone, rows):
    """Greedy tokens identical and log-probs equal within float32 summation error, with the blocks
    read (1-3 rows) and at 8 rows, where the step reads the float weights whatever the switch."""
    from morse_jax.mole.experts import ExpertBankSpec, init_expert_bank
    from morse_jax.sampling.sampler import Request, Sampler, SamplerConfig

    if unavailable_reason() is not None:
        pytest.skip(f"the native kernels cannot run here: {unavailable_reason()}")
    bb = smollm2_backbone
    spec = ExpertBankSpec()
    bank = init_expert_bank(jax.random.PRNGKey(0), bb.config, spec)
    rng = np.random.default_rng(0)  # non-zero B: the experts' deltas are part of what is compared
    bank["b"] = {t: jnp.asarray(0.02 * rng.normal(size=x.shape).astype(np.float32)) for t, x in bank["b"].items()}
    texts = ["The capital of France is", "def fibonacci(n):", "Once upon a time"]
    reqs = [Request(bb.tokenizer(texts[i % 3])["input_ids"], expert_ids=[i % 4], expert_weights=[1.0],
                    max_new_tokens=24, temperature=0.0) for i in range(rows)]
    out = {}
    for mode in ("auto", "off"):
        s = Sampler(bb, spec, SamplerConfig(block_weights=mode, cpu_kernels="on", batch_buckets=(1, 2, 4, 8),
                                            max_batch=8))
        assert s.block_weights == (mode == "auto")
        out[mode] = s.generate(bank, reqs, key=jax.random.PRNGKey(0))
    for a, b in zip(out["auto"], out["off"]):
        assert a.token_ids == b.token_ids
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-4)
