"""Batched generation with per-row prompts, expert sets and sampling settings.

The host side packs requests into micro-batches whose shapes come from a few buckets (batch
size, prompt length, new-token budget) so compiles stay few and are counted: one prefill and one
decode program per bucket combination, whatever the requests' lengths, settings and expert sets.
The device side (``sampling.loop``) is a jitted prefill (prompt chunks in a loop, so the work
follows the longest prompt rather than its bucket) and a jitted decode chunk (a
``lax.while_loop`` over a static, donated KV cache updated in place, carrying a typed
``sampling.state.SamplingState``); the host checks stop strings between chunks and stops early
once every row is done (``sampling.finish``). With a mesh, ``sampling.sharded`` gives the same
functions explicit shardings. See ``bench/sampler.py`` for what the fused decode path buys.
With ``SamplerConfig.refill`` the requests share one queue and a finished row's slot takes the
next request (``sampling.refill``) instead of static micro-batches. Every request draws from its
own key (``Request.seed``), so its tokens do not depend on how it was batched.

Modules: ``requests`` (Request, Completion, SamplerConfig, packing), ``state`` (the typed
pytrees), ``loop`` (pure prefill / decode), ``sample`` (token selection), ``finish`` (stop
strings, completions), ``healing`` (token healing), ``sharded`` (mesh layout), ``refill`` (slot
refill), this one (the host loop).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import time
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from morse_jax.models.decode import decode_params
from morse_jax.models.gguf_blocks import with_blocks
from morse_jax.models.loading import Backbone
from morse_jax.models.transformer import split_segments, unstack_segments
from morse_jax.mole.experts import ExpertBankSpec
from morse_jax.parallel.distributed import process_allgather
from morse_jax.sampling import loop, refill
from morse_jax.sampling.finish import completions, mark_stop_strings
from morse_jax.sampling.healing import TokenHealer, first_token_mask
from morse_jax.sampling.requests import (  # Completion, Request, SamplerConfig: callers import them from here
    DEFAULT_SAMPLER_CONFIG,
    MAX_STOP_IDS,
    Completion,
    Request,
    SamplerConfig,
    batch_shape,
    bucket,
    check_request,
    pack_requests,
)
from morse_jax.sampling.sample import restrict_logits
from morse_jax.sampling.shared_prefill import cache_row_layout, prefill_groups, row_index, share_rows
from morse_jax.sampling.sharded import shard_sampler_functions
from morse_jax.sampling.state import DecodeSettings, ExpertSlots, PrefillOutput, SamplingState, initial_state

log = logging.getLogger("morse_jax.sampling")
_restrict = jax.jit(restrict_logits)


class Sampler:
    """Compiled generation for one backbone (and optionally one expert-bank layout).

    ``params``: the backbone's weights in the sampler's decode layout (``models.decode.
    decode_params`` for the fused path, per-layer segments for the model path), placed on the
    mesh when there is one; ``params["embed"]`` is the token embedding [V, d] (what the router
    embeds plans with). ``loop_config``: the static settings of the jitted functions.
    ``compile_count`` counts traces of the prefill and decode functions. With a ``mesh``
    (``morse_jax.parallel.make_mesh``) both run with explicit in/out shardings
    (``sampling.sharded``): backbone weights by the logical-axis rules, batch rows and caches
    split over (data, fsdp), the bank replicated.

    ``role_adapter`` (``sampling.loop.RoleAdapter``, MoRAgent's role groups; instead of ``spec``):
    ``generate``'s ``bank`` is then the adapter's parameters, and each request's ``role`` /
    ``prompt_roles`` give every token its role inside the jitted prefill and decode steps.
    """

    def __init__(self, backbone: Backbone, spec: ExpertBankSpec | None = None,
                 config: SamplerConfig = DEFAULT_SAMPLER_CONFIG, mesh=None, role_adapter=None):
        if role_adapter is not None and (spec is not None or config.decode_path != "fused"
                                         or config.return_prefix_states):
            raise ValueError("sampler: a role adapter runs alone (no expert bank spec), on decode_path='fused', "
                             "without return_prefix_states")
        self.backbone, self.spec, self.config = backbone, spec, config
        self.role_adapter = role_adapter
        self.cfg = backbone.config
        n_adapt = spec.n_adapt if spec is not None else 0
        # layer whose input the sampler returns (Completion.prefix_states), or None
        self.capture_layer = None
        if config.return_prefix_states:
            if not 0 < n_adapt < self.cfg.num_layers:
                raise ValueError("sampler.return_prefix_states: needs an expert bank that leaves a frozen prefix "
                                 f"(0 < n_adapt < {self.cfg.num_layers} layers), got n_adapt={n_adapt}")
            self.capture_layer = self.cfg.num_layers - n_adapt
        if config.decode_path == "fused":
            params = decode_params(backbone.params, self.cfg)
        else:  # per-layer (unrolled) params: per-layer caches update in place; a scanned stack copies
            params = unstack_segments(split_segments(backbone.params, n_adapt))
        native, self.native_kernels = self._use_native_kernels(mesh, params)
        self.block_weights = bool(native and config.block_weights == "auto" and backbone.blocks is not None)
        params = with_blocks(params, backbone.blocks, self.cfg) if self.block_weights else params  # 1-4 rows read blocks
        self.loop_config = loop.LoopConfig(
            cfg=self.cfg, spec=spec, decode_path=config.decode_path, lora_compose=config.lora_compose,
            capture_layer=self.capture_layer, native=native, k_cap=config.k_cap,
            barrier=mesh is None, cache_dtype=config.cache_dtype, role_adapter=role_adapter)
        self._healer: TokenHealer | None = None  # built at the first request that heals
        self.compile_count = 0
        # Wall-clock split (s) of the last generate() call, summed over micro-batches; compiles included
        self.last_stats: dict[str, float] = {}
        prefill = self._counted(functools.partial(loop.prefill, self.loop_config))
        decode = self._counted(functools.partial(loop.decode, self.loop_config))
        self.mesh = mesh
        # slot refill where it applies (fused caches, one device), else static micro-batches
        self.refill = config.refill and config.decode_path == "fused" and mesh is None
        if self.refill:
            self._empty = jax.jit(functools.partial(refill.empty_state, self.loop_config),
                                  static_argnames=("rows", "cache_len", "index", "new_tokens"))
            self._place = jax.jit(refill.place_row, donate_argnums=(0,))
            self._compact = jax.jit(refill.compact, donate_argnums=(0,))
        if mesh is None:
            self.params = params
            self._prefill = jax.jit(prefill, static_argnames=("cache_len", "chunk"))
            self._decode = jax.jit(decode, donate_argnums=(2,))
            layout = cache_row_layout(lambda b: loop.empty_cache(self.loop_config, params, b, 8))
            self._share_rows = jax.jit(functools.partial(share_rows, layout=layout))
        else:  # params, batches and caches sharded over the mesh
            self.params, self._prefill, self._decode = shard_sampler_functions(mesh, self.loop_config, params,
                                                                               prefill, decode)

    def _counted(self, fn: Callable) -> Callable:
        """``fn`` counting its traces in ``compile_count`` (the body runs at trace time only)."""
        @functools.wraps(fn)
        def traced(*args, **kwargs):
            self.compile_count += 1
            return fn(*args, **kwargs)

        return traced

    def _use_native_kernels(self, mesh, params) -> tuple[bool, str]:
        """(whether decode steps run on the native CPU kernels, a line saying so and why)."""
        mode = self.config.cpu_kernels
        if mode == "off":
            return False, "off (sampler.cpu_kernels='off')"
        from morse_jax.kernels import unavailable_reason

        cache_dtype = jnp.dtype(self.config.cache_dtype or params["embed"].dtype)
        reason = None
        if self.config.decode_path != "fused":
            reason = f"decode_path={self.config.decode_path!r} (the kernel serves the fused path)"
        elif mesh is not None and mesh.size > 1:
            reason = f"a {mesh.size}-device mesh (the kernel is unsharded)"
        elif params["embed"].dtype != jnp.float32:
            reason = f"{params['embed'].dtype} weights (the kernels are float32)"
        elif cache_dtype != jnp.float32:
            reason = f"a {cache_dtype} KV cache (the kernels are float32)"
        else:
            reason = unavailable_reason()
        if reason is None and mode == "auto":
            reason = self._native_slower()
        if reason is None:
            return True, "on"
        if mode == "on":
            raise ValueError(f"sampler.cpu_kernels='on' but the native kernels cannot run: {reason}")
        log.info("sampler: native CPU kernels not used: %s", reason)
        return False, f"off ({reason})"

    def _native_slower(self) -> str | None:
        """Why "auto" leaves the kernels off on this machine (they lose to XLA's dot on the model's
        MLP projection shape, ``kernels.probe``), or None when they pay."""
        from morse_jax.kernels import probe

        n = min(self.cfg.intermediate_size, max(1, (1 << 23) // self.cfg.hidden_size))  # <= 32 MB probe weight
        result = probe.probe_matmul(n, self.cfg.hidden_size)
        log.info("sampler: native kernel probe: %s", result.describe())
        return None if result.native_pays else f"the native kernels are slower than XLA here ({result.describe()})"

    def lower_decode(self, bank, batch: int, prompt_bucket: int, new_token_bucket: int):
        """The decode program of one bucket combination, lowered, for inspection
        (``.compile().as_text()`` gives its HLO; the tests check it never copies a cache)."""
        B, S, N, A = batch, prompt_bucket + new_token_bucket, new_token_bucket, self.config.max_active
        sds = jax.ShapeDtypeStruct
        i32, f32 = jnp.int32, jnp.float32
        cache = jax.eval_shape(lambda: loop.empty_cache(self.loop_config, self.params, B, S))
        prefill = PrefillOutput(logits=sds((B, self.cfg.vocab_size), f32), cache=cache, pos=sds((B,), i32))
        capture = {} if self.capture_layer is None else dict(hidden_size=self.cfg.hidden_size,
                                                             states_dtype=self.params["embed"].dtype)
        state = jax.eval_shape(lambda key, pre, done: initial_state(key, pre, done, N, **capture),
                               jax.eval_shape(lambda: jax.random.split(jax.random.PRNGKey(0), B)), prefill,
                               sds((B,), bool))
        experts = ExpertSlots(sds((B, A), i32), sds((B, A), f32),
                              sds((B,), i32) if self.role_adapter is not None else None)
        settings = DecodeSettings(sds((B,), f32), sds((B,), i32), sds((B,), f32), sds((B,), i32),
                                  sds((B, MAX_STOP_IDS), i32))
        return self._decode.lower(self.params, self._bank_arg(bank), state, experts, settings,
                                  sds((), i32))

    # ------------------------------------------------------------------ host side

    def generate(self, bank, requests: Sequence[Request], *, key: jax.Array, progress=None,
                 on_ready=None, profile=None) -> list[Completion]:
        """Generate for every request; returns completions in request order.

        ``on_ready(indices, completions)``: called after each micro-batch with the request indices
        it finished and their completions (the objects returned at the end), so a caller can start
        on them (the orchestrator verifies them) while the next micro-batch generates.

        With slot refill (``self.refill``) ``on_ready`` is called for each request as it finishes.

        ``profile``: a step profile (``run.profile.StepProfile``: ``phase(name)`` contexts) or None;
        each prefill call, blocked on its logits, is timed as its ``prefill`` phase.
        """
        if not requests:
            return []
        num_roles = self.role_adapter.num_roles if self.role_adapter is not None else 0
        for i, r in enumerate(requests):
            check_request(r, i, self.config, self.cfg.vocab_size, self.spec, num_roles)
        self.last_stats = {"prefill_s": 0.0, "decode_s": 0.0, "decode_steps": 0, "batches": 0}
        requests, heals = self._heal(requests)
        keys = request_keys(key, requests)
        out: list[Completion | None] = [None] * len(requests)
        if self.refill:
            def done(j: int, c: Completion):
                out[j] = c
                if on_ready is not None:
                    on_ready([j], [c])
                if progress is not None:
                    progress(1)

            bank_arg = self._bank_arg(bank)
            progs = refill.RefillPrograms(
                prefill=functools.partial(self._prefill, self.params, bank_arg),
                take=self._share_rows,
                decode=functools.partial(self._decode, self.params, bank_arg),
                empty=self._empty_state, place=self._place, compact=self._compact,
                constrain=self._constrain_first_token)
            refill.run_refill(progs, self.config, self.backbone.tokenizer, requests, heals, keys,
                              roles=self.role_adapter is not None, on_done=done, profile=profile,
                              stats=self.last_stats)
            return out  # type: ignore[return-value]
        order = sorted(range(len(requests)), key=lambda i: len(requests[i].prompt_ids))
        mb = self.config.max_batch
        for start in range(0, len(order), mb):
            idx = order[start:start + mb]
            batch = self._generate_batch(bank, [requests[i] for i in idx], keys, idx,
                                         [heals[i] for i in idx], profile)
            for i, c in zip(idx, batch):
                out[i] = c
            if on_ready is not None:
                on_ready(list(idx), batch)
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
                    self._healer = TokenHealer(self.backbone.tokenizer, self.cfg.vocab_size)
                n, text, allowed = self._healer.heal(r.prompt_ids, r.heal_tokens)
                if n:
                    h = (text, allowed)
                    r = dataclasses.replace(r, prompt_ids=list(r.prompt_ids)[:-n],
                                            prompt_roles=list(r.prompt_roles)[:-n] if r.prompt_roles else ())
            out.append(dataclasses.replace(r, heal_tokens=0) if r.heal_tokens else r)
            heals.append(h)
        return out, heals

    def _empty_state(self, key, **shapes) -> SamplingState:
        return self._empty(self.params, key, **shapes)

    def _generate_batch(self, bank, reqs: list[Request], keys, idx: list[int], heals=None,
                        profile=None) -> list[Completion]:
        """One micro-batch: requests ``idx`` of the call (``keys``: every request's key);
        ``heals[i]``: (dropped text, allowed first tokens bool[V]) or None."""
        heals = list(heals) if heals is not None else [None] * len(reqs)
        shape = batch_shape(reqs, self.config)
        key = jnp.take(keys, jnp.asarray(idx + idx[:1] * (shape.rows - len(idx))), axis=0)  # padding: any key
        prompts, experts, settings, done = pack_requests(reqs, shape, self.config.max_active,
                                                         roles=self.role_adapter is not None)
        bank_arg = self._bank_arg(bank)
        t0 = time.perf_counter()
        with contextlib.nullcontext() if profile is None else profile.phase("prefill"):
            pre = self._prefill_distinct(bank_arg, reqs, shape, prompts, experts)
            pre.logits.block_until_ready()  # only to split the timing; decode cannot start before anyway
            first_logits = None
            if any(h is not None for h in heals):  # token healing: constrain the first token, once, here
                first_logits, logits = self._constrain_first_token(pre.logits, heals)
                pre = pre.replace(logits=logits)
        t1 = time.perf_counter()
        capture = {} if self.capture_layer is None else dict(hidden_size=self.cfg.hidden_size,
                                                             states_dtype=pre.prefix_states.dtype)
        state = initial_state(key, pre, done, shape.new_tokens, **capture)
        state, stop_at = self._decode_until_done(bank_arg, state, experts, jax.tree.map(jnp.asarray, settings),
                                                 reqs, shape.new_tokens)
        st = self.last_stats
        st["prefill_s"] += t1 - t0
        st["decode_s"] += time.perf_counter() - t1
        st["decode_steps"] += int(state.step)
        st["batches"] += 1
        prompt_states = gen_states = None
        if self.capture_layer is not None:  # row-sharded over the mesh: every process needs every row
            prompt_states, gen_states = process_allgather((pre.prefix_states, state.states))
        return completions(reqs, self.backbone.tokenizer, tokens=np.asarray(state.tokens),
                           logps=np.asarray(state.logps), n_gen=np.asarray(state.n_gen), reason=np.asarray(state.reason), stop_at=stop_at,
                           heals=heals, first_logits=first_logits, prompt_end=shape.prompt_end,
                           prompt_states=prompt_states, gen_states=gen_states)

    def _prefill_distinct(self, bank_arg, reqs: list[Request], shape, prompts, experts):
        """The micro-batch's prefill, each distinct request once (``shared_prefill``): when the
        distinct requests fit a smaller batch bucket, prefill those and copy the rows."""
        groups = prefill_groups(reqs)
        distinct_rows = bucket(len(set(groups)), self.config.batch_buckets, "batch")
        if self.mesh is not None or not self.config.share_prefill or distinct_rows >= shape.rows:
            return self._prefill(self.params, bank_arg, prompts, experts, np.int32(shape.prefill_chunks),
                                 cache_len=shape.cache_len, chunk=shape.chunk)
        distinct, index = row_index(groups, shape.rows)
        # same prompt bucket, chunk and end slot as the whole micro-batch: the copied cache rows
        # must sit where the decode expects them
        d_prompts, d_experts, _, _ = pack_requests([reqs[i] for i in distinct],
                                                   dataclasses.replace(shape, rows=distinct_rows),
                                                   self.config.max_active, roles=self.role_adapter is not None)
        pre = self._prefill(self.params, bank_arg, d_prompts, d_experts, np.int32(shape.prefill_chunks),
                            cache_len=shape.cache_len, chunk=shape.chunk)
        return self._share_rows(pre, jnp.asarray(index))

    def _bank_arg(self, bank):
        """What the jitted functions get as ``bank``: the expert bank, the role adapter's
        parameters, or None (no adapter: a stray value must not become a compile key)."""
        return bank if self.spec is not None or self.role_adapter is not None else None

    def _constrain_first_token(self, logits: jax.Array, heals) -> tuple[np.ndarray, jax.Array]:
        """(the unconstrained logits on the host float32[B, V], the logits with each healed row
        restricted to its allowed first tokens)."""
        if self.mesh is None:
            full = np.asarray(logits)
        else:  # row-sharded over a mesh: gather them
            full = np.asarray(process_allgather(logits))
        mask = first_token_mask(heals, full.shape)
        allowed = mask
        if self.mesh is not None:  # laid out like the logits (every process holds every row's mask)
            allowed = jax.make_array_from_callback(mask.shape, logits.sharding, lambda idx: mask[idx])
        return full, _restrict(logits, allowed)

    def _decode_until_done(self, bank, state: SamplingState, experts: ExpertSlots, settings: DecodeSettings,
                           reqs: Sequence[Request], N: int) -> tuple[SamplingState, np.ndarray]:
        """Run the decode loop in chunks until N steps or every row is done.

        Without stop strings the whole budget is one device call; with them, the host reads the
        tokens every ``config.chunk`` steps and marks rows whose text hit a stop string done.
        Returns the final state and stop_at int[B] (-1, or the token count where a stop string
        completed).
        """
        has_strings = any(r.stop_strings for r in reqs)
        tok = self.backbone.tokenizer
        stop_at = np.full(state.done.shape[0], -1)
        step = 0
        while step < N:
            step = min(step + (self.config.chunk if has_strings else N), N)
            state = self._decode(self.params, bank, state, experts, settings, jnp.int32(step))
            done = np.asarray(state.done)
            if has_strings and tok is not None:
                newly = mark_stop_strings(tok, reqs, np.asarray(state.tokens), np.asarray(state.n_gen), stop_at)
                if newly:
                    done = done.copy()
                    done[newly] = True
                    state = state.replace(done=jnp.asarray(done))
            if done.all():
                break
        return state, stop_at


@jax.jit
def _fold_seeds(key: jax.Array, seeds: jax.Array) -> jax.Array:
    return jax.vmap(jax.random.fold_in, in_axes=(None, 0))(key, seeds)


def request_keys(key: jax.Array, requests: Sequence[Request]) -> jax.Array:
    """Each request's PRNG key: ``fold_in(key, seed)`` (``Request.seed``, else its index);
    [n] typed keys or uint32[n, 2], as ``key``. Seeds are padded to a power of two (few compiles)."""
    seeds = [r.seed if r.seed is not None else i for i, r in enumerate(requests)]
    n = 1 << (len(seeds) - 1).bit_length()
    return _fold_seeds(key, jnp.asarray(seeds + [0] * (n - len(seeds)), jnp.uint32))[:len(seeds)]


@functools.lru_cache(maxsize=4)
def _cached_sampler(backbone: Backbone, spec: ExpertBankSpec | None, config: SamplerConfig) -> Sampler:
    return Sampler(backbone, spec, config)


def generate(backbone: Backbone, experts: tuple[dict, ExpertBankSpec] | None, requests: Sequence[Request], *,
             key: jax.Array, config: SamplerConfig = DEFAULT_SAMPLER_CONFIG) -> list[Completion]:
    """Functional entry point: ``experts`` is (bank, spec) or None. Reuses a cached Sampler."""
    bank, spec = experts if experts is not None else (None, None)
    return _cached_sampler(backbone, spec, config).generate(bank, requests, key=key)
