"""What callers hand the sampler and get back: requests, completions, the sampler's settings.

Host side only (no jit): :class:`Request` / :class:`Completion` / :class:`SamplerConfig`, their
validation, the bucket arithmetic that fixes a micro-batch's shapes (:func:`batch_shape`), and
the packing of a micro-batch's requests into the typed device inputs of ``sampling.state``
(:func:`pack_requests`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import numpy as np

from morse_jax.mole.experts import ExpertBankSpec
from morse_jax.mor.batch import NO_ROLE
from morse_jax.sampling.state import DecodeSettings, ExpertSlots, PromptBatch

FINISH_REASONS = ("eos", "stop", "length")
DECODE_PATHS = ("fused", "model")
MAX_STOP_IDS = 8  # stop-token slots per row


@dataclasses.dataclass(frozen=True)
class Request:
    """One generation request.

    expert_ids / expert_weights: the row's active set (bank ids and weights; empty = no adapter).
    temperature 0 = greedy. top_k 0 = no top-k limit. stop_token_ids end the row (the stop token
    is kept in ``token_ids``); stop_strings end it too (the text is cut before the string).
    heal_tokens: token healing (``morse_jax.sampling.healing``): drop the prompt's last
    ``heal_tokens`` tokens and constrain the first generated token to re-write their text (and
    possibly extend it). 0 = off. Skipped (silently) when the dropped text cannot be read or no
    token re-writes it.
    role / prompt_roles: for a sampler with a role adapter (MoRAgent, ``loop.RoleAdapter``): the
    role id of the generated tokens (the turn being generated) and of each prompt token (empty =
    NO_ROLE everywhere); NO_ROLE (-1) tokens get no adapter.
    seed: the request's random stream: its k-th token is drawn with ``fold_in(fold_in(key, seed),
    k)`` (``key``: ``generate``'s), so it gets the same tokens alone, in any batch or refilled
    into any slot (``SamplerConfig.refill``). None: its index in the ``generate`` call.
    """

    prompt_ids: Sequence[int]
    expert_ids: Sequence[int] = ()
    expert_weights: Sequence[float] = ()
    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    stop_token_ids: Sequence[int] = ()
    stop_strings: Sequence[str] = ()
    heal_tokens: int = 0
    role: int = NO_ROLE
    prompt_roles: Sequence[int] = ()
    seed: int | None = None

    def validate(self, index: int = 0) -> None:
        where = f"requests[{index}]"
        if len(self.prompt_ids) == 0:
            raise ValueError(f"{where}.prompt_ids is empty")
        if self.max_new_tokens < 1:
            raise ValueError(f"{where}.max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise ValueError(f"{where}.temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"{where}.top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"{where}.top_k must be >= 0, got {self.top_k}")
        if len(self.expert_ids) != len(self.expert_weights):
            raise ValueError(f"{where}: expert_ids and expert_weights differ in length")
        if not 0 <= self.heal_tokens < len(self.prompt_ids):
            raise ValueError(f"{where}.heal_tokens must be in [0, len(prompt_ids)), got {self.heal_tokens}")
        if self.seed is not None and not 0 <= self.seed < 2 ** 32:
            raise ValueError(f"{where}.seed must be in [0, 2**32), got {self.seed}")
        if self.prompt_roles and len(self.prompt_roles) != len(self.prompt_ids):
            raise ValueError(f"{where}.prompt_roles has {len(self.prompt_roles)} ids for {len(self.prompt_ids)} "
                             "prompt tokens")

    @property
    def uses_roles(self) -> bool:
        return self.role != NO_ROLE or any(r != NO_ROLE for r in self.prompt_roles)


@dataclasses.dataclass
class Completion:
    """token_ids: generated ids; logprobs: float32 log-prob of each under the model at T=1.

    prompt_len: how many of the request's prompt tokens ``token_ids`` continue (fewer than the
    prompt after token healing). text: what follows the request's *whole* prompt (a healed
    first token's re-written part, ``healed_text``, is not repeated in it).
    A healed first token's log-prob is the model's unconstrained one (what an update re-scores),
    not that of the constrained distribution it was drawn from.
    """

    token_ids: list[int]
    text: str
    logprobs: np.ndarray
    finish_reason: str
    prompt_len: int
    # with SamplerConfig.return_prefix_states: the residual stream entering the first adapted
    # layer at every prompt and generated position, [prompt_len + len(token_ids), d] (model dtype)
    prefix_states: np.ndarray | None = None
    healed_text: str = ""  # the dropped prompt text the first token re-wrote ('' = not healed)


@dataclasses.dataclass(frozen=True)
class SamplerConfig:
    """Buckets and limits. Shapes reaching jit are rounded up to these buckets (ascending)."""

    batch_buckets: tuple[int, ...] = (1, 2, 4, 8, 16, 32)
    prompt_buckets: tuple[int, ...] = (64, 128, 256, 512, 1024, 2048, 4096)
    new_token_buckets: tuple[int, ...] = (16, 32, 64, 128, 256, 512, 1024, 2048)
    max_batch: int = 16  # micro-batch size
    chunk: int = 32  # decode steps between host checks (stop strings, all-done)
    k_cap: int = 256  # top-k candidates inside which top-p runs
    max_active: int = 4  # expert slots per row
    # "fused": morse_jax.models.decode (fused, transposed weights; decode-layout caches; fast).
    # "model": the backbone's own forward with per-layer caches (reference path, slower on CPU).
    decode_path: str = "fused"
    cache_dtype: Any = None  # default: the params' dtype
    # LoRA composition inside the sampler (same maths): "gather" each row's experts, "onehot"
    # all experts with per-row weights, or "auto" (onehot while E <= rows * max_active).
    lora_compose: str = "auto"
    # prompt tokens per prefill chunk, summed over the batch (prefill_token_rows); 0: by backend
    prefill_rows: int = 0
    # Prefill each distinct request of a micro-batch once (same prompt, prompt roles, expert set
    # and role: the M candidates of an HGRPO route) when they fit a smaller batch bucket, and copy
    # its rows (sampling.shared_prefill). Same outputs; off = every row prefills its own prompt.
    share_prefill: bool = True
    # Also return each completion's residual stream entering the first adapted layer
    # (Completion.prefix_states): the layers before it are frozen and expert-free, so the trainer
    # can restart there instead of recomputing them (rl.train_step, TrainConfig.reuse_prefix_states).
    # Costs d floats per position on the host. "fused" decode path only.
    return_prefix_states: bool = False
    # Native C++ kernels (morse_jax.kernels, built with the machine's C++ compiler at first use)
    # for the decode step's weight projections, LM head and attention: "auto" uses them where they
    # apply (CPU backend, no multi-device mesh, float32 weights and cache, "fused" path, the build
    # succeeds, and a short probe finds them faster than XLA's dot here: kernels.probe) and falls
    # back to XLA otherwise; "on" raises instead of falling back; "off" never
    # uses them. Sampler.native_kernels says what was chosen and why.
    cpu_kernels: str = "auto"
    # Block-quantised weights (Backbone.blocks: a GGUF's Q4_1 / Q8_0 tensors, models.gguf_blocks)
    # for decode steps of 1-4 rows on the native kernels (kernels.block_matmul): the same weight
    # values in 0.75 / 1.125 bytes each instead of 4, which is what a step at batch 1 waits for.
    # "auto": where the backbone has them and the native kernels are on; "off": float32 weights.
    block_weights: str = "auto"
    # Slot refill (continuous batching, ``sampling.refill``): up to max_batch requests run at once
    # and a finished row's slot takes the next queued request (prefilled alone into that slot)
    # instead of idling until the longest row of a static micro-batch ends. Same tokens and
    # log-probs per request either way (per-request keys: Request.seed). "fused" decode path,
    # no mesh, no return_prefix_states; otherwise generate falls back to static micro-batches.
    refill: bool = False

    def __post_init__(self):
        for name in ("batch_buckets", "prompt_buckets", "new_token_buckets"):
            b = tuple(getattr(self, name))
            if not b or any(x < 1 for x in b) or list(b) != sorted(set(b)):
                raise ValueError(f"sampler.{name} must be non-empty, positive and strictly ascending, got {b}")
        for name in ("max_batch", "chunk", "k_cap", "max_active"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"sampler.{name} must be >= 1, got {getattr(self, name)}")
        if int(self.prefill_rows) < 0:
            raise ValueError(f"sampler.prefill_rows must be >= 0 (0: by backend), got {self.prefill_rows}")
        if self.lora_compose not in ("auto", "gather", "onehot"):
            raise ValueError(f"sampler.lora_compose must be auto, gather or onehot, got {self.lora_compose!r}")
        if self.decode_path not in DECODE_PATHS:
            raise ValueError(f"sampler.decode_path must be one of {DECODE_PATHS}, got {self.decode_path!r}")
        if self.max_batch > max(self.batch_buckets):
            raise ValueError(f"sampler.max_batch={self.max_batch} exceeds the largest batch bucket")
        if self.cpu_kernels not in ("auto", "on", "off"):
            raise ValueError(f"sampler.cpu_kernels must be auto, on or off, got {self.cpu_kernels!r}")
        if self.block_weights not in ("auto", "off"):
            raise ValueError(f"sampler.block_weights must be auto or off, got {self.block_weights!r}")
        if self.return_prefix_states and self.decode_path != "fused":
            raise ValueError("sampler.return_prefix_states needs sampler.decode_path='fused'")


DEFAULT_SAMPLER_CONFIG = SamplerConfig()  # one shared default (the config is frozen)


def bucket(n: int, buckets: Sequence[int], what: str) -> int:
    for b in buckets:
        if n <= b:
            return b
    raise ValueError(f"{what}={n} exceeds the largest bucket {max(buckets)}; extend the sampler buckets")



def check_request(r: Request, i: int, config: SamplerConfig, vocab_size: int, spec: ExpertBankSpec | None,
                  num_roles: int = 0) -> None:
    """Reject request ``i`` before anything runs (a bad row must not cost a compile or a batch).
    num_roles: the role adapter's role count (0: the sampler has none)."""
    r.validate(i)
    where = f"requests[{i}]"
    if r.uses_roles and num_roles == 0:
        raise ValueError(f"{where}: role ids given but the sampler has no role adapter")
    if not all(NO_ROLE <= x < num_roles for x in (r.role, *r.prompt_roles)) and num_roles:
        raise ValueError(f"{where}: role ids must be in [{NO_ROLE}, {num_roles})")
    V = vocab_size
    if min(r.prompt_ids) < 0 or max(r.prompt_ids) >= V:
        raise ValueError(f"{where}.prompt_ids has ids outside [0, {V})")
    if r.expert_ids and spec is None:
        raise ValueError(f"{where}.expert_ids: the sampler has no expert bank spec")
    if len(r.expert_ids) > config.max_active:
        raise ValueError(f"{where}.expert_ids: {len(r.expert_ids)} experts > sampler.max_active={config.max_active}")
    if r.expert_ids and not all(0 <= e < spec.num_experts for e in r.expert_ids):
        raise ValueError(f"{where}.expert_ids {list(r.expert_ids)} outside [0, {spec.num_experts})")
    if len(r.stop_token_ids) > MAX_STOP_IDS:
        raise ValueError(f"{where}.stop_token_ids: more than {MAX_STOP_IDS}")
    bucket(len(r.prompt_ids), config.prompt_buckets, f"{where} prompt length")
    bucket(r.max_new_tokens, config.new_token_buckets, f"{where}.max_new_tokens")


