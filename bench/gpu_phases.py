"""The phases of bench/gpu.py, each run in its own process (``bench/gpu.py --child PHASE:MODEL``).

``sample`` (the sampler with and without the expert bank), ``update`` (the HGRPO update step) and
``hf`` (transformers ``generate``, the peer); the FLOP and byte counts they report; helpers for
device memory and the time budget. What each measures and how is in ``bench/gpu.py``'s docstring.
Each phase writes its partial result to its JSON file after every unit of work, so a child that
the parent kills at its time limit still reports what it finished.
"""

from __future__ import annotations

import gc
import json
import time
from pathlib import Path

import numpy as np

SUBTASK_PAIRS = ((0, 1), (2, 3), (0, 2), (1, 3), (0, 3), (1, 2))  # top-2 of 4 subtask experts

# --------------------------------------------------------------------------- counting (pure)


def update_flops(cfg, spec, *, rows: int, seq: int, completion: int, n_active: int) -> dict[str, float]:
    """FLOPs of one update micro-batch of ``rows`` x ``seq`` tokens, ``completion`` of them generated
    per row, ``n_active`` experts per row; see the module docstring for what is counted."""
    d, f, V, L = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size, spec.n_adapt
    qd, kvd = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    dims = {"q": (d, qd), "k": (d, kvd), "v": (d, kvd), "o": (qd, d), "gate": (d, f), "up": (d, f), "down": (f, d)}
    tokens = rows * seq
    frozen_macs = sum(a * b for a, b in dims.values())
    lora_macs = sum(spec.rank * sum(dims[t]) for t in spec.targets) * n_active
    out = {
        "frozen_linear": 4.0 * frozen_macs * L * tokens,
        "lora": 6.0 * lora_macs * L * tokens,
        "attention": 3 * 2.0 * cfg.num_heads * cfg.head_dim * seq * (seq + 1) * L * rows,
        "lm_head": 4.0 * d * V * rows * completion,
    }
    out["total"] = sum(out.values())
    return out


def decode_step_bytes(cfg, batch: int, cache_len: int, itemsize: int) -> float:
    """HBM bytes one decode step must read at least: every weight once (the LM head, or the tied
    embedding, once) and every cache slot of every row (XLA reads all ``cache_len`` slots)."""
    d, f, L = cfg.hidden_size, cfg.intermediate_size, cfg.num_layers
    qd, kvd = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    weights = L * (d * (qd + 2 * kvd) + qd * d + 3 * d * f) + cfg.vocab_size * d
    return float(itemsize * (weights + 2 * L * batch * cache_len * kvd))


# --------------------------------------------------------------------------- child helpers


class Budget:
    def __init__(self, seconds: float):
        self.end = time.monotonic() + seconds

    def left(self) -> float:
        return self.end - time.monotonic()


def device_memory() -> dict | None:
    """{"peak", "in_use", "limit"} in bytes from the first device, or None where unsupported."""
    import jax

    stats = jax.devices()[0].memory_stats()
    if not stats or "peak_bytes_in_use" not in stats:
        return None
    return {"peak": stats["peak_bytes_in_use"], "in_use": stats.get("bytes_in_use"), "limit": stats.get("bytes_limit")}


def vs_plan(measured: dict | None, plan_bytes: float, setup_peak: float | None) -> dict:
    peak = None if measured is None else float(measured["peak"])
    return {"peak_bytes": peak, "plan_bytes": float(plan_bytes),
            "ratio": None if peak is None else peak / plan_bytes,
            "bounded_by_setup": None if peak is None or setup_peak is None else peak <= setup_peak}


def is_oom(e: BaseException) -> bool:
    """An out-of-memory error of XLA or torch: a result to record, not a crash."""
    text = f"{type(e).__name__} {e}"
    return "RESOURCE_EXHAUSTED" in text or "out of memory" in text.lower() or "OutOfMemory" in text


def note(result: dict, key: str, msg: str) -> None:
    result.setdefault(key, []).append(msg)


def save(path: Path, result: dict) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(result, indent=1))
    tmp.replace(path)  # a child killed mid-write leaves the previous complete file


