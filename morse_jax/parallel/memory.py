"""Per-device memory estimate of a run: weights, experts, optimizer, KV caches, activations.

What is counted (bytes per device, from the shapes and the sharding rules of ``sharding.py``):

* backbone: every weight, sharded by the rules (``embed`` over fsdp; heads, MLP width and
  vocabulary over tensor; replicated over data).
* sampler copy: the sampler's fused decode weights (``sampling.decode.decode_params``) are a
  second copy of every layer weight (and of the LM head when it is not tied), kept for the whole
  run. The trainer's split layers are a third copy unless the backbone is split once up front
  (``models.split_segments(params, n_adapt)`` before building sampler and trainer).
* experts, router (replicated), gradients (the accumulated sum plus one micro-batch's) and
  optimizer states (AdamW: two per parameter), all in the trainable dtype.
* KV cache per bucket: ``2 * layers * batch * cache_len * kv_heads * head_dim``, rows split over
  (data, fsdp) and kv heads over tensor.
* update activations (one micro-batch of ``batch`` rows of ``seq_len`` tokens): float32 logits,
  their log-softmax and its cotangent ``[rows, T, V]``, plus what the backward pass through the
  ``n_adapt`` adapted layers keeps, by ``train.remat`` (attention is materialised, not flash;
  ``E = rows * heads * T * T`` elements per layer):

  - "none": every adapted layer's residuals (hidden states, q/k/v, MLP activations; and of its
    attention the float32 scores and probabilities plus the probabilities in the compute dtype,
    ``(8 + b) E`` bytes), and one layer's backward transient (float32 cotangents of scores and
    probabilities, ``8 E``).
  - "layer": each adapted layer's input and its projections' outputs (``REMAT_POLICY`` saves
    matmul outputs without batch dimensions), and one layer's recomputed forward (all of the
    above for one layer) with its backward transient.

  Checked against XLA's ``memory_analysis`` on CPU (tests/test_remat.py: "none" +12 %, "layer"
  +30 % at 2 x 512 tokens, 4 heads, 4 adapted layers). On an H200 XLA could not bring the "none"
  update of Qwen3-4B / Llama-3.1-8B at 4 x 3072 tokens below 171 / 179 GiB, about 175 / 176 GB
  beside the frozen weights; this plan says 159 / 161 GB of update activations.
* sampling activations: one prefill chunk's attention scores ``[prefill_rows, heads, S]``.

Phases run one after the other, so the peak is the larger of the update phase and the sampling
phase, each on top of the weights. An estimate: XLA's buffer reuse and fusion move real numbers
by tens of percent; allocator reserve (``XLA_PYTHON_CLIENT_MEM_FRACTION``) is not included.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Mapping, Sequence

import jax
import numpy as np

from morse_jax.models.config import ModelConfig, RopeSpec
from morse_jax.models.params import num_params, param_shapes
from morse_jax.mole.experts import ExpertBankSpec, target_dims
from morse_jax.parallel.mesh import AXES
from morse_jax.parallel.sharding import logical_spec, param_logical_axes

GB = 1e9
OPTIMIZER_STATES = {"adamw": 2, "adam": 2, "lion": 1, "momentum": 1, "sgd": 0}
REMAT = ("none", "layer")  # = models.transformer.REMAT (parallel sits below models in the layers)


class _ShapeMesh:
    """Just enough of a Mesh for the sharding rules: axis sizes."""

    def __init__(self, shape: Sequence[int]):
        self.shape = dict(zip(AXES, (int(s) for s in shape)))


def _itemsize(dtype) -> int:
    return int(np.dtype(jax.numpy.dtype(dtype)).itemsize)


def _sharded_bytes(tree_shapes, mesh: _ShapeMesh, cfg: ModelConfig, itemsize: int) -> float:
    total = 0.0
    flat = jax.tree_util.tree_flatten_with_path(
        tree_shapes, is_leaf=lambda x: isinstance(x, tuple) and all(isinstance(i, int) for i in x))[0]
    for path, shape in flat:
        spec = logical_spec(mesh, param_logical_axes(path, len(shape)), shape, cfg)  # type: ignore[arg-type]
        shards = 1
        for entry in spec:
            for axis in ((entry,) if isinstance(entry, str) else entry or ()):
                shards *= mesh.shape[axis]
        total += math.prod(shape) * itemsize / shards
    return total


def _split(size: int, n: int) -> float:
    """Per-device share of a dimension split n ways when n divides it, else the whole."""
    return size / n if n > 1 and size % n == 0 else float(size)


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    """Bytes per device by component; ``kv_cache`` maps (batch, cache_len) -> bytes."""

    name: str
    mesh_shape: tuple[int, int, int]
    dtype: str
    components: dict[str, float]
    kv_cache: dict[tuple[int, int], float]
    batch: int
    seq_len: int
    sample_batch: int

    @property
    def weights(self) -> float:
        c = self.components
        return c["backbone"] + c["sampler copy"] + c["experts + router"]

    @property
    def update_peak(self) -> float:
        c = self.components
        return self.weights + c["gradients"] + c["optimizer states"] + c["update activations"]

    @property
    def sample_peak(self) -> float:
        return self.weights + max(self.kv_cache.values(), default=0.0) + self.components["sampling activations"]

    @property
    def peak(self) -> float:
        return max(self.update_peak, self.sample_peak)

    def format(self, device_bytes: float | None = None) -> str:
        """Human-readable breakdown (GB = 1e9 bytes), one component per line."""
        d, f, t = self.mesh_shape
        lines = [f"memory plan: {self.name}, {self.dtype}, mesh data={d} fsdp={f} tensor={t} "
                 f"({d * f * t} devices), per device:"]
        for k, v in self.components.items():
            lines.append(f"  {k:<22s} {v / GB:9.2f} GB")
        for (b, s), v in sorted(self.kv_cache.items()):
            lines.append(f"  {'kv cache ' + f'{b}x{s}':<22s} {v / GB:9.2f} GB")
        lines.append(f"  {'peak (update)':<22s} {self.update_peak / GB:9.2f} GB  "
                     f"(micro-batch {self.batch} x {self.seq_len} tokens)")
        lines.append(f"  {'peak (sampling)':<22s} {self.sample_peak / GB:9.2f} GB  (batch {self.sample_batch})")
        if device_bytes:
            ok = "fits" if self.peak <= device_bytes else "DOES NOT FIT"
            lines.append(f"  {ok} in {device_bytes / GB:.0f} GB per device")
        return "\n".join(lines)


def memory_plan(model_config: ModelConfig, spec: ExpertBankSpec | None, optimizer: str = "adamw", batch: int = 4,
                cache_len: int | Sequence[int] = 4096, mesh_shape: Sequence[int] = (1, 1, 1), dtype="bfloat16", *,
                seq_len: int | None = None, sample_batch: int = 16, trainable_dtype=None, router_dim: int = 128,
                prefill_rows: int = 512, sampler_copy: bool = True, name: str = "", remat: str = "none") -> MemoryPlan:
    """Estimate bytes per device (see the module docstring for what each component holds).

    Args:
      model_config: the backbone. spec: the expert bank (None: no experts, no update phase).
      optimizer: one of OPTIMIZER_STATES. batch: update micro-batch rows (``train.micro_batch``).
      cache_len: sampler cache length(s) (prompt bucket + new-token bucket), one entry per bucket.
      mesh_shape: (data, fsdp, tensor), no -1. dtype: backbone dtype; trainable_dtype defaults to it.
      seq_len: update sequence length (default: the longest cache_len). sample_batch: sampler
        micro-batch (``sampler.max_batch``). sampler_copy: the fused decode path keeps its copy.
      remat: the update's ``train.remat`` ("none" | "layer"): what its backward pass keeps.
    """
    cfg = model_config
    if optimizer not in OPTIMIZER_STATES:
        raise ValueError(f"memory_plan: optimizer must be one of {sorted(OPTIMIZER_STATES)}, got {optimizer!r}")
    mesh_shape = tuple(int(s) for s in mesh_shape)
    if remat not in REMAT:
        raise ValueError(f"memory_plan: remat must be one of {REMAT}, got {remat!r}")
    if len(mesh_shape) != 3 or min(mesh_shape) < 1:
        raise ValueError(f"memory_plan: mesh_shape must be 3 sizes >= 1 (data, fsdp, tensor), got {mesh_shape}")
    lens = [int(cache_len)] if isinstance(cache_len, (int, np.integer)) else [int(c) for c in cache_len]
    if not lens or min(lens) < 1 or batch < 1 or sample_batch < 1:
        raise ValueError("memory_plan: batch, sample_batch and cache_len must be >= 1")
    T = int(seq_len or max(lens))
    mesh = _ShapeMesh(mesh_shape)
    data, fsdp, tp = mesh_shape
    b = _itemsize(dtype)
    tb = _itemsize(trainable_dtype or dtype)
    shapes = param_shapes(cfg)
    d, f, V, L = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size, cfg.num_layers
    H, K, D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    heads_dev = H / tp if tp > 1 and H % tp == 0 else H
    kv_dev = K / tp if tp > 1 and K % tp == 0 else K

    comp: dict[str, float] = {}
    comp["backbone"] = _sharded_bytes(shapes, mesh, cfg, b)
    copy = 0.0
    if sampler_copy:
        copy = _sharded_bytes({"layers": shapes["layers"]}, mesh, cfg, b)
        if "lm_head" in shapes:
            copy += _sharded_bytes({"lm_head": shapes["lm_head"]}, mesh, cfg, b)
    comp["sampler copy"] = copy
    n_train = 0
    if spec is not None:
        for t in spec.targets:
            din, dout = target_dims(cfg, t)
            n_train += spec.num_experts * spec.n_adapt * spec.rank * (din + dout)
        n_router = d * router_dim + router_dim + max(spec.num_subtask, 1) * router_dim
        comp["experts + router"] = n_train * tb + n_router * 4
        n_train_bytes = n_train * tb + n_router * 4
    else:
        comp["experts + router"] = 0.0
        n_train_bytes = 0.0
    comp["gradients"] = 2 * n_train_bytes if spec is not None else 0.0
    comp["optimizer states"] = OPTIMIZER_STATES[optimizer] * n_train_bytes if spec is not None else 0.0

    rows = math.ceil(batch / (data * fsdp))
    vocab_dev = _split(V, tp)
    logits = 3 * rows * T * vocab_dev * 4
    comp["update activations"] = 0.0 if spec is None else logits + _layer_activations(
        rows * T, heads_dev * T, spec.n_adapt, remat, d=d, q=heads_dev * D, kv=kv_dev * D, f=_split(f, tp), b=b)

    kv = {}
    srows = sample_batch / (data * fsdp) if sample_batch % (data * fsdp) == 0 else float(sample_batch)
    # per layer: its own kv heads and head dim (Gemma 4), none for KV-shared layers
    kv_width = sum(_split(cfg.layer_kv_heads(i), tp) * cfg.layer_head_dim(i) for i in range(L)
                   if cfg.kv_sharing_modes[i] != "reuse")
    for S in lens:
        kv[(sample_batch, S)] = 2 * srows * S * kv_width * b
    chunk_rows = prefill_rows / (data * fsdp)
    comp["sampling activations"] = chunk_rows * heads_dev * max(lens) * (4 + 4 + b) + srows * V * 4 * 2
    return MemoryPlan(name or cfg.family, mesh_shape, str(np.dtype(jax.numpy.dtype(dtype))), comp, kv, batch, T,
                      sample_batch)


def _layer_activations(tokens: int, scores_per_token: float, n_adapt: int, remat: str, *, d, q, kv, f, b) -> float:
    """Bytes the backward pass through ``n_adapt`` adapted layers keeps (module docstring), for
    ``tokens`` rows x positions, ``scores_per_token`` = heads x keys attention entries per token,
    widths d (hidden), q (heads x head dim), kv (kv heads x head dim), f (MLP), compute dtype of
    ``b`` bytes."""
    proj_out = (q + 2 * kv + d + 3 * f) * b  # q, k, v, o, gate, up, down: matmul outputs without batch dims
    per_tok = 6 * d * b + proj_out + q * b  # + norms / residual stream, the attention output
    # per attention entry: the float32 softmax output and its masked input, the probabilities in
    # the compute dtype (XLA keeps 9.4 bytes on CPU in float32, ~13-14 on an H200 in bfloat16)
    saved_scores = 12 * scores_per_token
    bwd_scores = 8 * scores_per_token  # float32 cotangents of scores and probabilities, one layer at a time
    one_layer = tokens * (per_tok + saved_scores)
    if remat == "none":
        return n_adapt * one_layer + tokens * bwd_scores
    return n_adapt * tokens * (d * b + proj_out) + one_layer + tokens * bwd_scores


# --------------------------------------------------------------------------- presets and table


def _gemma3_layers(n: int, pattern: int = 6) -> tuple[str, ...]:
    return tuple("full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(n))


PRESETS: dict[str, ModelConfig] = {
    # Architecture numbers from each model's config.json.
    "Qwen3-4B": ModelConfig(family="qwen3", vocab_size=151936, hidden_size=2560, intermediate_size=9728,
                            num_layers=36, num_heads=32, num_kv_heads=8, head_dim=128, tie_embeddings=True,
                            qk_norm=True, rope_full=RopeSpec(theta=1e6), max_position_embeddings=40960),
    "Llama-3.1-8B": ModelConfig(family="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                                num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128,
                                rope_full=RopeSpec(theta=5e5, rope_type="llama3", factor=8.0),
                                max_position_embeddings=131072),
    "Gemma-3-27B": ModelConfig(family="gemma3", vocab_size=262208, hidden_size=5376, intermediate_size=21504,
                               num_layers=62, num_heads=32, num_kv_heads=16, head_dim=128, tie_embeddings=True,
                               activation="gelu_tanh", qk_norm=True, norm_offset=1.0, embed_scale=True,
                               post_norms=True, query_scale=168 ** -0.5, layer_types=_gemma3_layers(62),
                               sliding_window=1024, rope_full=RopeSpec(theta=1e6, rope_type="linear", factor=8.0),
                               rope_sliding=RopeSpec(theta=1e4), max_position_embeddings=131072),
}


def max_micro_batch(model_config: ModelConfig, spec: ExpertBankSpec | None, device_bytes: float, *,
                    limit: int = 256, **plan_kwargs) -> int:
    """Largest update micro-batch (rows) whose plan fits ``device_bytes`` per device (0: none)."""
    best = 0
    for rows in range(1, limit + 1):
        if memory_plan(model_config, spec, batch=rows, **plan_kwargs).peak > device_bytes:
            break
        best = rows
    return best


def memory_table(models: Mapping[str, ModelConfig] | None = None, meshes: Sequence[Sequence[int]] = (
        (1, 1, 1), (4, 1, 1), (1, 4, 1), (1, 1, 4)), spec: ExpertBankSpec | None = None, *,
        device_gb: float = 141.0, **plan_kwargs) -> str:
    """Markdown table of per-device estimates, one row per (model, mesh)."""
    models = PRESETS if models is None else models
    spec = spec or ExpertBankSpec()
    rows = ["| model | params | GPUs | mesh (data, fsdp, tensor) | weights | experts + optimizer | "
            "KV cache | update activations | peak | fits | largest micro-batch |",
            "|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, cfg in models.items():
        for m in meshes:
            p = memory_plan(cfg, spec, mesh_shape=m, name=name, **plan_kwargs)
            search_kwargs = {k: v for k, v in plan_kwargs.items() if k != "batch"}
            search_kwargs["mesh_shape"] = m
            c = p.components
            kb, ks = max(p.kv_cache, key=p.kv_cache.get)
            kv = p.kv_cache[(kb, ks)]
            fits = "yes" if p.peak <= device_gb * GB else "no"
            rows.append(
                f"| {name} | {num_params(cfg) / 1e9:.1f} B | {math.prod(m)} | {tuple(m)} | "
                f"{(c['backbone'] + c['sampler copy']) / GB:.1f} GB | "
                f"{(c['experts + router'] + c['gradients'] + c['optimizer states']) / GB:.2f} GB | "
                f"{kv / GB:.1f} GB ({kb}x{ks}) | {c['update activations'] / GB:.1f} GB | {p.peak / GB:.1f} GB | "
                f"{fits} | {max_micro_batch(cfg, spec, device_gb * GB, **search_kwargs)} |")
    return "\n".join(rows)
