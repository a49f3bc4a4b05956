"""Shared fixtures for the backbone tests.

* ``tiny_hf_model``: builds a small random transformers model (Llama / Qwen3 / Gemma 3), saves it
  as safetensors without tokenizer files, returns (dir, torch model).
* ``ref_cache``: an on-disk cache of reference outputs (``~/.cache/morse_jax/test_refs``, or
  ``$MORSE_JAX_TEST_REFS``) keyed by a hash of everything the output depends on. transformers'
  GGUF load of SmolLM2 takes 20-30 s; with the cache it happens once per machine.
* ``smollm2_path`` / ``smollm2_backbone`` / ``smollm2_torch``: the embedded GGUF model, loaded
  once per session (``smollm2_torch`` only when a reference is not cached yet).
"""

from __future__ import annotations

import hashlib
import json
import os
import warnings
from pathlib import Path
from typing import Any, Callable

import jax
import numpy as np
import pytest

TINY_BASE = dict(
    vocab_size=97,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    # Larger than the 0.02 default so attention is peaked and a wrong mask or rotation shows.
    initializer_range=0.15,
)


def _hf_config(family: str, **overrides):
    from transformers import Gemma3TextConfig, LlamaConfig, Qwen3Config

    kwargs = {**TINY_BASE, **overrides}
    cls = {"llama": LlamaConfig, "qwen3": Qwen3Config, "gemma3": Gemma3TextConfig}[family]
    return cls(**kwargs)


def build_tiny_torch_model(family: str, seed: int = 0, **overrides):
    """A random transformers causal LM (float32, eval mode).

    Norm weights and biases get noise: their default init (ones / zeros) would hide a norm applied
    with the wrong offset or a bias that is dropped.
    """
    import torch
    from transformers import AutoModelForCausalLM

    cfg = _hf_config(family, **overrides)
    torch.manual_seed(seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    return perturb_(model, seed)


def torch_logits(model, tokens, valid):
    """transformers logits float32[B, T, V] of a left-padded batch (positions count real tokens)."""
    import torch

    positions = np.maximum(np.cumsum(valid, axis=1) - 1, 0)
    with torch.no_grad():
        out = model(input_ids=torch.tensor(tokens), attention_mask=torch.tensor(valid.astype(np.int64)),
                    position_ids=torch.tensor(positions))
    return out.logits.float().numpy()


def assert_same_update(a: tuple, b: tuple) -> None:
    """Two (per-example log-probs, new trainable, metrics) results of ``Trainer.logprobs`` +
    ``Trainer.update`` on the same examples agree (two code paths for the same maths)."""
    (lp_a, new_a, m_a), (lp_b, new_b, m_b) = a, b
    for x, y in zip(lp_a, lp_b):
        np.testing.assert_allclose(x, y, atol=1e-5)
    np.testing.assert_allclose(m_a["token_nll"], m_b["token_nll"], rtol=1e-5)
    for x, y in zip(jax.tree.leaves(new_a), jax.tree.leaves(new_b)):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), atol=1e-6)


def perturb_(model, seed: int):
    """Noise on norms, biases and layer scalars, in place (returns the model): their defaults
    (ones / zeros) would hide a norm with the wrong offset, a dropped bias or a missing scalar."""
    import torch

    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.3 * torch.randn(p.shape, generator=gen))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))
        for name, b in model.named_buffers():
            if name.endswith("layer_scalar"):
                b.copy_(1.0 + 0.3 * torch.randn(b.shape, generator=gen))
    return model


@pytest.fixture
def tiny_hf_model(tmp_path_factory) -> Callable[..., tuple[Path, Any]]:
    """Factory: ``make(family, seed=0, save_kwargs=None, **config_overrides) -> (dir, torch_model)``."""

    def make(family: str, seed: int = 0, save_kwargs: dict | None = None, **overrides):
        model = build_tiny_torch_model(family, seed, **overrides)
        out = tmp_path_factory.mktemp(f"tiny_{family}")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model.save_pretrained(out, **(save_kwargs or {}))
        return out, model

    return make


# --------------------------------------------------------------------------- reference cache