def build_backbone(cfg, spec):
    """Random bf16 params, split at the adapted segment in the same jitted program (as the job
    splits them once; no second copy of the layer weights is ever live)."""
    import jax
    import jax.numpy as jnp

    from morse_jax.models import Backbone, split_segments
    from morse_jax.models.params import init_params

    params = jax.jit(lambda k: split_segments(init_params(k, cfg, jnp.bfloat16), spec.n_adapt))(jax.random.key(0))
    jax.block_until_ready(params)
    return Backbone(cfg, params, tokenizer=None, source="random")


def sampler_config(args):
    from morse_jax.sampling.sampler import SamplerConfig

    batches = tuple(sorted(int(b) for b in args.batches.split(",")))
    return SamplerConfig(batch_buckets=batches, max_batch=batches[-1], prompt_buckets=(args.prompt,),
                         new_token_buckets=(args.new,), max_active=1 + 4)  # the job: 1 + num_subtask


def expert_set(spec, row: int, candidates: int):
    from morse_jax.mole.experts import execute_set

    route = row // candidates
    return execute_set(spec, SUBTASK_PAIRS[route % len(SUBTASK_PAIRS)], role=("execute", "merge")[route % 2])


# --------------------------------------------------------------------------- phases (children)


def phase_sample(args, cfg, spec, budget: Budget, result: dict, out: Path) -> None:
    import jax

    from morse_jax.mole.experts import init_expert_bank
    from morse_jax.parallel.memory import memory_plan
    from morse_jax.sampling.requests import prefill_token_rows
    from morse_jax.sampling.sampler import Request, Sampler

    sconf = sampler_config(args)
    rng = np.random.default_rng(0)
    bb = build_backbone(cfg, spec)
    bank = init_expert_bank(jax.random.key(1), cfg, spec, jax.numpy.bfloat16)
    bank["b"] = {t: (0.02 * jax.random.normal(jax.random.key(2), x.shape)).astype(x.dtype) for t, x in bank["b"].items()}
    sampler = Sampler(bb, spec, sconf)
    setup = device_memory()
    result["setup_memory"] = setup
    rows = result.setdefault("rows", {})

    def requests(B, experts, new):
        out_ = []
        for i in range(B):
            s = expert_set(spec, i, args.candidates) if experts else []
            out_.append(Request(rng.integers(0, cfg.vocab_size, args.prompt).tolist(), [e for e, _ in s],
                                [w for _, w in s], max_new_tokens=new, temperature=0.7, top_p=0.95))
        return out_

    def measure(smp, B, experts):
        t = time.perf_counter()
        smp.generate(bank if experts else None, requests(B, experts, 1), key=jax.random.key(B))
        first = time.perf_counter() - t
        t = time.perf_counter()
        done = smp.generate(bank if experts else None, requests(B, experts, args.new), key=jax.random.key(B + 1))
        wall = time.perf_counter() - t
        st = smp.last_stats
        assert all(len(c.token_ids) == args.new for c in done)
        step = st["decode_s"] / st["decode_steps"]
        return {"decode_tok_s": B * args.new / st["decode_s"], "e2e_tok_s": B * args.new / wall,
                "prefill_s": st["prefill_s"], "decode_s": st["decode_s"], "decode_ms_step": 1e3 * step,
                "first_call_s": first, "hbm_tb_s": decode_step_bytes(cfg, B, args.prompt + args.new, 2) / step / 1e12}

    batches = list(sconf.batch_buckets)
    adapters_end = Budget(0.6 * budget.left())  # the rest for the no-adapter pass over the same batches
    last = 0.0  # seconds the previous batch took (compile + runs): the next one takes at least that
    for B in batches:
        # A batch is started only if it can end inside the adapters' share: on the first GPU run a batch took
        # 45 s (mostly its compile) and one started with 18 s left ate the no-adapter pass's time, so the
        # adapters-vs-base goal went unmeasured.
        if adapters_end.left() <= last:
            note(result, "skipped", f"batch {B}: time budget")
            continue
        r = rows.setdefault(str(B), {})
        t_batch = time.perf_counter()
        try:
            r["adapters"] = measure(sampler, B, True)
            last = time.perf_counter() - t_batch
        except Exception as e:  # noqa: BLE001
            if not is_oom(e):
                raise
            note(result, "errors", f"batch {B}: {str(e).splitlines()[0][:300]}")
            break  # larger batches need more
        plan = memory_plan(cfg, spec, batch=args.micro_batch, cache_len=args.prompt + args.new, seq_len=args.seq,
                           dtype="bfloat16", sample_batch=B, prefill_rows=prefill_token_rows(sconf))
        r["memory"] = vs_plan(device_memory(), plan.sample_peak, setup and setup["peak"])
        save(out, result)
    del sampler
    bank = None  # free the adapter bank before the no-adapter pass (measure() reads it only with experts)
    gc.collect()
    base = Sampler(bb, None, sconf)
    for B in batches:
        r = rows.get(str(B), {})
        if "adapters" not in r:
            continue
        if budget.left() <= 0:
            note(result, "skipped", f"batch {B} without adapters: time budget")
            continue
        try:
            r["base"] = measure(base, B, False)
        except Exception as e:  # noqa: BLE001
            if not is_oom(e):
                raise
            note(result, "errors", f"batch {B} without adapters: {str(e).splitlines()[0][:300]}")
            break
        r["adapters_vs_base"] = r["adapters"]["decode_tok_s"] / r["base"]["decode_tok_s"]
        save(out, result)


