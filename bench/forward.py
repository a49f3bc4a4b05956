"""Backbone forward benchmark: morse_jax vs transformers (torch), same process, same model, same inputs.

    python bench/forward.py                      # SmolLM2-135M GGUF, batch 1 and 16, ~2 minutes on 2 cores
    python bench/forward.py --batch 1 4 16 --prompt-len 192 --decode-steps 64
    python bench/forward.py --model /ckpt/Qwen3-4B --dtype bfloat16

Measures, per batch size:
  * prefill: a [B, P] prompt into an empty KV cache, LM-head logits for the last position only
    (ours: ``logits_mode="last"``; transformers: ``logits_to_keep=1``); reported as prompt tokens/s;
  * decode step: one greedy token for every row through the KV cache (cache already holding the
    prompt); reported as milliseconds per step and generated tokens/s.
Ours runs jitted (prefill over the scanned layer stack, decode over unrolled layers with per-layer
caches donated and updated in place, as the sampler does); compile time is reported separately and
excluded from the timings. Ratios are ours / transformers: above 1 is better for tokens/s, below 1
is better for step time. Not a test: nothing is asserted.
"""

from __future__ import annotations

import os

# torch's OpenMP threads spin-wait between ops; on a small shared machine (or next to XLA's own
# thread pool in this process) that made transformers 5-7x slower here. Passive waiting is what a
# fair peer gets; set OMP_WAIT_POLICY yourself to override. Must precede the torch import.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse
import inspect
import statistics
import sys
import time
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from morse_jax.models import forward, init_cache, load_backbone, unstack_segments  # noqa: E402
from morse_jax.models.loading import embedded_model_path  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="HF directory or .gguf file (default: the embedded SmolLM2 GGUF)")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--decode-steps", type=int, default=32, help="timed decode steps per batch size")
    p.add_argument("--repeats", type=int, default=3, help="timed prefill repeats (median reported)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--decode-layout", default="unrolled", choices=["unrolled", "scan"],
                   help="layer layout of our decode step (unrolled = what the sampler uses)")
    p.add_argument("--no-torch", action="store_true", help="skip the transformers side")
    args = p.parse_args(argv)
    for name in ("prompt_len", "decode_steps", "repeats"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if min(args.batch) < 1:
        p.error("--batch values must be >= 1")
    return args


def timed(fn):
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


# --------------------------------------------------------------------------- ours


class Ours:
    def __init__(self, backbone, max_len: int, decode_layout: str):
        self.cfg = backbone.config
        self.params = backbone.params
        self.decode_params = unstack_segments(self.params) if decode_layout == "unrolled" else self.params
        self.max_len = max_len
        cfg = self.cfg

        def prefill(params, tokens):
            cache = init_cache(cfg, params, tokens.shape[0], max_len, params["embed"].dtype)
            logits, cache = forward(params, cfg, tokens, cache=cache, logits_mode="last")
            return jnp.argmax(logits, -1).astype(jnp.int32), self._decode_cache(cache)

        def step(decode_params, tok, cache):
            logits, cache = forward(decode_params, cfg, tok[:, None], cache=cache, logits_mode="last")
            return jnp.argmax(logits, -1).astype(jnp.int32), cache

        self._prefill = jax.jit(prefill)
        self._step = jax.jit(step, donate_argnums=2)
        self.compiled = {}

    def _decode_cache(self, cache):
        """Prefill runs over the scanned layer stack; the unrolled decode step wants per-layer buffers."""
        segs = []
        for seg_cache, seg in zip(cache["layers"], self.decode_params["layers"]):
            if isinstance(seg, tuple):
                seg_cache = tuple({k: seg_cache[k][i] for k in ("k", "v")} for i in range(len(seg)))
            segs.append(seg_cache)
        return {**cache, "layers": tuple(segs)}

    def compile(self, batch: int, prompt_len: int) -> tuple[float, float]:
        tokens = jax.ShapeDtypeStruct((batch, prompt_len), jnp.int32)
        pre, t_pre = timed(lambda: self._prefill.lower(self.params, tokens).compile())
        _, cache_shape = jax.eval_shape(self._prefill, self.params, tokens)
        tok = jax.ShapeDtypeStruct((batch,), jnp.int32)
        stp, t_step = timed(lambda: self._step.lower(self.decode_params, tok, cache_shape).compile())
        self.compiled[batch] = (pre, stp)
        return t_pre, t_step

    def prefill(self, tokens):
        out = self.compiled[tokens.shape[0]][0](self.params, tokens)
        jax.block_until_ready(out)
        return out

    def decode(self, tok, cache, steps: int):
        stp = self.compiled[tok.shape[0]][1]
        for _ in range(steps):
            tok, cache = stp(self.decode_params, tok, cache)
        jax.block_until_ready(tok)
        return tok


# --------------------------------------------------------------------------- transformers


class Theirs:
    def __init__(self, path: Path, dtype: str):
        import torch
        from transformers import AutoModelForCausalLM

        self.torch = torch
        kwargs = {"dtype": getattr(torch, dtype)}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            if path.suffix == ".gguf":
                self.model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, **kwargs)
            else:
                self.model = AutoModelForCausalLM.from_pretrained(str(path), **kwargs)
        self.model.eval()
        # transformers 5.x renamed past_key_values to cache (the old name warns)
        self.cache_kw = "cache" if "cache" in inspect.signature(self.model.forward).parameters else "past_key_values"

    def _cache(self, out):
        return out.get("cache", None) if out.get("cache", None) is not None else out.past_key_values

    def prefill(self, tokens: np.ndarray):
        torch = self.torch
        with torch.inference_mode():
            out = self.model(input_ids=torch.from_numpy(tokens.astype(np.int64)), use_cache=True, logits_to_keep=1)
        return out.logits[:, -1].argmax(-1), self._cache(out)

    def decode(self, tok, cache, steps: int):
        torch = self.torch
        with torch.inference_mode():
            for _ in range(steps):
                out = self.model(input_ids=tok[:, None], use_cache=True, **{self.cache_kw: cache})
                tok, cache = out.logits[:, -1].argmax(-1), self._cache(out)
        return tok