@dataclasses.dataclass(frozen=True)
class BatchShape:
    """The static shapes of one micro-batch (each a compile key).

    rows: the batch bucket B (>= the requests). prompt: the prompt bucket P. chunk: prefill chunk
    length (divides P). prompt_end: P_pad, the longest prompt rounded up to ``chunk``; prompts are
    left-padded to end there, so every row's first new token lands at slot P_pad. new_tokens: the
    new-token bucket N. The KV cache holds P + N slots.
    """

    rows: int
    prompt: int
    chunk: int
    prompt_end: int
    new_tokens: int

    @property
    def cache_len(self) -> int:
        return self.prompt + self.new_tokens

    @property
    def prefill_chunks(self) -> int:
        return self.prompt_end // self.chunk


CPU_PREFILL_ROWS, ACCELERATOR_PREFILL_ROWS = 512, 4096


def prefill_token_rows(config: SamplerConfig, backend: str | None = None) -> int:
    """Prompt tokens per prefill chunk: ``config.prefill_rows``, or for 0 the backend's default.
    CPU: 512 (wider chunks cost CPU time, README "prefill"). GPU/TPU: 4096, because with 512 a
    64 x 512-token prefill ran as 64 chunks of 8 tokens at ~10x its FLOP time on an H200 (README
    "GPU figures"); a chunk's scores are [4096, heads, cache] floats, ~5 GB at 32 heads x 10k slots.
    Resolved when a batch is shaped (the backend is known then), never at config time."""
    if config.prefill_rows:
        return int(config.prefill_rows)
    if backend is None:
        import jax

        backend = jax.default_backend()
    return CPU_PREFILL_ROWS if backend == "cpu" else ACCELERATOR_PREFILL_ROWS


