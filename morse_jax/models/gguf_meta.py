"""GGUF metadata -> transformers config and tokenizer, without torch.

transformers' own GGUF path (``AutoConfig`` / ``AutoTokenizer`` with ``gguf_file=``) imports
torch for its metadata reader, and torch is not a dependency of morse_jax (it is a test extra
only). The metadata is plain key/value data, so it is read here with the ``gguf`` package, and
only the pure-Python pieces of transformers are reused: its key renaming table for the config
and its vocabulary -> ``tokenizers`` converter for the tokenizer.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

from morse_jax.models.hf_import import import_transformers

# llama.cpp's token-id keys -> the special-token names a tokenizer takes.
_SPECIAL_TOKENS = {"bos_token": "bos_token_id", "eos_token": "eos_token_id", "unk_token": "unknown_token_id",
                   "pad_token": "padding_token_id"}


@functools.lru_cache(maxsize=4)
def _metadata(path: str, mtime_ns: int) -> tuple[dict[str, Any], frozenset[str]]:
    import gguf

    reader = gguf.GGUFReader(path)
    return {name: field.contents() for name, field in reader.fields.items()}, frozenset(t.name for t in reader.tensors)


def read_metadata(path: str | Path) -> dict[str, Any]:
    """Every key/value field of a GGUF file (tensor data is not read). Cached per file version."""
    p = Path(path)
    return _metadata(str(p), p.stat().st_mtime_ns)[0]


def tensor_names(path: str | Path) -> frozenset[str]:
    p = Path(path)
    return _metadata(str(p), p.stat().st_mtime_ns)[1]


def hf_config(path: str | Path):
    """The transformers config a GGUF file describes (architectures with a renaming table)."""
    import_transformers()  # first import without the no-PyTorch banner
    from transformers import AutoConfig
    from transformers.integrations.ggml import GGUF_CONFIG_MAPPING

    meta = read_metadata(path)
    arch = meta.get("general.architecture")
    if arch not in GGUF_CONFIG_MAPPING:
        raise ValueError(f"{path}: no config mapping for GGUF architecture {arch!r}")
    renames = GGUF_CONFIG_MAPPING[arch]
    cfg = {hf: meta[f"{arch}.{key}"] for key, hf in renames.items() if f"{arch}.{key}" in meta}
    if "vocab_size" not in cfg and "tokenizer.ggml.tokens" in meta:
        cfg["vocab_size"] = len(meta["tokenizer.ggml.tokens"])
    for name, key in _SPECIAL_TOKENS.items():
        if f"tokenizer.ggml.{key}" in meta and name != "unk_token":
            cfg[f"{name}_id"] = int(meta[f"tokenizer.ggml.{key}"])
    cfg["tie_word_embeddings"] = "output.weight" not in tensor_names(path)  # llama.cpp drops a tied head
    return AutoConfig.for_model(arch, **cfg)


def tokenizer(path: str | Path):
    """A fast tokenizer with the file's vocabulary, merges, special tokens and chat template."""
    import_transformers()  # first import without the no-PyTorch banner
    from transformers import PreTrainedTokenizerFast
    from transformers.integrations.gguf.gguf_tokenizer_mapping import GGUF_TOKENIZER_MAPPING, convert_gguf_tokenizer

    meta = read_metadata(path)
    grouped = {group: {name: meta[f"tokenizer.{key}"] for key, name in renames.items() if f"tokenizer.{key}" in meta}
               for group, renames in GGUF_TOKENIZER_MAPPING.items()}
    tok_dict, tok_config = grouped["tokenizer"], grouped["tokenizer_config"]
    if tok_dict.get("tokenizer_type") == "llama":
        tok_config.setdefault("add_bos_token", True)  # llama.cpp adds BOS to sentencepiece vocabularies
    for name, key in _SPECIAL_TOKENS.items():
        token_id = meta.get(f"tokenizer.ggml.{key}")
        tok_config[name] = tok_dict["tokens"][int(token_id)] if token_id is not None else None
    backend, extra = convert_gguf_tokenizer(meta["general.architecture"], tok_dict)
    return PreTrainedTokenizerFast(tokenizer_object=backend, **tok_config, **extra)
