"""Batched generation with per-row prompts, expert sets and sampling settings.

The host side packs requests into micro-batches whose shapes come from a few buckets (batch
size, prompt length, new-token budget) so compiles stay few and are counted: one prefill and one
decode program per bucket combination, whatever the requests' lengths, settings and expert sets.
The device side is a jitted prefill (prompt chunks in a loop, so the work follows the longest
prompt rather than its bucket) and a jitted decode chunk (a ``lax.while_loop`` over a static,
donated KV cache updated in place); the host checks stop strings between chunks and stops early
once every row is done. The model maths run through ``morse_jax.models.decode`` (fused,
transposed weights and a decode-friendly cache layout; see there and ``bench/sampler.py`` for
what that buys on CPU), or through the backbone's own forward (``decode_path="model"``).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from morse_jax.models.loading import Backbone
from morse_jax.models.transformer import forward, init_cache, split_segments, unstack_segments
from morse_jax.mole.experts import ExpertBankSpec, gather_lora
from morse_jax.models.decode import (
    decode_params,
    decode_step,
    forward_cached,
    init_decode_cache,
    positions_from_valid,
    prepare_lora,
    rope_tables_for,
)
from morse_jax.sampling.sample import NEG, select_tokens

log = logging.getLogger("morse_jax.sampling")
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
    prefill_rows: int = 512  # prompt tokens per prefill chunk, summed over the batch (see Sampler._chunk)
    # Also return each completion's residual stream entering the first adapted layer
    # (Completion.prefix_states): the layers before it are frozen and expert-free, so the trainer
    # can restart there instead of recomputing them (rl.train_step, TrainConfig.reuse_prefix_states).
    # Costs d floats per position on the host. "fused" decode path only.
    return_prefix_states: bool = False
    # Native C++ kernels (morse_jax.kernels, built with the machine's C++ compiler at first use)
    # for the decode step's weight projections, LM head and attention: "auto" uses them where they
    # apply (CPU backend, no multi-device mesh, float32 weights and cache, "fused" path, the build
    # succeeds) and falls back to XLA otherwise; "on" raises instead of falling back; "off" never
    # uses them. Sampler.native_kernels says what was chosen and why.
    cpu_kernels: str = "auto"

    def __post_init__(self):
        for name in ("batch_buckets", "prompt_buckets", "new_token_buckets"):
            b = tuple(getattr(self, name))
            if not b or any(x < 1 for x in b) or list(b) != sorted(set(b)):
                raise ValueError(f"sampler.{name} must be non-empty, positive and strictly ascending, got {b}")
        for name in ("max_batch", "chunk", "k_cap", "max_active", "prefill_rows"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"sampler.{name} must be >= 1, got {getattr(self, name)}")
        if self.lora_compose not in ("auto", "gather", "onehot"):
            raise ValueError(f"sampler.lora_compose must be auto, gather or onehot, got {self.lora_compose!r}")
        if self.decode_path not in DECODE_PATHS:
            raise ValueError(f"sampler.decode_path must be one of {DECODE_PATHS}, got {self.decode_path!r}")
        if self.max_batch > max(self.batch_buckets):
            raise ValueError(f"sampler.max_batch={self.max_batch} exceeds the largest batch bucket")
        if self.cpu_kernels not in ("auto", "on", "off"):
            raise ValueError(f"sampler.cpu_kernels must be auto, on or off, got {self.cpu_kernels!r}")
        if self.return_prefix_states and self.decode_path != "fused":
            raise ValueError("sampler.return_prefix_states needs sampler.decode_path='fused'")


def _bucket(n: int, buckets: Sequence[int], what: str) -> int:
    for b in buckets:
        if n <= b:
            return b
    raise ValueError(f"{what}={n} exceeds the largest bucket {max(buckets)}; extend the sampler buckets")


class Sampler:
    """Compiled generation for one backbone (and optionally one expert-bank layout).

    ``compile_count`` counts traces of the prefill and decode functions. With a ``mesh``
    (``morse_jax.parallel.make_mesh``) both run with explicit in/out shardings: backbone weights
    by the logical-axis rules, batch rows and caches split over (data, fsdp), the bank replicated.
    """

    def __init__(self, backbone: Backbone, spec: ExpertBankSpec | None = None,
                 config: SamplerConfig = SamplerConfig(), mesh=None):
        self.backbone, self.spec, self.config = backbone, spec, config
        self.cfg = backbone.config
        self._n_adapt = spec.n_adapt if spec is not None else 0
        # layer whose input the sampler returns (Completion.prefix_states), or None
        self.capture_layer = None
        if config.return_prefix_states:
            if not 0 < self._n_adapt < self.cfg.num_layers:
                raise ValueError("sampler.return_prefix_states: needs an expert bank that leaves a frozen prefix "
                                 f"(0 < n_adapt < {self.cfg.num_layers} layers), got n_adapt={self._n_adapt}")
            self.capture_layer = self.cfg.num_layers - self._n_adapt
        if config.decode_path == "fused":
            self._params = decode_params(backbone.params, self.cfg)
        else:  # per-layer (unrolled) params: per-layer caches update in place; a scanned stack copies
            self._params = unstack_segments(split_segments(backbone.params, self._n_adapt))
        self._native, self.native_kernels = self._use_native_kernels(mesh)
        self._healer = None  # TokenHealer, built at the first request that heals
        self.compile_count = 0
        # Wall-clock split of the last generate() call (seconds; summed over micro-batches):
        # prefill_s includes the prefill's compile on a first call, decode_s the decode's.
        self.last_stats: dict[str, float] = {}
        self._prefill = jax.jit(self._prefill_impl, static_argnames=("cache_len", "chunk"))
        self._decode = jax.jit(self._decode_impl, donate_argnums=(2,))
        self.mesh = mesh
        if mesh is not None:  # params, batches and caches sharded over the mesh (morse_jax.parallel)
            from morse_jax.parallel.jit import sampler_functions

            self._params, self._prefill, self._decode = sampler_functions(self, mesh)

    def _use_native_kernels(self, mesh) -> tuple[bool, str]:
        """(whether decode steps run on the native CPU kernels, a line saying so and why)."""
        mode = self.config.cpu_kernels
        if mode == "off":
            return False, "off (sampler.cpu_kernels='off')"
        from morse_jax.kernels import unavailable_reason

        cache_dtype = jnp.dtype(self.config.cache_dtype or self._params["embed"].dtype)
        reason = None
        if self.config.decode_path != "fused":
            reason = f"decode_path={self.config.decode_path!r} (the kernel serves the fused path)"
        elif mesh is not None and mesh.size > 1:
            reason = f"a {mesh.size}-device mesh (the kernel is unsharded)"
        elif self._params["embed"].dtype != jnp.float32:
            reason = f"{self._params['embed'].dtype} weights (the kernels are float32)"
        elif cache_dtype != jnp.float32:
            reason = f"a {cache_dtype} KV cache (the kernels are float32)"
        else:
            reason = unavailable_reason()
        if reason is None:
            return True, "on"
        if mode == "on":
            raise ValueError(f"sampler.cpu_kernels='on' but the native kernels cannot run: {reason}")
        log.info("sampler: native CPU kernels not used: %s", reason)
        return False, f"off ({reason})"

    # ------------------------------------------------------------------ device functions

    def _lora(self, bank, ids, weights):
        """Per-row LoRA inputs for a batch; computed once per device call (outside the loop)."""
        if self.spec is None or bank is None:
            return None
        compose = self.config.lora_compose
        if compose == "auto":  # all experts beat per-row gathers unless the bank outgrows the batch's slots
            compose = "onehot" if self.spec.num_experts <= ids.shape[0] * ids.shape[1] else "gather"
        lora = gather_lora(bank, dataclasses.replace(self.spec, compose=compose), ids, weights)
        return prepare_lora(lora) if self.config.decode_path == "fused" else lora

    def _forward(self, params, tokens, valid, positions, cache, lora, rope=None):
        """Logits at the last new position [B, V] and the updated cache (and, with
        ``capture_layer``, the residual entering it [B, T, d])."""
        if self.config.decode_path == "fused":
            return forward_cached(params, self.cfg, tokens, valid, positions, cache, lora, rope,
                                  capture_layer=self.capture_layer)
        return forward(params, self.cfg, tokens, positions=positions, valid=valid, cache=cache, lora=lora,
                       logits_mode="last")

    def _step(self, params, tokens, active, positions, cache, lora, rope):
        """One token per row: logits [B, V] and the updated cache (and the captured residual [B, d])."""
        if self.config.decode_path == "fused":
            return decode_step(params, self.cfg, tokens, active, positions, cache, lora, rope,
                               capture_layer=self.capture_layer, native=self._native)
        return self._forward(params, tokens[:, None], active[:, None], positions[:, None], cache, lora)

    def _chunk(self, batch: int, prompt_bucket: int) -> int:
        """Prefill chunk length: a power of two near ``prefill_rows / batch`` dividing the bucket."""
        c = max(1, self.config.prefill_rows // batch)
        c = min(1 << (c.bit_length() - 1), prompt_bucket)
        return c if prompt_bucket % c == 0 else prompt_bucket

    def _prefill_impl(self, params, bank, tokens, valid, ids, weights, n_chunks, *, cache_len, chunk):
        """Prompts in ``n_chunks`` chunks of ``chunk`` tokens (a loop, so the chunk count is
        dynamic: prefill work follows the batch's longest prompt, not its bucket, and the
        attention scores of a chunk stay [B, heads, chunk, S] however long the prompt)."""
        self.compile_count += 1  # runs at trace time only
        B = tokens.shape[0]
        dtype = self.config.cache_dtype or params["embed"].dtype
        if self.config.decode_path == "fused":
            cache = init_decode_cache(self.cfg, B, cache_len, dtype)
        else:
            cache = init_cache(self.cfg, params, B, cache_len, dtype)
        lora = self._lora(bank, ids, weights)
        positions = positions_from_valid(valid)
        rope = rope_tables_for(self.cfg, cache_len, dtype) if self.config.decode_path == "fused" else None

        def body(i, carry):
            def part(a):
                return jax.lax.dynamic_slice_in_dim(a, i * chunk, chunk, axis=1)

            out = self._forward(params, part(tokens), part(valid), part(positions), carry[1], lora, rope)
            if self.capture_layer is None:
                return out
            return out[0], out[1], jax.lax.dynamic_update_slice_in_dim(carry[2], out[2], i * chunk, axis=1)

        carry = (jnp.zeros((B, self.cfg.vocab_size), jnp.float32), cache)
        if self.capture_layer is not None:
            carry += (jnp.zeros((*tokens.shape, self.cfg.hidden_size), params["embed"].dtype),)
        carry = jax.lax.fori_loop(0, n_chunks, body, carry)
        return (*carry[:2], jnp.sum(valid, axis=1, dtype=jnp.int32), *carry[2:])

    def _decode_impl(self, params, bank, state, ids, weights, settings, stop_end):
        """Run decode steps until ``stop_end`` steps are done or every row is done."""
        self.compile_count += 1
        lora = self._lora(bank, ids, weights)
        temperature, top_k, top_p, max_new, stop_ids = settings
        rope = None
        if self.config.decode_path == "fused":  # loop-invariant tables, built once per call
            rope = rope_tables_for(self.cfg, state["cache"]["valid"].shape[1], params["embed"].dtype)

        def cond(s):
            return (s["step"] < stop_end) & ~jnp.all(s["done"])

        def body(s):
            key, sub = jax.random.split(s["key"])
            tok, lp = select_tokens(sub, s["logits"], temperature, top_k, top_p, k_cap=self.config.k_cap,
                                    barrier=self.mesh is None)
            active = ~s["done"]
            tokens = s["tokens"].at[:, s["step"]].set(jnp.where(active, tok, 0))
            logps = s["logps"].at[:, s["step"]].set(jnp.where(active, lp, 0.0))
            n_gen = s["n_gen"] + active
            hit_stop = jnp.any(tok[:, None] == stop_ids, axis=-1) & active
            hit_len = (n_gen >= max_new) & active
            reason = jnp.where(hit_stop, 1, jnp.where(hit_len, 3, s["reason"]))
            done = s["done"] | hit_stop | hit_len
            out = self._step(params, tok, active, s["pos"], s["cache"], lora, rope)
            extra = {} if self.capture_layer is None else {"states": s["states"].at[:, s["step"]].set(out[2])}
            return dict(s, key=key, tokens=tokens, logps=logps, n_gen=n_gen, reason=reason, done=done,
                        logits=out[0], cache=out[1], pos=s["pos"] + active, step=s["step"] + 1, **extra)

        return jax.lax.while_loop(cond, body, state)

    def lower_decode(self, bank, batch: int, prompt_bucket: int, new_token_bucket: int):
        """The decode program of one bucket combination, lowered, for inspection
        (``.compile().as_text()`` gives its HLO; the tests check it never copies a cache)."""
        B, S, N = batch, prompt_bucket + new_token_bucket, new_token_bucket
        sds = jax.ShapeDtypeStruct
        dtype = self.config.cache_dtype or self._params["embed"].dtype
        if self.config.decode_path == "fused":
            cache = jax.eval_shape(lambda: init_decode_cache(self.cfg, B, S, dtype))
        else:
            cache = jax.eval_shape(lambda: init_cache(self.cfg, self._params, B, S, dtype))
        i32, f32 = jnp.int32, jnp.float32
        state = dict(key=jax.eval_shape(lambda: jax.random.PRNGKey(0)), logits=sds((B, self.cfg.vocab_size), f32),
                     cache=cache, pos=sds((B,), i32), step=sds((), i32), tokens=sds((B, N), i32),
                     logps=sds((B, N), f32), n_gen=sds((B,), i32), reason=sds((B,), i32), done=sds((B,), bool))
        if self.capture_layer is not None:
            state["states"] = sds((B, N, self.cfg.hidden_size), self._params["embed"].dtype)
        slots = (B, self.config.max_active)
        settings = (sds((B,), f32), sds((B,), i32), sds((B,), f32), sds((B,), i32), sds((B, MAX_STOP_IDS), i32))
        return self._decode.lower(self._params, bank if self.spec is not None else None, state, sds(slots, i32),
                                  sds(slots, f32), settings, sds((), i32))

    # ------------------------------------------------------------------ host side

    def generate(self, bank, requests: Sequence[Request], *, key: jax.Array, progress=None) -> list[Completion]:
        """Generate for every request; returns completions in request order."""
        if not requests:
            return []
        for i, r in enumerate(requests):
            self._check(r, i)
        self.last_stats = {"prefill_s": 0.0, "decode_s": 0.0, "decode_steps": 0, "batches": 0}
        requests, heals = self._heal(requests)
        order = sorted(range(len(requests)), key=lambda i: len(requests[i].prompt_ids))
        out: list[Completion | None] = [None] * len(requests)
        mb = self.config.max_batch
        for n, start in enumerate(range(0, len(order), mb)):
            idx = order[start:start + mb]
            batch = self._generate_batch(bank, [requests[i] for i in idx], jax.random.fold_in(key, n),
                                         [heals[i] for i in idx])
            for i, c in zip(idx, batch):
                out[i] = c
            if progress is not None:
                progress(len(idx))
        return out  # type: ignore[return-value]

    def _heal(self, requests: Sequence[Request]) -> tuple[list[Request], list[tuple[str, np.ndarray] | None]]:
        """Requests with healed prompts cut, and per request (dropped text, allowed bool[V]) or None."""
        out, heals = [], []
        for r in requests:
            h = None
            if r.heal_tokens and self.backbone.tokenizer is not None:
                if self._healer is None:
                    from morse_jax.sampling.healing import TokenHealer

                    self._healer = TokenHealer(self.backbone.tokenizer, self.cfg.vocab_size)
                n, text, allowed = self._healer.heal(r.prompt_ids, r.heal_tokens)
                if n:
                    h = (text, allowed)
                    r = dataclasses.replace(r, prompt_ids=list(r.prompt_ids)[:-n])
            out.append(dataclasses.replace(r, heal_tokens=0) if r.heal_tokens else r)
            heals.append(h)
        return out, heals

    def _check(self, r: Request, i: int) -> None:
        """Reject a request before anything runs (a bad row must not cost a compile or a batch)."""
        r.validate(i)
        where, cfg = f"requests[{i}]", self.config
        V = self.cfg.vocab_size
        if min(r.prompt_ids) < 0 or max(r.prompt_ids) >= V:
            raise ValueError(f"{where}.prompt_ids has ids outside [0, {V})")
        if r.expert_ids and self.spec is None:
            raise ValueError(f"{where}.expert_ids: the sampler has no expert bank spec")
        if len(r.expert_ids) > cfg.max_active:
            raise ValueError(f"{where}.expert_ids: {len(r.expert_ids)} experts > sampler.max_active={cfg.max_active}")
        if r.expert_ids and not all(0 <= e < self.spec.num_experts for e in r.expert_ids):
            raise ValueError(f"{where}.expert_ids {list(r.expert_ids)} outside [0, {self.spec.num_experts})")
        if len(r.stop_token_ids) > MAX_STOP_IDS:
            raise ValueError(f"{where}.stop_token_ids: more than {MAX_STOP_IDS}")
        _bucket(len(r.prompt_ids), cfg.prompt_buckets, f"{where} prompt length")
        _bucket(r.max_new_tokens, cfg.new_token_buckets, f"{where}.max_new_tokens")

    def _generate_batch(self, bank, reqs: list[Request], key, heals=None) -> list[Completion]:
        """One micro-batch; ``heals[i]``: (dropped text, allowed first tokens bool[V]) or None."""
        cfg = self.config
        heals = list(heals) if heals is not None else [None] * len(reqs)
        n = len(reqs)
        B = _bucket(n, cfg.batch_buckets, "batch")
        P_max = max(len(r.prompt_ids) for r in reqs)
        P = _bucket(P_max, cfg.prompt_buckets, "prompt length")
        chunk = self._chunk(B, P)
        P_pad = -(-P_max // chunk) * chunk
        N = _bucket(max(r.max_new_tokens for r in reqs), cfg.new_token_buckets, "max_new_tokens")
        tokens = np.zeros((B, P), np.int32)
        valid = np.zeros((B, P), bool)
        ids = np.zeros((B, cfg.max_active), np.int32)
        weights = np.zeros((B, cfg.max_active), np.float32)
        temperature = np.zeros(B, np.float32)
        top_k = np.zeros(B, np.int32)
        top_p = np.ones(B, np.float32)
        max_new = np.ones(B, np.int32)
        stop_ids = np.full((B, MAX_STOP_IDS), -1, np.int32)  # fixed width: no compile per count
        for i, r in enumerate(reqs):
            p = np.asarray(r.prompt_ids, np.int32)
            # left padding up to the chunk grid: every row's next token lands at slot P_pad
            tokens[i, P_pad - len(p):P_pad] = p
            valid[i, P_pad - len(p):P_pad] = True
            ids[i, :len(r.expert_ids)] = r.expert_ids
            weights[i, :len(r.expert_weights)] = r.expert_weights
            temperature[i], top_k[i], top_p[i], max_new[i] = r.temperature, r.top_k, r.top_p, r.max_new_tokens
            stop_ids[i, :len(r.stop_token_ids)] = r.stop_token_ids
        done = np.arange(B) >= n  # padding rows never generate
        bank_arg = bank if self.spec is not None else None

        t0 = time.perf_counter()
        logits, cache, pos, *prompt_states = self._prefill(self._params, bank_arg, tokens, valid, ids, weights,
                                                           np.int32(P_pad // chunk), cache_len=P + N, chunk=chunk)
        logits.block_until_ready()  # only to split the timing; decode cannot start before anyway
        full_logits = None
        if any(h is not None for h in heals):  # token healing: constrain the first token, once, here
            # for the healed tokens' unconstrained log-probs (row-sharded over a mesh: gather them)
            if self.mesh is None:
                full_logits = np.asarray(logits)
            else:
                from morse_jax.parallel.distributed import process_allgather

                full_logits = np.asarray(process_allgather(logits))
            mask = np.ones(full_logits.shape, bool)
            for i, h in enumerate(heals):
                if h is not None:
                    mask[i] = h[1]
            allowed = mask
            if self.mesh is not None:  # laid out like the logits (every process holds every row's mask)
                allowed = jax.make_array_from_callback(mask.shape, logits.sharding, lambda idx: mask[idx])
            logits = _constrain(logits, allowed)
        t1 = time.perf_counter()
        state = dict(key=key, logits=logits, cache=cache, pos=pos, step=jnp.zeros((), jnp.int32),
                     tokens=jnp.zeros((B, N), jnp.int32), logps=jnp.zeros((B, N), jnp.float32),
                     n_gen=jnp.zeros(B, jnp.int32), reason=jnp.zeros(B, jnp.int32), done=jnp.asarray(done))
        if self.capture_layer is not None:
            state["states"] = jnp.zeros((B, N, self.cfg.hidden_size), prompt_states[0].dtype)
        settings = (jnp.asarray(temperature), jnp.asarray(top_k), jnp.asarray(top_p), jnp.asarray(max_new),
                    jnp.asarray(stop_ids))
        has_strings = any(r.stop_strings for r in reqs)
        stop_at = np.full(B, -1)  # step index (exclusive) where a stop string completed
        step = 0
        tok = self.backbone.tokenizer
        while step < N:
            step = min(step + (cfg.chunk if has_strings else N), N)
            state = self._decode(self._params, bank_arg, state, ids, weights, settings, jnp.int32(step))
            done = np.asarray(state["done"])
            if has_strings and tok is not None:
                toks = np.asarray(state["tokens"])
                n_gen = np.asarray(state["n_gen"])
                newly = []
                for i, r in enumerate(reqs):
                    if stop_at[i] < 0 and r.stop_strings:
                        cut = _find_stop(tok, toks[i, :n_gen[i]].tolist(), r.stop_strings)
                        if cut is not None:
                            stop_at[i] = cut
                            newly.append(i)
                if newly:
                    d = done.copy()
                    d[newly] = True
                    state = dict(state, done=jnp.asarray(d))
                    done = d
            if done.all():
                break

        toks = np.asarray(state["tokens"])
        st = self.last_stats
        st["prefill_s"] += t1 - t0
        st["decode_s"] += time.perf_counter() - t1
        st["decode_steps"] += int(state["step"])
        st["batches"] += 1
        logps = np.asarray(state["logps"])
        n_gen = np.asarray(state["n_gen"])
        reason = np.asarray(state["reason"])
        if self.capture_layer is not None:  # row-sharded over the mesh: every process needs every row
            from morse_jax.parallel.distributed import process_allgather

            prompt_states, gen_states = process_allgather((prompt_states[0], state["states"]))
        out = []
        for i, r in enumerate(reqs):
            k = int(n_gen[i]) if stop_at[i] < 0 else int(stop_at[i])
            ids_i = toks[i, :k].tolist()
            text = tok.decode(ids_i, skip_special_tokens=True) if tok is not None else ""
            if stop_at[i] >= 0:
                finish = "stop"
                text = _cut_text(text, r.stop_strings)
            else:
                finish = {1: "eos", 3: "length"}.get(int(reason[i]), "length")
            lp = logps[i, :k].copy()
            healed = ""
            if heals[i] is not None:
                healed = heals[i][0]
                text = text[len(healed):] if text.startswith(healed) else text
                if k:  # the model's own log-prob of the healed token, not the constrained one
                    row = full_logits[i].astype(np.float64)
                    mx = row.max()
                    lp[0] = row[ids_i[0]] - (mx + np.log(np.exp(row - mx).sum()))
            states = None
            if self.capture_layer is not None:
                states = np.concatenate([prompt_states[i, P_pad - len(r.prompt_ids):P_pad], gen_states[i, :k]])
            out.append(Completion(ids_i, text, lp, finish, len(r.prompt_ids), states, healed))
        return out


@jax.jit
def _constrain(logits: jax.Array, allowed) -> jax.Array:
    """float32[B, V] logits with disallowed tokens at NEG (never sampled, never the argmax)."""
    return jnp.where(allowed, logits, NEG)


def _find_stop(tokenizer, ids: list[int], stop_strings: Sequence[str]) -> int | None:
    """Smallest k such that decode(ids[:k]) contains a stop string, or None."""
    text = tokenizer.decode(ids, skip_special_tokens=True)
    if not any(s in text for s in stop_strings):
        return None
    lo, hi = 1, len(ids)  # containment is monotone in the prefix length
    while lo < hi:
        mid = (lo + hi) // 2
        if any(s in tokenizer.decode(ids[:mid], skip_special_tokens=True) for s in stop_strings):
            hi = mid
        else:
            lo = mid + 1
    return lo


def _cut_text(text: str, stop_strings: Sequence[str]) -> str:
    cuts = [text.find(s) for s in stop_strings if s in text]
    return text[:min(cuts)] if cuts else text


@functools.lru_cache(maxsize=4)
def _cached_sampler(backbone: Backbone, spec: ExpertBankSpec | None, config: SamplerConfig) -> Sampler:
    return Sampler(backbone, spec, config)


def generate(backbone: Backbone, experts: tuple[dict, ExpertBankSpec] | None, requests: Sequence[Request], *,
             key: jax.Array, config: SamplerConfig = SamplerConfig()) -> list[Completion]:
    """Functional entry point: ``experts`` is (bank, spec) or None. Reuses a cached Sampler."""
    bank, spec = experts if experts is not None else (None, None)
    return _cached_sampler(backbone, spec, config).generate(bank, requests, key=key)
