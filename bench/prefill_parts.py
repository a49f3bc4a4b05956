"""Where the sampler's prefill time goes: the whole prefill against its projection GEMMs alone.

The sampler's own prefill (``Sampler.generate`` with one new token; ``last_stats["prefill_s"]``) on
bench/sampler.py's inputs (SmolLM2-135M float32, ~200-token prompts, per-row expert sets), and the
prefill's projection GEMMs alone: q/k/v, o, gate/up and down of every layer at the same token-row
count and chunking, chained in one jit (XLA), and the same GEMMs in torch (the peer's GEMM library).
Interleaved, best of ``--reps``. The GEMM share says what a faster GEMM could give; the rest is
attention, norms, rotary, LoRA and cache writes.

Usage:  python bench/prefill_parts.py [--batches 1,16] [--prefill-rows 512,2048] [--reps 2]

Measured 2026-12-04 (AVX-512 host, load ~9 from other jobs): README, Performance.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import warnings
from pathlib import Path


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--prefill-rows", default="512")
    ap.add_argument("--prompt", type=int, default=200)
    ap.add_argument("--reps", type=int, default=2)
    args = ap.parse_args(argv)
    warnings.simplefilter("ignore")
    import jax
    import jax.numpy as jnp
    import numpy as np
    import torch

    from morse_jax.models import embedded_model_path, load_backbone
    from morse_jax.mole.experts import ExpertBankSpec, execute_set, init_expert_bank
    from morse_jax.sampling.requests import bucket, prefill_chunk
    from morse_jax.sampling.sampler import Request, Sampler, SamplerConfig

    bb = load_backbone(embedded_model_path())
    cfg = bb.config
    spec = ExpertBankSpec()
    bank = init_expert_bank(jax.random.PRNGKey(0), cfg, spec)
    rng = np.random.default_rng(0)
    bank["b"] = {t: jnp.asarray(0.02 * rng.normal(size=x.shape).astype(np.float32)) for t, x in bank["b"].items()}
    src = "\n".join(p.read_text() for p in sorted((Path(__file__).resolve().parents[1] / "morse_jax").rglob("*.py")))
    corpus = bb.tokenizer(src, add_special_tokens=False)["input_ids"]
    d, f, L = cfg.hidden_size, cfg.intermediate_size, cfg.num_layers
    qd = cfg.num_heads * cfg.head_dim
    qkv = qd + 2 * cfg.num_kv_heads * cfg.head_dim
    P = args.prompt
    print(f"# load {os.getloadavg()[0]:.1f}; d {d}, f {f}, {L} layers", flush=True)

    def requests(B):
        out = []
        for i in range(B):
            sub = [i % 4] if i % 3 == 0 else [i % 4, (i + 1) % 4]
            s = execute_set(spec, sub, role="execute" if i % 2 == 0 else "merge")
            out.append(Request(corpus[997 * i: 997 * i + P], expert_ids=[e for e, _ in s],
                               expert_weights=[w for _, w in s], max_new_tokens=1))
        return out

    def gemms(M):
        """(XLA, torch) callables: the prefill's projections of every layer on M token rows."""
        ws = [jnp.asarray(rng.standard_normal(s) / np.sqrt(s[1]), jnp.float32)
              for s in ((qkv, d), (d, qd), (2 * f, d), (d, f))]

        @jax.jit
        def run(x, ws):
            for _ in range(L):
                a, b = jnp.einsum("md,fd->mf", x, ws[0]), jnp.einsum("md,fd->mf", x, ws[1])
                c = jnp.einsum("md,fd->mf", x, ws[2])
                x = x + 1e-3 * (a[:, :d] + b + jnp.einsum("mf,df->md", c[:, :f], ws[3]))
            return x

        tw = [torch.from_numpy(np.asarray(w)) for w in ws]

        def trun(x):
            with torch.no_grad():
                for _ in range(L):
                    a, b, c = x @ tw[0].T, x @ tw[1].T, x @ tw[2].T
                    x = x + 1e-3 * (a[:, :d] + b + c[:, :f] @ tw[3].T)
            return x

        x = jnp.asarray(rng.standard_normal((M, d)), jnp.float32)
        xt = torch.from_numpy(np.asarray(x))
        return (lambda: run(x, ws).block_until_ready()), (lambda: trun(xt))

    def timed(fn) -> float:
        t = time.perf_counter()
        fn()
        return time.perf_counter() - t

    for B in (int(b) for b in args.batches.split(",")):
        for rows in (int(r) for r in args.prefill_rows.split(",")):
            sampler = Sampler(bb, spec, SamplerConfig(prefill_rows=rows))
            reqs = requests(B)
            key = jax.random.PRNGKey(0)
            sampler.generate(bank, reqs, key=key)  # compile
            chunk = prefill_chunk(rows, B, bucket(P, sampler.config.prompt_buckets, "prompt length"))
            n_chunks = -(-P // chunk)
            xla, peer = gemms(B * chunk)
            xla(), peer()
            pre = xs = ts = float("inf")
            for _ in range(args.reps):  # interleaved: load changes hit all three
                sampler.generate(bank, reqs, key=key)
                pre = min(pre, sampler.last_stats["prefill_s"])
                xs, ts = min(xs, n_chunks * timed(xla)), min(ts, n_chunks * timed(peer))
            flops = 2 * B * chunk * n_chunks * L * d * (qkv + qd + 3 * f)
            print(f"batch {B}, {n_chunks} chunks of {chunk}: prefill {pre:.2f} s; its GEMMs alone: XLA {xs:.2f} s "
                  f"({xs / pre:.0%} of the prefill, {flops / xs / 1e9:.0f} GFLOP/s), torch {ts:.2f} s "
                  f"({flops / ts / 1e9:.0f} GFLOP/s); XLA/torch GEMM time {xs / ts:.2f}x", flush=True)


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    main()