class RefCache:
    """npz files under ``root`` named by a hash of ``key`` (a JSON-serialisable dict)."""

    def __init__(self, root: Path):
        self.root = root

    def get(self, name: str, key: dict, compute: Callable[[], dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
        digest = hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:24]
        path = self.root / f"{name}-{digest}.npz"
        if path.exists():
            try:
                with np.load(path) as f:
                    return {k: f[k] for k in f.files}
            except Exception:  # a half-written or corrupt entry: recompute it
                path.unlink(missing_ok=True)
        value = {k: np.asarray(v) for k, v in compute().items()}
        self.root.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp.npz")
        np.savez(tmp, **value)
        os.replace(tmp, path)
        return value


@pytest.fixture(scope="session")
def ref_cache() -> RefCache:
    root = os.environ.get("MORSE_JAX_TEST_REFS") or Path.home() / ".cache" / "morse_jax" / "test_refs"
    return RefCache(Path(root))


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


# --------------------------------------------------------------------------- embedded SmolLM2


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    from morse_jax.models import embedded_model_path

    return embedded_model_path()


@pytest.fixture(scope="session")
def smollm2_hash(smollm2_path) -> str:
    return file_sha256(smollm2_path)


@pytest.fixture(scope="session")
def smollm2_backbone(smollm2_path):
    from morse_jax.models import load_backbone

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return load_backbone(smollm2_path)


class _LazyTorchModel:
    """transformers' own load of the GGUF, done on first use only (cached references skip it)."""

    def __init__(self, path: Path):
        self.path = path
        self._model = None

    def __call__(self):
        if self._model is None:
            import torch
            from transformers import AutoModelForCausalLM

            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                self._model = AutoModelForCausalLM.from_pretrained(
                    str(self.path.parent), gguf_file=self.path.name, dtype=torch.float32).eval()
        return self._model


@pytest.fixture(scope="session")
def smollm2_torch(smollm2_path) -> _LazyTorchModel:
    return _LazyTorchModel(smollm2_path)


# --------------------------------------------------------------------------- tiny GGUF files


def _llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """The Q/K row permutation llama.cpp's convert_hf_to_gguf.py applies to Llama weights."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_llama_gguf(path: Path, model, *, arch: str = "llama", quant: str = "F32", drop: tuple[str, ...] = (),
                     reshape: dict[str, tuple[int, ...]] | None = None) -> Path:
    """Write a transformers Llama model as a GGUF file the way llama.cpp's converter lays it out.

    ``quant``: "F32" or "Q8_0" for the 2-D weights; ``drop`` omits GGUF tensors by name;
    ``reshape`` stores a tensor (by GGUF name) with another torch-layout shape (a corrupt file).
    """
    import gguf

    c = model.config
    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    per_layer = [("input_layernorm", "attn_norm"), ("self_attn.q_proj", "attn_q"), ("self_attn.k_proj", "attn_k"),
                 ("self_attn.v_proj", "attn_v"), ("self_attn.o_proj", "attn_output"), ("mlp.gate_proj", "ffn_gate"),
                 ("mlp.up_proj", "ffn_up"), ("mlp.down_proj", "ffn_down"), ("post_attention_layernorm", "ffn_norm")]
    for i in range(c.num_hidden_layers):
        for hf, ours in per_layer:
            names[f"model.layers.{i}.{hf}.weight"] = f"blk.{i}.{ours}.weight"
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(c.num_hidden_layers)
    writer.add_context_length(c.max_position_embeddings)
    writer.add_embedding_length(c.hidden_size)
    writer.add_feed_forward_length(c.intermediate_size)
    writer.add_head_count(c.num_attention_heads)
    writer.add_head_count_kv(c.num_key_value_heads)
    writer.add_rope_freq_base(float(c.rope_parameters["rope_theta"]))
    writer.add_layer_norm_rms_eps(float(c.rms_norm_eps))
    writer.add_vocab_size(c.vocab_size)
    state = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    if c.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    for hf_name, w in state.items():
        name = names[hf_name]
        if name in drop:
            continue
        if ".attn_q." in name:
            w = _llama_cpp_permute(w, c.num_attention_heads)
        elif ".attn_k." in name:
            w = _llama_cpp_permute(w, c.num_key_value_heads)
        if reshape and name in reshape:
            w = np.resize(w, reshape[name])
        w = np.ascontiguousarray(w, np.float32)
        if quant == "Q8_0" and w.ndim == 2 and w.shape[-1] % 32 == 0:
            qtype = gguf.GGMLQuantizationType.Q8_0
            writer.add_tensor(name, gguf.quants.quantize(w, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(name, w)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture
def tiny_gguf(tmp_path_factory) -> Callable[..., tuple[Path, Any]]:
    """Factory: ``make(seed=0, gguf_kwargs=None, **llama_overrides) -> (file.gguf, torch_model)``."""

    def make(seed: int = 0, gguf_kwargs: dict | None = None, **overrides):
        model = build_tiny_torch_model("llama", seed, **overrides)
        path = tmp_path_factory.mktemp("tiny_gguf") / "tiny.gguf"
        return write_llama_gguf(path, model, **(gguf_kwargs or {})), model

    return make
