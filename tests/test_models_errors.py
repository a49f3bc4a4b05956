"""Weight loading fails loudly: every broken checkpoint raises an error naming the file and, where
one is at fault, the tensor. Nothing loads partially."""

from __future__ import annotations

import json
import re
import warnings
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from morse_jax.models import WeightLoadError, load_backbone

UP = "model.layers.1.mlp.up_proj.weight"


@pytest.fixture
def hf_dir(tiny_hf_model):
    path, _ = tiny_hf_model("llama", num_key_value_heads=1, tie_word_embeddings=False)
    return path


def load(path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return load_backbone(path, tokenizer=False)


def rewrite(path: Path, edit) -> Path:
    """Apply ``edit(state_dict)`` to model.safetensors in place."""
    f = path / "model.safetensors"
    state = load_file(str(f))
    edit(state)
    save_file(state, str(f), metadata={"format": "pt"})
    return f


def raises(exc, *fragments):
    """pytest.raises whose message must contain every fragment (literally)."""
    return pytest.raises(exc, match="(?s)" + "".join(f"(?=.*{re.escape(str(x))})" for x in fragments))


def test_control_the_fixture_loads(hf_dir):
    assert load(hf_dir).config.num_layers == 3


def test_missing_path(tmp_path):
    with raises(FileNotFoundError, tmp_path / "nope"):
        load_backbone(tmp_path / "nope")


def test_not_a_model(tmp_path):
    (tmp_path / "weights.bin").write_bytes(b"\0" * 16)
    with raises(WeightLoadError, tmp_path / "weights.bin", ".gguf"):
        load(tmp_path / "weights.bin")
    with raises(WeightLoadError, tmp_path, "config.json"):
        load(tmp_path)


def test_no_safetensors(hf_dir):
    (hf_dir / "model.safetensors").unlink()
    with raises(WeightLoadError, hf_dir, "no *.safetensors"):
        load(hf_dir)


def test_missing_tensor(hf_dir):
    f = rewrite(hf_dir, lambda s: s.pop(UP))
    with raises(WeightLoadError, UP, f.name, "missing"):
        load(hf_dir)


def test_missing_lm_head_of_untied_model(hf_dir):
    f = rewrite(hf_dir, lambda s: s.pop("lm_head.weight"))
    with raises(WeightLoadError, "lm_head.weight", f.name):
        load(hf_dir)


def test_shape_mismatch(hf_dir):
    def edit(s):
        s[UP] = np.ascontiguousarray(s[UP][:, :-1])

    f = rewrite(hf_dir, edit)
    with raises(WeightLoadError, f, UP, "shape (31, 48)", "expected (32, 48)"):
        load(hf_dir)


def test_integer_tensor_is_not_cast(hf_dir):
    def edit(s):
        s[UP] = s[UP].astype(np.int8)

    f = rewrite(hf_dir, edit)
    with raises(WeightLoadError, f, UP, "int8"):
        load(hf_dir)


@pytest.mark.parametrize("model_type", ["gpt2", "bert"])
def test_unknown_architecture(tmp_path, model_type):
    from transformers import AutoConfig

    AutoConfig.for_model(model_type).save_pretrained(tmp_path)
    save_file({"x": np.zeros(2, np.float32)}, str(tmp_path / "model.safetensors"))
    with raises(WeightLoadError, tmp_path / "config.json", repr(model_type), "not supported"):
        load(tmp_path)


def test_unparseable_config(hf_dir):
    (hf_dir / "config.json").write_text("{ not json")
    with raises(WeightLoadError, hf_dir / "config.json"):
        load(hf_dir)


@pytest.mark.parametrize("damage", ["garbage", "truncated", "bad-header"])
def test_corrupt_safetensors(hf_dir, damage):
    f = hf_dir / "model.safetensors"
    data = f.read_bytes()
    if damage == "garbage":
        f.write_bytes(b"\x07" * 64)
    elif damage == "truncated":
        f.write_bytes(data[: len(data) // 2])
    else:
        header_len = int.from_bytes(data[:8], "little")
        f.write_bytes(data[:8] + b"{" * header_len + data[8 + header_len:])
    with raises(WeightLoadError, f, "safetensors"):
        load(hf_dir)


def test_sharded_checkpoint_with_missing_shard(tiny_hf_model):
    path, _ = tiny_hf_model("llama", save_kwargs={"max_shard_size": "20KB"})
    index = json.loads((path / "model.safetensors.index.json").read_text())
    shard = sorted(set(index["weight_map"].values()))[1]
    (path / shard).unlink()
    with raises(WeightLoadError, "model.safetensors.index.json", shard, "missing"):
        load(path)


def test_sharded_checkpoint_with_tensor_missing_from_every_shard(tiny_hf_model):
    path, _ = tiny_hf_model("llama", save_kwargs={"max_shard_size": "20KB"})
    index = json.loads((path / "model.safetensors.index.json").read_text())
    shard = path / index["weight_map"][UP]
    state = load_file(str(shard))
    del state[UP]
    save_file(state, str(shard), metadata={"format": "pt"})
    with raises(WeightLoadError, UP, "missing"):
        load(path)


def test_unused_tensors_are_reported(hf_dir):
    rewrite(hf_dir, lambda s: s.__setitem__("model.layers.0.self_attn.extra.weight", np.zeros(3, np.float32)))
    with pytest.warns(UserWarning, match="model.layers.0.self_attn.extra.weight"):
        load_backbone(hf_dir, tokenizer=False)


# --------------------------------------------------------------------------- GGUF


def test_gguf_control_loads(tiny_gguf):
    path, _ = tiny_gguf()
    assert load(path).config.num_layers == 3


@pytest.mark.parametrize("damage", ["garbage", "bad-magic", "truncated"])
def test_corrupt_gguf(tiny_gguf, damage):
    path, _ = tiny_gguf()
    data = path.read_bytes()
    if damage == "garbage":
        path.write_bytes(b"GGUF\x03\x00\x00\x00" + b"\xff" * 40)
    elif damage == "bad-magic":
        path.write_bytes(b"GGML" + data[4:])
    else:
        path.write_bytes(data[: len(data) // 2])
    with raises(WeightLoadError, path):
        load(path)


def test_gguf_missing_tensor(tiny_gguf):
    path, _ = tiny_gguf(gguf_kwargs={"drop": ("blk.2.ffn_up.weight",)})
    with raises(WeightLoadError, path, "blk.2.ffn_up.weight", "missing"):
        load(path)


def test_gguf_shape_mismatch(tiny_gguf):
    path, _ = tiny_gguf(gguf_kwargs={"reshape": {"blk.1.ffn_down.weight": (32, 40)}})
    with raises(WeightLoadError, path, "blk.1.ffn_down.weight", "shape"):
        load(path)


def test_gguf_unsupported_architecture(tiny_gguf):
    path, _ = tiny_gguf(gguf_kwargs={"arch": "gpt2"})
    with raises(WeightLoadError, path, "'gpt2'", "not supported"):
        load(path)
