"""GGUF metadata is read without torch (torch is a test extra only) and gives the same config and
tokenizer as transformers' own ``gguf_file=`` path (which imports torch)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from morse_jax.models import gguf_meta
from morse_jax.models.hf_config import from_hf_config

pytestmark = pytest.mark.gguf

TEXTS = ["Hello world!", "  leading spaces and\ttabs\nnew lines", "def f(x):\n    return x ** 2  # ünïcödé",
         "<|im_start|>user\nhi<|im_end|>", "1234567 + 89 = ?"]
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Write a haiku."}]


def test_config_matches_transformers_gguf_path(smollm2_path):
    from transformers import AutoConfig

    theirs = AutoConfig.from_pretrained(str(smollm2_path.parent), gguf_file=smollm2_path.name, local_files_only=True)
    assert from_hf_config(gguf_meta.hf_config(smollm2_path)) == from_hf_config(theirs)


def test_tokenizer_matches_transformers_gguf_path(smollm2_path):
    from transformers import AutoTokenizer

    theirs = AutoTokenizer.from_pretrained(str(smollm2_path.parent), gguf_file=smollm2_path.name, local_files_only=True)
    ours = gguf_meta.tokenizer(smollm2_path)
    assert len(ours) == len(theirs)
    for t in TEXTS:
        assert ours(t)["input_ids"] == theirs(t)["input_ids"], t
        assert ours.decode(ours(t)["input_ids"]) == theirs.decode(theirs(t)["input_ids"])
    assert (ours.bos_token, ours.eos_token, ours.pad_token) == (theirs.bos_token, theirs.eos_token, theirs.pad_token)
    assert ours.chat_template == theirs.chat_template
    assert (ours.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
            == theirs.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False))


def test_embedded_model_loads_with_torch_unimportable():
    # Regression: a fresh `make quickstart` venv has no torch, and transformers' GGUF metadata
    # reader imports it; loading the embedded model must not need it.
    code = textwrap.dedent("""
        import sys
        sys.modules["torch"] = None  # any `import torch` now raises ImportError
        from morse_jax.models import load_backbone
        from morse_jax.models.loading import embedded_model_path
        bb = load_backbone(embedded_model_path())
        assert bb.tokenizer is not None and bb.tokenizer.chat_template
        print("layers", bb.config.num_layers)
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "layers 30" in r.stdout