def update_examples(args, cfg, spec, rng):
    import jax.numpy as jnp

    from morse_jax.rl.examples import RouteExample, SequenceExample

    comp = args.seq - args.update_prompt
    # one random residual stream shared by all sequences: values do not change the work
    states = (rng.standard_normal((args.seq, cfg.hidden_size), np.float32)).astype(jnp.bfloat16)
    seqs, routes = [], []
    for i in range(args.update_seqs):
        s = expert_set(spec, i, args.candidates)
        seqs.append(SequenceExample(rng.integers(0, cfg.vocab_size, args.update_prompt).tolist(),
                                    rng.integers(0, cfg.vocab_size, comp).tolist(),
                                    -rng.random(comp, np.float32) * 5, [e for e, _ in s], [w for _, w in s],
                                    float(rng.choice([-1.0, 1.0])), states))
        if i % args.candidates == 0:
            pair = SUBTASK_PAIRS[(i // args.candidates) % len(SUBTASK_PAIRS)]
            routes.append(RouteExample(rng.integers(0, cfg.vocab_size, 32).tolist(), pair, -1.5,
                                       float(rng.choice([-1.0, 1.0]))))
    return seqs, routes, comp, len(s)


def phase_update(args, cfg, spec, budget: Budget, result: dict, out: Path) -> None:
    import jax

    from morse_jax.parallel.memory import memory_plan
    from morse_jax.rl.update import TrainConfig, Trainer, init_trainable
    from morse_jax.sampling.sampler import Sampler

    bb = build_backbone(cfg, spec)
    sampler = Sampler(bb, spec, sampler_config(args))  # the job keeps the sampler's fused copy alive  # noqa: F841
    seqs, routes, comp, n_active = update_examples(args, cfg, spec, np.random.default_rng(0))
    setup = device_memory()
    result["setup_memory"] = setup
    mb = args.micro_batch
    while mb >= 1 and budget.left() > 0:
        tcfg = TrainConfig(micro_batch=mb, max_active=spec.max_active, length_buckets=(args.seq,),
                           remat=getattr(args, "remat", "layer"))
        trainer = Trainer(cfg, bb.params, spec, tcfg)
        trainable = init_trainable(jax.random.key(3), cfg, spec, tcfg, jax.numpy.bfloat16)
        opt = trainer.init_opt_state(trainable)
        groups = max(1, len(seqs) // args.candidates)
        try:
            t = time.perf_counter()
            trainable, opt, m = trainer.update(trainable, opt, seqs, routes, num_groups=groups)
            jax.block_until_ready(trainable)
            first = time.perf_counter() - t
            walls = []
            for _ in range(args.reps):
                if walls and budget.left() <= 0:
                    break
                t = time.perf_counter()
                trainable, opt, m = trainer.update(trainable, opt, seqs, routes, num_groups=groups)
                jax.block_until_ready(trainable)
                walls.append(time.perf_counter() - t)
        except Exception as e:  # noqa: BLE001 - an OOM is a result: record it, retry smaller
            if not is_oom(e):
                raise
            note(result, "errors", f"micro-batch {mb}: {str(e).splitlines()[0][:300]}")
            save(out, result)
            del trainer, trainable, opt
            gc.collect()
            mb //= 2
            continue
        wall = float(np.median(walls))
        per_mb = update_flops(cfg, spec, rows=mb, seq=args.seq, completion=comp, n_active=n_active)
        n_mb = -(-len(seqs) // mb)
        flops = {k: v * len(seqs) / mb for k, v in per_mb.items()}  # every micro-batch is full here
        plan = memory_plan(cfg, spec, batch=mb, cache_len=args.prompt + args.new, seq_len=args.seq, dtype="bfloat16",
                           remat=tcfg.remat)
        result["update"] = {
            "micro_batch": mb, "remat": tcfg.remat, "micro_batches": n_mb, "seq": args.seq, "completion": comp, "sequences": len(seqs),
            "update_s": wall, "first_update_s": first, "tokens_s": len(seqs) * args.seq / wall,
            "generated_tokens_s": len(seqs) * comp / wall, "flops": flops, "tflop_s": flops["total"] / wall / 1e12,
            "mfu": flops["total"] / wall / (args.peak_tflops * 1e12), "token_nll": m["token_nll"],
            "compiles": trainer.compile_count,
            "memory": vs_plan(device_memory(), plan.update_peak, setup and setup["peak"])
            if mb == args.micro_batch else {"peak_bytes": None, "plan_bytes": float(plan.update_peak), "ratio": None,
                                            "bounded_by_setup": None, "note": "after an OOM at a larger micro-batch"},
        }
        save(out, result)
        return
    note(result, "skipped", "update: time budget" if mb >= 1 else "update: out of memory at 1 row")


def hf_model_config(cfg):
    """The transformers config of the same shapes (random weights; rope scaling not mirrored)."""
    from transformers import LlamaConfig, Qwen3Config

    common = dict(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
                  num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads,
                  num_key_value_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, rms_norm_eps=cfg.rms_norm_eps,
                  tie_word_embeddings=cfg.tie_embeddings, max_position_embeddings=cfg.max_position_embeddings)
    return {"qwen3": Qwen3Config, "llama": LlamaConfig}[cfg.family](**common)


def phase_hf(args, cfg, spec, budget: Budget, result: dict, out: Path) -> None:
    try:
        import torch
        from transformers import AutoModelForCausalLM
    except ImportError as e:
        note(result, "skipped", f"transformers peer: {e}")
        return
    backend = args.jax_backend
    if backend != "cpu" and not torch.cuda.is_available():
        note(result, "skipped", f"transformers peer: JAX runs on {backend}, torch has no CUDA")
        return
    dev = torch.device("cpu" if backend == "cpu" else "cuda")
    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)
    with dev:
        model = AutoModelForCausalLM.from_config(hf_model_config(cfg), attn_implementation="sdpa")
    torch.set_default_dtype(torch.float32)
    model = model.to(torch.bfloat16).eval()
    model.generation_config.eos_token_id = None
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    rows = result.setdefault("rows", {})

    def gen(B, n):
        ids = torch.randint(0, cfg.vocab_size, (B, args.prompt), device=dev)
        sync()
        t = time.perf_counter()
        with torch.no_grad():
            out_ = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=True, temperature=0.7,
                                  top_p=0.95, max_new_tokens=n, min_new_tokens=n, pad_token_id=0)
        sync()
        assert out_.shape[1] == args.prompt + n
        return time.perf_counter() - t

    for B in sorted(int(b) for b in args.batches.split(",")):
        if budget.left() <= 0:
            note(result, "skipped", f"transformers batch {B}: time budget")
            continue
        try:
            first = gen(B, 1)  # warm-up (cuBLAS / sdpa setup)
            one, full = gen(B, 1), gen(B, args.new)
        except Exception as e:  # noqa: BLE001
            if not is_oom(e):
                raise
            note(result, "errors", f"transformers batch {B}: {str(e).splitlines()[0][:300]}")
            break
        dec = max(full - one, 1e-9) / (args.new - 1)
        rows[str(B)] = {"hf": {"decode_tok_s": B / dec, "e2e_tok_s": B * args.new / full, "first_call_s": first,
                               "prefill_s": one}}
        if dev.type == "cuda":
            rows[str(B)]["hf"]["torch_max_allocated"] = torch.cuda.max_memory_allocated()
        save(out, result)