def prefill_chunk(prefill_rows: int, batch: int, prompt_bucket: int) -> int:
    """Prefill chunk length: a power of two near ``prefill_rows / batch`` dividing the bucket."""
    c = max(1, prefill_rows // batch)
    c = min(1 << (c.bit_length() - 1), prompt_bucket)
    return c if prompt_bucket % c == 0 else prompt_bucket


def batch_shape(reqs: Sequence[Request], config: SamplerConfig) -> BatchShape:
    """Bucketed shapes for one micro-batch of (validated) requests."""
    B = bucket(len(reqs), config.batch_buckets, "batch")
    P_max = max(len(r.prompt_ids) for r in reqs)
    P = bucket(P_max, config.prompt_buckets, "prompt length")
    chunk = prefill_chunk(prefill_token_rows(config), B, P)
    N = bucket(max(r.max_new_tokens for r in reqs), config.new_token_buckets, "max_new_tokens")
    return BatchShape(rows=B, prompt=P, chunk=chunk, prompt_end=-(-P_max // chunk) * chunk, new_tokens=N)


def pack_requests(reqs: Sequence[Request], shape: BatchShape, max_active: int,
                  roles: bool = False) -> tuple[PromptBatch, ExpertSlots, DecodeSettings, np.ndarray]:
    """Host arrays for one micro-batch: (prompts, expert slots, decode settings, done bool[B]).

    Rows past ``len(reqs)`` are padding: empty prompts, no experts, greedy, and done from the start
    (they never generate). Stop ids are padded with -1 to a fixed width, so their count costs no
    compile. roles: also pack the role ids (prompt tokens' int32[B, P], generated tokens' int32[B];
    NO_ROLE in padding) for a role adapter.
    """
    B, P, P_pad = shape.rows, shape.prompt, shape.prompt_end
    tokens = np.zeros((B, P), np.int32)
    valid = np.zeros((B, P), bool)
    ids = np.zeros((B, max_active), np.int32)
    weights = np.zeros((B, max_active), np.float32)
    temperature = np.zeros(B, np.float32)
    top_k = np.zeros(B, np.int32)
    top_p = np.ones(B, np.float32)
    max_new = np.ones(B, np.int32)
    stop_ids = np.full((B, MAX_STOP_IDS), -1, np.int32)
    for i, r in enumerate(reqs):
        p = np.asarray(r.prompt_ids, np.int32)
        tokens[i, P_pad - len(p):P_pad] = p
        valid[i, P_pad - len(p):P_pad] = True
        ids[i, :len(r.expert_ids)] = r.expert_ids
        weights[i, :len(r.expert_weights)] = r.expert_weights
        temperature[i], top_k[i], top_p[i], max_new[i] = r.temperature, r.top_k, r.top_p, r.max_new_tokens
        stop_ids[i, :len(r.stop_token_ids)] = r.stop_token_ids
    done = np.arange(B) >= len(reqs)
    prompt_roles = gen_roles = None
    if roles:
        prompt_roles = np.full((B, P), NO_ROLE, np.int32)
        gen_roles = np.full(B, NO_ROLE, np.int32)
        for i, r in enumerate(reqs):
            if r.prompt_roles:
                prompt_roles[i, P_pad - len(r.prompt_roles):P_pad] = r.prompt_roles
            gen_roles[i] = r.role
    return (PromptBatch(tokens, valid, prompt_roles), ExpertSlots(ids, weights, gen_roles),
            DecodeSettings(temperature, top_k, top_p, max_new, stop_ids), done)
