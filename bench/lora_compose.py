"""Benchmark: ways of applying per-row LoRA expert sets in one batch.

Compares, on SmolLM2-135M shapes (random weights by default, or the embedded GGUF with --gguf):

* gather  — ``ExpertBankSpec(compose="gather")``: each row's experts gathered, two small einsums;
* onehot  — ``compose="onehot"``: every expert applied to every row, weights scattered;
* merged  — W + sum_k w_k (alpha/r) A_k B_k materialised per row in the adapted layers and the
  forward vmapped over rows (what DESIGN §2 rules out; the baseline that motivates it);
* base    — no LoRA (the floor).

Two workloads: a prefill of ``--prompt-len`` tokens (no KV cache, last-position logits) and one
decode step of 1 token against a KV cache of ``--prompt-len`` entries (the sampler's layout:
unrolled layers, cache donated). Prints median (and min) ms per call and ratios to gather.

    python bench/lora_compose.py                      # batch 16, prompt 200, 6 experts, 3 active
    python bench/lora_compose.py --dtype bfloat16     # on a GPU
    python bench/lora_compose.py --gguf --skip-prefill
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from morse_jax.models import ModelConfig, RopeSpec, forward, init_cache, init_params, split_segments, unstack_segments
from morse_jax.mole.experts import ExpertBankSpec, execute_set, gather_lora, init_expert_bank, merge_set, pad_active

# SmolLM2-135M(-Instruct): llama family, 30 layers, d=576, 9 heads x 64, 3 kv heads, tied embeddings.
SMOLLM2_135M = ModelConfig(
    family="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9,
    num_kv_heads=3, head_dim=64, rms_norm_eps=1e-5, tie_embeddings=True, rope_full=RopeSpec(theta=100_000.0),
    max_position_embeddings=8192)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=200)
    p.add_argument("--iters", type=int, default=5, help="timed calls per mode (median reported)")
    p.add_argument("--prefill-iters", type=int, default=None, help="timed prefill calls (default: --iters)")
    p.add_argument("--warmup", type=int, default=1, help="untimed calls after the compile")
    p.add_argument("--n-adapt", type=int, default=8)
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--num-subtask", type=int, default=4)
    p.add_argument("--max-active", type=int, default=3)
    p.add_argument("--targets", default="q,v,o")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--modes", default="gather,onehot,merged,base")
    p.add_argument("--skip-prefill", action="store_true")
    p.add_argument("--skip-decode", action="store_true")
    p.add_argument("--gguf", action="store_true", help="load the embedded SmolLM2 GGUF instead of random weights")
    return p.parse_args(argv)


# --------------------------------------------------------------------------- the four ways


def _row_deltas(bank, spec, ids, weights):
    """Per-row merged deltas: {target: [B, L_adapt, d_in, d_out]}."""
    w = weights.astype(jnp.float32) * spec.scaling
    return {t: jnp.einsum("bk,bkldr,bklro->bldo", w, bank["a"][t][ids], bank["b"][t][ids])
            for t in spec.targets}


def _add_delta(params, delta):
    """params with one row's delta ({target: [L_adapt, d_in, d_out]}) added to the last segment."""
    last = params["layers"][-1]
    if isinstance(last, dict):  # stacked
        new = {**last, **{t: {**last[t], "kernel": last[t]["kernel"] + d.astype(last[t]["kernel"].dtype)}
                          for t, d in delta.items()}}
    else:  # unrolled: tuple of per-layer dicts
        new = tuple({**lp, **{t: {**lp[t], "kernel": lp[t]["kernel"] + d[i].astype(lp[t]["kernel"].dtype)}
                              for t, d in delta.items()}} for i, lp in enumerate(last))
    return {**params, "layers": (*params["layers"][:-1], new)}


def make_prefill(cfg, spec, mode):
    def fn(params, bank, ids, weights, tokens):
        if mode == "base":
            return forward(params, cfg, tokens, logits_mode="last")[0]
        if mode == "merged":
            delta = _row_deltas(bank, spec, ids, weights)

            def one(d, tok):
                return forward(_add_delta(params, d), cfg, tok[None], logits_mode="last")[0][0]

            return jax.vmap(one)(delta, tokens)
        s = dataclasses.replace(spec, compose=mode)
        return forward(params, cfg, tokens, lora=gather_lora(bank, s, ids, weights), logits_mode="last")[0]

    return jax.jit(fn)


def make_decode(cfg, spec, mode):
    def fn(params, bank, ids, weights, tok, cache):
        if mode == "merged":
            delta = _row_deltas(bank, spec, ids, weights)

            def one(d, t, layers, valid):
                c = {"layers": jax.tree.map(lambda x: x[None], layers), "valid": valid[None], "index": cache["index"]}
                logits, nc = forward(_add_delta(params, d), cfg, t[None, None], cache=c, logits_mode="last")
                return logits[0], jax.tree.map(lambda x: x[0], nc["layers"]), nc["valid"][0]

            logits, layers, valid = jax.vmap(one)(delta, tok, cache["layers"], cache["valid"])
            return logits, {"layers": layers, "valid": valid, "index": cache["index"] + 1}
        lora = None
        if mode != "base":
            lora = gather_lora(bank, dataclasses.replace(spec, compose=mode), ids, weights)
        return forward(params, cfg, tok[:, None], cache=cache, lora=lora, logits_mode="last")

    return jax.jit(fn, donate_argnums=(5,))


# --------------------------------------------------------------------------- timing