# --------------------------------------------------------------------------- main


def main(argv=None) -> int:
    args = parse_args(argv)
    path = Path(args.model).expanduser() if args.model else embedded_model_path()
    dtype = jnp.float32 if args.dtype == "float32" else jnp.bfloat16
    import torch

    print(f"model {path.name}  dtype {args.dtype}  prompt {args.prompt_len}  decode steps {args.decode_steps}  "
          f"jax {jax.__version__} on {jax.devices()[0].platform}  torch {torch.__version__} "
          f"({torch.get_num_threads()} threads, OMP_WAIT_POLICY={os.environ['OMP_WAIT_POLICY']})  "
          f"cpus {os.cpu_count()}")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        backbone, t_load = timed(lambda: load_backbone(path, dtype, tokenizer=False))
    theirs, load_msg = None, f"load: ours {t_load:.1f} s"
    if not args.no_torch:
        theirs, t_load_hf = timed(lambda: Theirs(path, args.dtype))
        load_msg += f", transformers {t_load_hf:.1f} s"
    print(load_msg, flush=True)

    max_len = args.prompt_len + args.decode_steps + 1
    ours = Ours(backbone, max_len, args.decode_layout)
    rng = np.random.default_rng(0)
    rows = []
    for batch in args.batch:
        tokens = rng.integers(0, backbone.config.vocab_size, (batch, args.prompt_len)).astype(np.int32)
        t_cpre, t_cstep = ours.compile(batch, args.prompt_len)
        jt = jnp.asarray(tokens)
        ours.prefill(jt)  # warm-up
        pre_times = [timed(lambda: ours.prefill(jt))[1] for _ in range(args.repeats)]
        tok, cache = ours.prefill(jt)
        ours.decode(tok, cache, 1)  # warm-up (the cache buffers are donated)
        tok, cache = ours.prefill(jt)
        _, t_dec = timed(lambda: ours.decode(tok, cache, args.decode_steps))
        row = {"batch": batch, "compile_prefill": t_cpre, "compile_step": t_cstep,
               "ours_prefill": statistics.median(pre_times), "ours_step": t_dec / args.decode_steps}
        if theirs is not None:
            theirs.prefill(tokens)  # warm-up
            pre_times = [timed(lambda: theirs.prefill(tokens))[1] for _ in range(args.repeats)]
            ttok, tcache = theirs.prefill(tokens)
            theirs.decode(ttok, tcache, 1)
            ttok, tcache = theirs.prefill(tokens)
            # same computation on both sides: the prefill's greedy next tokens agree
            row["agree"] = float(np.mean(np.asarray(tok) == ttok.numpy()))
            _, t_dec = timed(lambda: theirs.decode(ttok, tcache, args.decode_steps))
            row.update(theirs_prefill=statistics.median(pre_times), theirs_step=t_dec / args.decode_steps)
        rows.append(row)
        report(row, args.prompt_len)
    return 0


def report(r, prompt_len):
    b = r["batch"]
    ours_pre = b * prompt_len / r["ours_prefill"]
    ours_dec = b / r["ours_step"]
    agree = f", prefill next-token agreement with transformers {r['agree']:.0%}" if "agree" in r else ""
    print(f"\nbatch {b}: compile (ours) prefill {r['compile_prefill']:.1f} s, decode step {r['compile_step']:.1f} s"
          f"{agree}")
    if "theirs_prefill" not in r:
        print(f"  prefill  ours {ours_pre:9.1f} tok/s")
        print(f"  decode   ours {1e3 * r['ours_step']:8.2f} ms/step ({ours_dec:.1f} tok/s)")
        return
    their_pre = b * prompt_len / r["theirs_prefill"]
    their_dec = b / r["theirs_step"]
    print(f"  prefill  ours {ours_pre:9.1f} tok/s   transformers {their_pre:9.1f} tok/s   "
          f"ratio ours/transformers {ours_pre / their_pre:5.2f}  (>1: ours faster)")
    print(f"  decode   ours {1e3 * r['ours_step']:8.2f} ms/step   transformers {1e3 * r['theirs_step']:8.2f} ms/step   "
          f"ratio ours/transformers {r['ours_step'] / r['theirs_step']:5.2f}  (<1: ours faster)"
          f"   [{ours_dec:.1f} vs {their_dec:.1f} tok/s]")


if __name__ == "__main__":
    from morse_jax.run.allocator import reexec_with_allocator

    reexec_with_allocator()  # both sides (one process) under one malloc: MORSE_JAX_MALLOC
    sys.exit(main())
