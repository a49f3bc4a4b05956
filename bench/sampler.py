"""Sampler throughput: morse_jax's jitted sampler vs transformers ``generate`` (+ PEFT LoRA), CPU.

SmolLM2-135M-Instruct (the embedded GGUF, float32), ~200-token prompts (a different window of
the repo's own source per row), 128 new tokens, temperature 0.7, top-p 0.95, no early stop.
Ours: rank-8 experts on q/v/o of the last 8 layers with non-zero B, a different active set per
row (role expert + 1-2 subtask experts). transformers: the same GGUF loaded by transformers,
a PEFT LoRA (r=8, alpha=16, q_proj/v_proj/o_proj, last 8 layers, non-zero B), torch CPU.

The two are measured interleaved (ours, theirs, ours, theirs, ...) in one process, so a shared,
loaded machine slows both alike; ratios use medians. One line per batch size, decode-only
tokens/s (prefill excluded, DESIGN §6's measure; ours from the sampler's own prefill/decode
split, transformers from its N-token generate minus a 1-token generate):

    batch 16: ours 180.2 tok/s, transformers 50.1 tok/s, 3.60x

then a '#' line with end-to-end rates (prefill included), both prefill times, our ms/step and
the compile time (measured separately, never counted above), and a roofline: bytes moved per
decode step / measured memory bandwidth vs FLOPs per step / measured 2048^3 matmul FLOP/s (the
larger bounds the step), with our fraction of it.

Usage:  python bench/sampler.py [--batches 1,4,16] [--reps 3] [--new 128] [--prompt 200]
        [--ours-only] [--sampler-config "dict(decode_path='model')"]
        (``--sampler-config "dict(block_weights='off')"``: float32 weights at 1-4 rows too)
        python bench/sampler.py --refill [--requests 64] [--share 4] [--reps 3]

``--refill``: slot refill (``sampler.refill``) vs static micro-batches, both ours, interleaved,
on a recorded completion-length distribution (``bench/data/completion_lengths.json``: prompt
and generated lengths of every completion of a short learn_cpu run, how it was recorded is in
the file). ``--requests`` requests take those lengths (each request's budget is its recorded
length, so it stops where the recorded one stopped), max_batch 16 slots / rows, drawn in the
recorded groups of ``--share`` candidates that share a prompt and expert set (an HGRPO route's M;
both samplers prefill each distinct prompt once). Prints
generated tokens per second, decode-only (the sampler's decode_s: for refill this includes its
host loop and cache compaction; the refill prefills and their placement count as prefill) and
end to end (prefill included), for both and their ratios:

    refill 32 requests: decode-only refill 120.0 tok/s, static 60.0 tok/s, 2.00x; end to end ...

Measured on this machine (2 shared AMD EPYC cores, AVX-512, 20-25 GB/s from one core and ~30
from both, 170-195 GFLOP/s at 2048^3; run-to-run noise about +-5-10 %, more while others run
jobs):

  bench, interleaved (decode-only tok/s, ours vs transformers), with the native CPU kernels
  (morse_jax/kernels, sampler.cpu_kernels="auto", the default):
                     batch 1            batch 4            batch 16
    2026-12-03, A    39.3 vs 13.5 2.91x 121.2 vs 34.7 3.50x 281.5 vs 76.0 3.70x  (first kernels)
    2026-12-03, B    46.5 vs 12.2 3.80x 107.1 vs 32.7 3.28x 296.0 vs 84.2 3.51x  (sequential W)
    2026-12-03, C    50.3 vs 12.5 4.03x 102.2 vs 27.7 3.69x 300.0 vs 81.1 3.70x  (quiet machine)
    2026-12-07, AVX2 41.8 vs 11.7 3.58x 111.4 vs 25.6 4.35x 230.1 vs 57.1 4.03x  (2-core EPYC without
                     AVX-512, quiet; 12-accumulator broadcast matmul, prefetching attention; before
                     those two changes, same machine: batch 16 176.5 vs 63.5 2.78x)
    2026-12-07, AVX2 44.2 vs 11.7 3.76x 111.9 vs 26.0 4.30x 261.9 vs 66.8 3.92x  (+ native top-k, keys
                     in tiles of 16 slots; 4 runs: batch 1 3.09-3.88x, batch 16 2.33-4.08x, the low
                     ones one run disturbed on our side, README "Performance")
    end-to-end (B)   39.7 vs 11.9 3.34x  76.9 vs 29.9 2.57x 150.1 vs 66.0 2.27x
    end-to-end (C)   42.8 vs 12.0 3.57x  71.3 vs 25.8 2.76x 138.5 vs 62.8 2.20x
  The kernels, A/B with --ours-only (ms/step, batch 1 / batch 16, cache 384):
    XLA only (cpu_kernels="off")                                        25.8-28.0 / 64-75
    native W @ x (projections + LM head): 8 rows of W at a time        25.5-27.4 / 66
    + native decode attention (reads only the filled slots)            23.4-24.2 / 52-60
    + W read one row at a time for 1-4 columns (one sequential stream
      for the prefetcher), prefetch of the next 8-row block above      18.5-20.3 / 49-51
  Profile at batch 16 with them (47 ms/step under the profiler): attention 11.3 ms, gate/up 10.2,
  o + down 7.7, LM head 5.3, qkv 3.4, the rest (LoRA, norms, rotary, cache writes, sampling) ~9.
  Microbenchmarks (30 layers of SmolLM2 matrices + LM head, chained in one jit): batch 1 XLA
  22-24 ms vs native 13.7-16.8 (34-39 GB/s); batch 16 XLA 37-38 vs 24.7-26.1 ms; decode
  attention, 30 layers at batch 16 (264 of 384 slots filled) XLA 14.4-15 vs 10.9-11 ms.

  Before the kernels (XLA only), same bench:
                     batch 1            batch 4            batch 16
    lead's sampler   24.0 vs 5.1*       68.2 vs 30.8       100.0 vs 64.1     (* tests ran alongside)
    now, run A       36.9 vs 11.8 3.13x 98.5 vs 35.0 2.82x 182.3 vs 71.7 2.54x
    now, run B       33.3 vs 11.2 2.98x 86.8 vs 29.4 2.95x 176.4 vs 72.8 2.42x
    end-to-end (B)   28.6 vs 10.8 2.64x 61.4 vs 26.9 2.28x 103.0 vs 59.1 1.74x
    after the attention change (2026-12-03, load 1.3-1.9):
                     40.2 vs 14.0 2.87x 100.0 vs 36.7 2.73x 214.5 vs 82.7 2.59x
    batch 16 alone:                                          225.2 vs 80.8 2.79x
    On a loaded machine (load 4-9) transformers drops far more than we do (per-step Python):
    batch 1 17.0 vs 2.1 tok/s end-to-end (7.9x).

  decode ms/step, same isolated harness (cache 384), batch 1 / 4 / 16:
    lead's sampler, scanned layers (unroll_decode=False)   32.3 / 76.3 / 233.9
    lead's sampler, unrolled layers (its default)          30.1 / 52.1 / 133.2
    now                                                    25-27 / 38-42 / 72-77
  The changes, in order (batch 16, cache 288, ms/step unless noted):
    fused q/k/v and gate/up, [B,K,S,D] caches, LM head pre-transposed      140 -> 136
    attention query rows folded (a degenerate T axis made XLA swap the P.V
      operands into a 1.4 ms/layer transposed-operand dot)                    136 -> 106
    keys stored [B,K,D,S]                                                    106 -> 92
    LoRA factors laid out once per call, all-experts composition
      (24 per-step relayout copies gone)                                      92 -> 85
    one pass for the top-p and log-prob normalisers, greedy from top-k      sampling 9.0 -> 5.1 ms
      (slicing top-k's output made XLA turn top-k into a full sort, 208 ms/step, until an
      optimization barrier stopped it)
    weights [d_out, d_in], activations [features, B] (W @ x: XLA's dot packed
      the weight on every x @ W call)                                         85 -> 74
      + barrier against folding the LM-head transpose into the dot
      (batch 4: 125 -> 38, a naive-loop dot)              batch 1/2/4/8/16: 29/31/38/45/63
    batch and kv heads share one cache axis (at batch 1 XLA copied all 60
      caches every step)                                            batch 1 (cache 384): 28 -> 26
    rotary cos/sin gathered from per-call tables (XLA re-evaluated them per
      element inside every layer)                                           -2 ms at batch 16
  Decode attention as float32 multiply-reduce fusions instead of batched dots (CPU only; the
    dots were [G, D] x [D, S] per (b, k), overhead-bound), A/B interleaved runs: 86.5 -> 81.4,
    80.7 -> 76.8 ms/step at batch 16; batch 1 29.6 -> 27.6, batch 4 41.6 -> 41.0.
  Profile after it (batch 16, cache 384, 71-78 ms/step): o + down dots 19.4 ms, gate/up 17.1,
  scores reduce 13.3, LM head 8.3, qkv 6.2, P.V reduce 2.2, top-k 2.9, the rest ~5.
  No gain (measured, kept out): keys stored [B*K, S, D] with the scores reduced over the minor
  axis (82-93 vs 68-72 ms/step); attending over a smaller cache (256 vs 384 slots: 82.3 vs 81.2
  ms/step, so a filled-blocks-only attention would not pay).
  Earlier final step at batch 16, cache 384 (profiler): weight matmuls 42 ms (gate/up 16-18, o+down
  12-14, LM head 8, qkv 6; ~100 GFLOP/s, what XLA's CPU dot reaches at 16 columns), attention
  22-24 (scores 13-14, P.V 5.5-6, softmax reductions 3-4, cache writes 1.3), sampling ~5
  (top-k 2.6-2.9), the rest ~4. At batch 1 the weight gemvs take 21.7 ms = 538 MB at 25 GB/s,
  i.e. memory bandwidth; the rest is ~4-5 ms of small ops.
  Tried, no gain (kept out): XLA_FLAGS --xla_cpu_experimental_ynn_fusion_type=-reduce,
  --xla_cpu_multi_thread_eigen=false, --xla_cpu_use_onednn=true (all within noise; turning YNN
  off entirely made batch 16 1.9x slower); bfloat16 KV cache (cache_dtype): batch 16 105 vs 78
  ms (per-step conversions); other attention layouts/formulations (K as the streamed operand,
  multiply-reduce instead of dots); two-stage top-k (10x slower than lax.top_k). Not tried:
  bfloat16 weights (would change behaviour log-probs vs the float32 trainer).
  Prefill: prompts run in chunks of ~512/batch tokens in a loop, so work follows the longest
  prompt, not its bucket; 16x200 tokens took 7-8 s (transformers 6.4-7.4 s), which is why
  end-to-end ratios at batch 16 are lower. Since 2026-12-04 a chunk attends only the filled
  prefix and the left padding is skipped in smaller chunks (batch 16: 200 token rows, not 224):
  -14 % prefill CPU time at batch 16 (README, Performance; wall times not yet rerun quietly).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import warnings
from pathlib import Path

import numpy as np

def measure_bandwidth() -> float:
    """Memory read bandwidth in bytes/s: best of numpy sums over a 256 MiB array, one slice per
    core summed in parallel (numpy releases the GIL; one core alone reads ~25 % slower here)."""
    from concurrent.futures import ThreadPoolExecutor

    a = np.ones(64 * 2 ** 20, np.float32)
    n = max(1, os.cpu_count() or 1)
    parts = np.array_split(a, n)
    with ThreadPoolExecutor(n) as pool:
        best = min(_timed(lambda: list(pool.map(np.sum, parts))) for _ in range(7))
    return a.nbytes / best


def measure_matmul(batch: int, d: int, f: int, native: bool = False) -> float:
    """FLOP/s of a jitted [batch, d] x [d, f] float32 matmul (best of 20); ``native``: the
    sampler's CPU kernel on the decode layout, [f, d] x [d, batch]."""
    import jax
    import jax.numpy as jnp

    x = jnp.asarray(np.random.default_rng(0).normal(size=(batch, d)).astype(np.float32))
    w = jnp.asarray(np.random.default_rng(1).normal(size=(d, f)).astype(np.float32))
    mm = jax.jit(lambda a, b: a @ b)
    if native:
        from morse_jax.kernels import ensure_registered, matmul_cols

        ensure_registered()
        x, w = w.T.copy(), x.T.copy()
        mm = jax.jit(matmul_cols)
    mm(x, w).block_until_ready()
    best = min(_timed(lambda: mm(x, w).block_until_ready()) for _ in range(20))
    return 2 * batch * d * f / best


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def step_cost(cfg, batch: int, cache_len: int, spec, blocks: bool = False) -> tuple[float, float]:
    """(bytes, FLOPs) of one decode step: every weight read once (tied LM head included), the
    first ``cache_len`` slots of the KV cache read, LoRA factors of the active experts; 2 FLOPs
    per MAC. ``blocks``: the step reads the GGUF's blocks (``sampler.block_weights``): Q4_1
    projections at 0.75 bytes a weight (16 bytes of nibbles + float32 scale and min per 32), the
    Q8_0 embedding at 1.125 (32 bytes + a float32 scale per 32)."""
    d, f, L = cfg.hidden_size, cfg.intermediate_size, cfg.num_layers
    qd, kvd = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    per_layer = d * qd + 2 * d * kvd + qd * d + 3 * d * f
    matmul_params = L * per_layer + cfg.vocab_size * d
    kv = 2 * L * batch * cache_len * kvd
    lora_per_expert = spec.n_adapt * spec.rank * sum(a + b for a, b in ((d, qd), (d, kvd), (qd, d)))
    weight_bytes = (0.75 * L * per_layer + 1.125 * cfg.vocab_size * d) if blocks else 4 * matmul_params
    bytes_ = weight_bytes + 4 * (kv + 3 * lora_per_expert)
    attn_flops = 2 * 2 * L * batch * cache_len * qd
    flops = 2 * batch * matmul_params + attn_flops + 2 * batch * 3 * lora_per_expert
    return bytes_, flops


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog="See the module docstring for results.")
    ap.add_argument("--batches", default="1,4,16")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--prompt", type=int, default=200)
    ap.add_argument("--ours-only", action="store_true")
    ap.add_argument("--sampler-config", default="dict()", help="SamplerConfig overrides, a Python dict literal")
    ap.add_argument("--refill", action="store_true", help="slot refill vs static batching on recorded lengths")
    ap.add_argument("--requests", type=int, default=64, help="with --refill: requests per generate call")
    ap.add_argument("--share", type=int, default=4,
                    help="with --refill: candidates per prompt and expert set (the recorded run's M = 4; 1: every "
                         "request its own prompt)")
    args = ap.parse_args(argv)
    if args.refill:
        return bench_refill(args)
    warnings.simplefilter("ignore")
    import jax
    import jax.numpy as jnp

    from morse_jax.models import embedded_model_path, load_backbone
    from morse_jax.mole.experts import ExpertBankSpec, execute_set, init_expert_bank
    from morse_jax.run import allocator
    from morse_jax.sampling.sampler import Request, Sampler, SamplerConfig

    batches = [int(b) for b in args.batches.split(",")]
    print(f"# load {os.getloadavg()[0]:.1f}, jax {jax.__version__}, XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}, "
          f"malloc {allocator.current()}",
          flush=True)
    bw = measure_bandwidth()
    peak = measure_matmul(2048, 2048, 2048)
    mm16 = measure_matmul(16, 576, 1536)
    print(f"# memory bandwidth {bw / 1e9:.1f} GB/s; matmul {peak / 1e9:.0f} GFLOP/s (2048^3), "
          f"{mm16 / 1e9:.0f} GFLOP/s ([16,576]x[576,1536])", flush=True)

    path = embedded_model_path()
    t = time.perf_counter()
    bb = load_backbone(path)
    print(f"# ours: loaded in {time.perf_counter() - t:.1f} s", flush=True)
    spec = ExpertBankSpec()  # 2 roles + 4 subtask experts, rank 8, alpha 16, q/v/o, last 8 layers
    bank = init_expert_bank(jax.random.PRNGKey(0), bb.config, spec)
    rng = np.random.default_rng(0)
    bank["b"] = {t: jnp.asarray(0.02 * rng.normal(size=x.shape).astype(np.float32)) for t, x in bank["b"].items()}
    sconf = SamplerConfig(**eval(args.sampler_config))  # noqa: S307 - a developer's command line
    sampler = Sampler(bb, spec, sconf)
    native = f"; native kernel {measure_matmul(16, 576, 1536, native=True) / 1e9:.0f} GFLOP/s at [16,576]x[576,1536]"
    print(f"# ours: native CPU kernels {sampler.native_kernels}"
          f"{native if sampler.native_kernels == 'on' else ''}; block weights (1-4 rows) "
          f"{'on' if sampler.block_weights else 'off'}", flush=True)
    tok = bb.tokenizer
    src = "\n".join(p.read_text() for p in sorted((Path(__file__).resolve().parents[1] / "morse_jax").rglob("*.py")))
    corpus = tok(src, add_special_tokens=False)["input_ids"]
    P, N = args.prompt, args.new

    def prompts(B):
        return [corpus[997 * i: 997 * i + P] for i in range(B)]

    def our_requests(B):
        out = []
        for i, p in enumerate(prompts(B)):
            sub = [i % 4] if i % 3 == 0 else [i % 4, (i + 1) % 4]
            s = execute_set(spec, sub, role="execute" if i % 2 == 0 else "merge")
            out.append(Request(p, expert_ids=[e for e, _ in s], expert_weights=[w for _, w in s], max_new_tokens=N,
                               temperature=0.7, top_p=0.95))
        return out

    def run_ours(B, key):
        t = time.perf_counter()
        out = sampler.generate(bank, our_requests(B), key=jax.random.PRNGKey(key))
        el = time.perf_counter() - t
        assert all(len(c.token_ids) == N for c in out)
        return el, dict(sampler.last_stats)

    theirs = None
    if not args.ours_only:
        theirs = TorchPeer(path, P, N)
        print(f"# transformers: loaded in {theirs.load_s:.1f} s, torch threads {theirs.threads}", flush=True)

    results = {}
    med = statistics.median
    for B in batches:
        t = time.perf_counter()
        run_ours(B, 0)
        first = time.perf_counter() - t
        ours, ours_dec, ours_pre, th, th_pre = [], [], [], [], []
        for r in range(args.reps):  # interleaved, so load changes hit both
            el, st = run_ours(B, r + 1)
            ours.append(el)
            ours_dec.append(st["decode_s"] / st["decode_steps"])
            ours_pre.append(st["prefill_s"])
            if theirs is not None:
                th.append(theirs.generate(prompts(B), N))
                th_pre.append(theirs.generate(prompts(B), 1))
        compile_s = first - med(ours)
        results[B] = ours_dec
        dec = med(ours_dec)  # s per step, one token per row
        line = f"batch {B}: ours {B / dec:.1f} tok/s"
        e2e = f"#   end-to-end (prefill included): ours {B * N / med(ours):.1f} tok/s"
        if th:
            # transformers: N tokens minus a 1-token generate (prefill + first token) = N - 1 decode steps
            th_dec = max(med(th) - med(th_pre), 1e-9) / (N - 1)
            line += f", transformers {B / th_dec:.1f} tok/s, {th_dec / dec:.2f}x"
            e2e += f", transformers {B * N / med(th):.1f} tok/s, {med(th) / med(ours):.2f}x"
        print(line, flush=True)
        e2e += f"; prefill ours {med(ours_pre):.2f} s"
        if th:
            e2e += f", transformers {med(th_pre):.2f} s"
        e2e += f"; ours {1e3 * dec:.1f} ms/step; compile {compile_s:.1f} s; load {os.getloadavg()[0]:.1f}"
        print(e2e, flush=True)

    # The least a step must read is the filled part of the cache (prompt + new/2 tokens on
    # average); XLA's attention reads the whole bucket, the native kernel only the filled slots.
    print("# roofline (decode step; KV read: the filled cache, prompt + new/2 tokens on average):")
    for B in batches:
        nbytes, flops = step_cost(bb.config, B, P + N // 2, spec, blocks=sampler.block_weights and B <= 4)
        t_roof = max(nbytes / bw, flops / peak)
        dec = statistics.median(results[B])
        print(f"#   batch {B}: {nbytes / 1e6:.0f} MB, {flops / 1e9:.2f} GFLOP per step -> roofline "
              f"{1e3 * t_roof:.1f} ms/step ({B / t_roof:.0f} tok/s); ours {1e3 * dec:.1f} ms/step = "
              f"{t_roof / dec:.0%} of roofline", flush=True)


LENGTHS = Path(__file__).resolve().parent / "data" / "completion_lengths.json"


def bench_refill(args) -> None:
    """Slot refill vs static micro-batches (both ours), interleaved, on recorded lengths."""
    import json

    import jax

    from morse_jax.models import embedded_model_path, load_backbone
    from morse_jax.mole.experts import ExpertBankSpec, execute_set, init_expert_bank
    from morse_jax.sampling.sampler import Request, Sampler, SamplerConfig

    rec = json.loads(LENGTHS.read_text())
    pairs = list(zip(rec["prompt"], rec["generated"]))
    M = args.share
    if M < 1 or len(pairs) % M or args.requests % M:
        raise SystemExit(f"--share {M} must divide --requests {args.requests} and the {len(pairs)} recorded completions")
    # the recorded completions come in groups of M candidates of one (node, route): one prompt
    # under one expert set; draw whole groups so the requests share prompts as in training
    rng = np.random.default_rng(0)
    n_groups = len(pairs) // M
    groups = rng.choice(n_groups, size=args.requests // M, replace=n_groups < args.requests // M)
    pick = [pairs[g * M + m] for g in groups for m in range(M)]
    if any(len({pairs[g * M + m][0] for m in range(M)}) > 1 for g in groups):
        raise SystemExit(f"the recorded completions do not come in groups of {M} sharing a prompt")
    gen = [g for _, g in pick]
    print(f"# load {os.getloadavg()[0]:.1f}; {args.requests} requests from {LENGTHS.name} ({len(pairs)} recorded): "
          f"generated mean {np.mean(gen):.1f}, median {np.median(gen):.0f}, max {max(gen)}; prompt mean "
          f"{np.mean([p for p, _ in pick]):.0f}", flush=True)
    bb = load_backbone(embedded_model_path())
    spec = ExpertBankSpec()
    bank = init_expert_bank(jax.random.PRNGKey(0), bb.config, spec)
    overrides = eval(args.sampler_config)  # noqa: S307 - a developer's command line
    samplers = {name: Sampler(bb, spec, SamplerConfig(max_batch=16, refill=name == "refill", **overrides))
                for name in ("refill", "static")}
    tok = bb.tokenizer
    src = "\n".join(p.read_text() for p in sorted((Path(__file__).resolve().parents[1] / "morse_jax").rglob("*.py")))
    corpus = tok(src, add_special_tokens=False)["input_ids"]
    requests = []
    for i, (p, g) in enumerate(pick):
        s = execute_set(spec, [(i // M) % 4], role="execute")
        # no stop token: each request runs exactly its recorded length (its budget)
        requests.append(Request(corpus[997 * (i // M): 997 * (i // M) + p], expert_ids=[e for e, _ in s],
                                expert_weights=[w for _, w in s], max_new_tokens=max(1, g), temperature=0.8,
                                top_p=0.95, seed=i))
    total = sum(max(1, g) for g in gen)
    times = {name: [] for name in samplers}
    for rep in range(args.reps + 1):  # rep 0 compiles
        for name, smp in samplers.items():
            t = time.perf_counter()
            out = smp.generate(bank, requests, key=jax.random.PRNGKey(rep))
            el = time.perf_counter() - t
            assert sum(len(c.token_ids) for c in out) == total
            st = smp.last_stats
            print(f"#   {name}{'' if rep else ' (compiles)'}: {el:.1f} s (prefill {st['prefill_s']:.1f} s, decode "
                  f"{st['decode_s']:.1f} s, {st['decode_steps']} steps"
                  + (f", {st['prefilled_requests']} prompts prefilled in {st['prefill_calls']} calls"
                     if "prefill_calls" in st else "") + f"), load {os.getloadavg()[0]:.1f}", flush=True)
            if rep:
                times[name].append((el, st["decode_s"]))
    med = {name: [statistics.median(x) for x in zip(*t)] for name, t in times.items()}
    (e2e_r, dec_r), (e2e_s, dec_s) = med["refill"], med["static"]
    print(f"refill {args.requests} requests: decode-only refill {total / dec_r:.1f} tok/s, static "
          f"{total / dec_s:.1f} tok/s, {dec_s / dec_r:.2f}x; end to end (prefill included) "
          f"{total / e2e_r:.1f} vs {total / e2e_s:.1f} tok/s, {e2e_s / e2e_r:.2f}x", flush=True)


class TorchPeer:
    """transformers' generate on the same GGUF with a PEFT LoRA attached (float32, CPU)."""

    def __init__(self, path: Path, prompt_len: int, new: int):
        import torch
        from peft import LoraConfig, get_peft_model
        from transformers import AutoModelForCausalLM

        t = time.perf_counter()
        model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
        n_layers = model.config.num_hidden_layers
        cfg = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "o_proj"],
                         layers_to_transform=list(range(n_layers - 8, n_layers)), lora_dropout=0.0)
        model = get_peft_model(model, cfg).eval()
        gen = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name:  # PEFT initialises B = 0: make the adapter do real work
                    p.copy_(0.02 * torch.randn(p.shape, generator=gen))
        self.model, self.torch = model, torch
        self.load_s = time.perf_counter() - t
        self.threads = torch.get_num_threads()

    def generate(self, prompts, new: int) -> float:
        torch = self.torch
        ids = torch.tensor(prompts, dtype=torch.long)
        torch.manual_seed(0)
        t = time.perf_counter()
        with torch.no_grad():
            out = self.model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=True,
                                      temperature=0.7, top_p=0.95, top_k=0, max_new_tokens=new,
                                      min_new_tokens=new, pad_token_id=0)
        el = time.perf_counter() - t
        assert out.shape[1] - ids.shape[1] == new
        return el


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from morse_jax.run.allocator import reexec_with_allocator

    reexec_with_allocator()  # both sides (one process) under one malloc: MORSE_JAX_MALLOC
    main()