def _time_modes(calls, iters, warmup):
    """Median and min ms per call for each mode, and each mode's first output.

    Modes are timed round-robin (one call of each per round) so that load from other processes
    falls on all of them alike; on a shared machine compare the min as well as the median.
    """
    outs, times = {}, {m: [] for m in calls}
    for mode, call in calls.items():
        outs[mode] = np.asarray(jax.block_until_ready(call()))  # includes the compile
        for _ in range(warmup):
            jax.block_until_ready(call())
    for _ in range(iters):
        for mode, call in calls.items():
            t0 = time.perf_counter()
            jax.block_until_ready(call())
            times[mode].append((time.perf_counter() - t0) * 1e3)
    return {m: statistics.median(t) for m, t in times.items()}, {m: min(t) for m, t in times.items()}, outs


def _check(label, outs):
    """The LoRA modes must agree (they compute the same function); base must differ from them."""
    if "gather" not in outs:
        return
    ref = outs["gather"].astype(np.float64)
    scale = np.max(np.abs(ref))
    diffs = {m: float(np.max(np.abs(o.astype(np.float64) - ref)) / scale) for m, o in outs.items() if m != "gather"}
    print(f"  {label} max |logits - gather| / max|gather|: " + ", ".join(f"{m} {d:.1e}" for m, d in diffs.items()))


def _report(label, ms, ms_min):
    ref = ms.get("gather")
    parts = []
    for mode, v in ms.items():
        ratio = f" ({v / ref:.2f}x)" if ref and mode != "gather" else ""
        parts.append(f"{mode} {v:.1f} ms{ratio}")
    print(f"{label}: " + ", ".join(parts), flush=True)
    print("  min: " + ", ".join(f"{m} {v:.1f} ms" for m, v in ms_min.items()), flush=True)
    if "base" in ms:
        print("  median over base: " + ", ".join(f"{m} {(v / ms['base'] - 1) * 100:+.0f}%" for m, v in ms.items()
                                              if m != "base"), flush=True)


def _decode_call(fn, params, bank, ids, weights, tok, cache):
    """A call that feeds the donated cache back in (each call writes the next slot)."""
    state = {"cache": cache}

    def call():
        logits, state["cache"] = fn(params, bank, ids, weights, tok, state["cache"])
        return logits

    return call


def main(argv=None):
    args = parse_args(argv)
    dtype = jnp.dtype(args.dtype)
    modes = [m for m in args.modes.split(",") if m]
    if args.gguf:
        from morse_jax.models import embedded_model_path, load_backbone

        backbone = load_backbone(embedded_model_path(), dtype=dtype, tokenizer=False)
        cfg, params = backbone.config, backbone.params
    else:
        cfg = SMOLLM2_135M
        params = jax.jit(init_params, static_argnums=(1, 2))(jax.random.PRNGKey(0), cfg, dtype)
    spec = ExpertBankSpec(num_subtask=args.num_subtask, rank=args.rank, alpha=2.0 * args.rank,
                          n_adapt=args.n_adapt, targets=tuple(args.targets.split(",")))
    params = split_segments(params, spec.n_adapt)

    bank = jax.jit(init_expert_bank, static_argnums=(1, 2))(jax.random.PRNGKey(1), cfg, spec)
    keys = jax.random.split(jax.random.PRNGKey(2), len(spec.targets))
    bank["b"] = {t: 0.01 * jax.random.normal(k, bank["b"][t].shape) for k, t in zip(keys, spec.targets)}

    # A realistic mix: execute rows with 2 routed experts, merge rows, a few single-expert rows.
    rng = np.random.default_rng(0)
    rows = []
    for i in range(args.batch):
        pick = sorted(rng.choice(spec.num_subtask, size=min(2, spec.num_subtask), replace=False).tolist())
        row = merge_set(spec, [pick[:1], pick[1:]]) if i % 4 == 3 else execute_set(spec, pick)
        rows.append(row[:args.max_active])
    ids, weights = map(jnp.asarray, pad_active(rows, args.max_active, num_experts=spec.num_experts))
    tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (args.batch, args.prompt_len)), jnp.int32)

    print(f"backend {jax.default_backend()} ({jax.devices()[0].device_kind}), dtype {args.dtype}, "
          f"{'GGUF' if args.gguf else 'random'} SmolLM2-135M shapes: {cfg.num_layers} layers, d={cfg.hidden_size}, "
          f"LoRA on {','.join(spec.targets)} of the last {spec.n_adapt}, rank {spec.rank}, "
          f"{spec.num_experts} experts, max_active {args.max_active}; batch {args.batch}, prompt {args.prompt_len}",
          flush=True)

    if not args.skip_prefill:
        fns = {mode: make_prefill(cfg, spec, mode) for mode in modes}
        calls = {mode: (lambda fn=fn: fn(params, bank, ids, weights, tokens)) for mode, fn in fns.items()}
        ms, ms_min, outs = _time_modes(calls, args.prefill_iters or args.iters, args.warmup)
        _report(f"prefill ({args.prompt_len} tok)", ms, ms_min)
        _check("prefill", outs)

    if not args.skip_decode:
        dec_params = unstack_segments(params)  # the sampler's decode layout
        cache_len = args.prompt_len + 2 + args.warmup + args.iters
        tok = tokens[:, -1]
        calls = {}
        for mode in modes:
            cache = init_cache(cfg, dec_params, args.batch, cache_len, dtype)
            # A cache as after a prefill of prompt_len tokens (contents do not affect the timing).
            cache = {**cache, "valid": cache["valid"].at[:, :args.prompt_len].set(True),
                     "index": jnp.asarray(args.prompt_len, jnp.int32)}
            calls[mode] = _decode_call(make_decode(cfg, spec, mode), dec_params, bank, ids, weights, tok, cache)
        ms, ms_min, outs = _time_modes(calls, args.iters, args.warmup)
        _report("decode step", ms, ms_min)
        _check("decode", outs)


if __name__ == "__main__":
    main()
