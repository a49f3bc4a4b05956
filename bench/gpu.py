"""GPU figures at full model size: sampler tokens/s, update-step MFU, peak memory vs the memory plan.

Random-weight bf16 backbones with the shapes of Qwen3-4B and Llama-3.1-8B (``PRESETS`` of
``morse_jax.parallel.memory``; no checkpoint), the paper's expert bank (2 role + 4 subtask
experts, rank 8, q/v/o of the last 8 layers), built as the job builds them (params split once at
the adapted segment, the sampler's fused copy alive during the update, trainable state in bf16).
Each (model, phase) runs in its own process, one after the other, so device peaks are per phase
and the transformers peer never shares the GPU with JAX's preallocated pool:

* ``sample``: ``Sampler.generate`` at batch 16, 64, 256 (prompt 512, 256 new tokens, t = 0.7,
  top-p 0.95, no early stop). Rows are B routes x M candidates; each route has its own top-2
  subtask pair plus a role expert (execute / merge), i.e. 3 active experts per row. Then the
  same sampler config with no expert bank at all (``Sampler(backbone, None)``: no LoRA work).
  Decode tokens/s = rows x new tokens / decode wall time (``Sampler.last_stats``, prefill
  excluded); end-to-end includes prefill. A first call per batch (same buckets, 1 new token)
  compiles and is reported, never timed. Goal: adapters >= 80 % of the no-adapter rate.
* ``hf``: transformers ``generate`` (sdpa, dynamic cache, same sampling settings, random weights
  of the same shapes; rope scaling is not mirrored, it does not change the work) on the same
  device; decode rate = (N-token generate - 1-token generate) / (N - 1) steps, as
  ``bench/sampler.py``. Skipped with a message when torch / transformers / a torch GPU is missing.
* ``update``: ``Trainer.update`` (PPO-clip LoRA loss, router loss on the routes, AdamW) over
  ``--update-seqs`` sequences of ``--seq`` tokens (``--update-prompt`` prompt + the rest
  generated; distinct prompts, so micro-batches are ``--micro-batch`` x ``--seq`` tokens) that
  carry prefix states, so the update runs the adapted segment only, as in the job.
  FLOPs counted (``gpu_phases.update_flops``), per micro-batch, 2 FLOPs per multiply-add:
    - frozen projections of the L_adapt adapted layers (q, k, v, o, gate, up, down) at every
      token: forward 2 x MACs + backward 2 x MACs (input gradients only: frozen weights get none);
    - LoRA: rank x (d_in + d_out) MACs per target, per active expert (3), per token: forward 2,
      backward 4 (input gradient + both factors' gradients);
    - attention, causal (query t attends t + 1 keys): QK^T and PV forward 2 x H x D x T(T+1) per
      row and layer, backward twice that (the materialised masked half is not counted);
    - LM head at generated positions only: forward + input gradient, 4 x d x V per token;
    - not counted: norms, rotary, softmax, the router (tiny), the optimizer step.
  MFU = counted FLOPs / (update wall time x ``--peak-tflops``). Goal: >= 40 %.
* memory: ``device.memory_stats()["peak_bytes_in_use"]`` (process high-water mark; "n/a" where
  the backend has none, e.g. CPU) after the largest sampling batch and after the update, against
  ``memory_plan`` (same model, bank, batch, cache length, sequence length, dtype); ratio printed,
  goal within +-15 %. Setup (random init, split, fused copy) is recorded too: a phase whose peak
  does not exceed the setup's is marked "bounded by setup".

Every phase stops starting new work when its share of ``--budget`` is spent; the parent kills a
child that overruns and keeps what it wrote. Output: a table on stdout and ``--out`` (JSON).
``--tiny``: the same code paths with tiny configs and sizes (CPU smoke test).

Usage:  python bench/gpu.py [--models qwen3-4b,llama-3.1-8b] [--batches 16,64,256] [--budget 450]
        [--peak-tflops 790] [--out gpu.json] [--no-hf] [--tiny]
On the device: launch/gpu_bench.sh (XLA flags, memory fraction, writes to $OUT).

Results: README "Performance", GPU figures (one H200, 2026-12-04).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for _p in (ROOT, ROOT / "bench"):  # run as a script from a copy of the repo, no install
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

import gpu_phases  # noqa: E402  (bench/, next to this file)

MODELS = {"qwen3-4b": "Qwen3-4B", "llama-3.1-8b": "Llama-3.1-8B"}  # --models name -> memory.PRESETS key
FULL = dict(batches="16,64,256", prompt=512, new=256, candidates=4, micro_batch=4, seq=3072, update_prompt=1024,
            update_seqs=16, n_adapt=8)
TINY = dict(batches="2", prompt=24, new=8, candidates=2, micro_batch=2, seq=64, update_prompt=24, update_seqs=4,
            n_adapt=1)
PHASES = (("sample", 0.45), ("update", 0.30), ("hf", 0.25))  # share of a model's budget


def model_config(name: str, tiny: bool):
    """Full-size preset, or a tiny config of the same family and switches (tied head, qk norm)."""
    from morse_jax.parallel.memory import PRESETS

    cfg = PRESETS[MODELS[name]]
    if tiny:
        cfg = dataclasses.replace(cfg, vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2,
                                  num_heads=4, num_kv_heads=2, head_dim=16, layer_types=())
    return cfg


def bank_spec(n_adapt: int):
    from morse_jax.mole.experts import ExpertBankSpec

    return ExpertBankSpec(n_adapt=n_adapt)  # paper defaults otherwise (App. E)


def run_child(args) -> int:
    from morse_jax.models.params import num_params

    phase, name = args.child.split(":")
    out = Path(args.child_out)
    budget = gpu_phases.Budget(args.child_budget)
    cfg, spec = model_config(name, args.tiny), bank_spec(args.n_adapt)
    result: dict = {"phase": phase, "model": MODELS[name], "params": num_params(cfg)}
    if phase != "hf":
        import jax

        d = jax.devices()[0]
        result.update(jax=jax.__version__, backend=jax.default_backend(), device=f"{d.platform} {d.device_kind}")
    gpu_phases.save(out, result)
    run = {"sample": gpu_phases.phase_sample, "update": gpu_phases.phase_update, "hf": gpu_phases.phase_hf}[phase]
    run(args, cfg, spec, budget, result, out)
    gpu_phases.save(out, result)
    return 0


# --------------------------------------------------------------------------- parent


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog="See the module docstring.")
    ap.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, of {list(MODELS)}")
    for k, v in FULL.items():
        ap.add_argument("--" + k.replace("_", "-"), type=type(v), default=None, help=f"default {v} ({TINY[k]} tiny)")
    ap.add_argument("--reps", type=int, default=2, help="timed updates (median)")
    ap.add_argument("--budget", type=float, default=450.0, help="seconds for everything (children share it)")
    ap.add_argument("--peak-tflops", type=float, default=790.0, help="dense bf16 peak of the device, TFLOP/s")
    ap.add_argument("--no-hf", action="store_true", help="skip the transformers peer")
    ap.add_argument("--remat", default="layer", choices=("none", "layer"),
                    help="the update's train.remat (none: every adapted layer's [B, H, T, T] attention is kept)")
    ap.add_argument("--tiny", action="store_true", help="tiny configs and sizes (CPU smoke test)")
    ap.add_argument("--out", default="gpu_bench.json")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--child-out", help=argparse.SUPPRESS)
    ap.add_argument("--child-budget", type=float, help=argparse.SUPPRESS)
    ap.add_argument("--jax-backend", default="gpu", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    for k, v in (TINY if args.tiny else FULL).items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    bad = [m for m in args.models.split(",") if m not in MODELS]
    if bad:
        ap.error(f"--models: unknown {bad}; choose from {list(MODELS)}")
    return args


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.child:
        return run_child(args)
    # a TERM (the wrapper's timeout) becomes SystemExit, on which subprocess.run kills the running child
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    plan = [(m, p, w) for m in args.models.split(",") for p, w in PHASES if not (p == "hf" and args.no_hf)]
    report = {"date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "argv": argv,
              "sizes": {k: getattr(args, k) for k in FULL}, "peak_tflops": args.peak_tflops,
              "xla_flags": os.environ.get("XLA_FLAGS", ""),
              "mem_fraction": os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION"), "models": {}}
    end = time.monotonic() + args.budget
    backend = "cpu" if args.tiny else "gpu"
    for i, (m, phase, w) in enumerate(plan):
        share = max(1.0, (end - time.monotonic()) * w / sum(x[2] for x in plan[i:]))
        child_out = out.with_name(f"{out.stem}.{m}.{phase}.json")
        cmd = [sys.executable, str(Path(__file__).resolve()), *argv, "--child", f"{phase}:{m}",
               "--child-out", str(child_out), "--child-budget", f"{share:.1f}", "--jax-backend", backend]
        env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false") if phase == "hf" else None
        grace = 20 if args.tiny else 90  # compile / a started unit may overrun the share
        t = time.perf_counter()
        try:
            rc = subprocess.run(cmd, env=env, timeout=share + grace).returncode
            status = "ok" if rc == 0 else f"exit {rc}"
        except subprocess.TimeoutExpired:
            status = "killed at its time limit"
        res = json.loads(child_out.read_text()) if child_out.exists() else {}
        res.update(status=status, wall_s=time.perf_counter() - t, budget_s=share)
        if phase != "hf" and "backend" in res:
            backend = res["backend"]  # the hf peer runs where JAX ran
        report["models"].setdefault(MODELS[m], {})[phase] = res
        out.write_text(json.dumps(report, indent=1))
        child_out.unlink(missing_ok=True)
    print(format_report(report))
    return 0


def format_report(report: dict) -> str:
    gb = 1e9
    lines = [f"# GPU figures, {report['date']}; XLA_FLAGS set: {bool(report['xla_flags'].strip())}, "
             f"mem fraction {report['mem_fraction']}"]
    for name, phases in report["models"].items():
        s, u, h = phases.get("sample", {}), phases.get("update", {}), phases.get("hf", {})
        lines.append(f"\n{name} ({s.get('params', 0) / 1e9:.2f} B params) on {s.get('device', '?')}, "
                     f"jax {s.get('jax', '?')}; phases: " + ", ".join(f"{p} {r['status']} ({r['wall_s']:.0f} s)"
                                                                 for p, r in phases.items()))
        lines.append("  batch | ours+experts tok/s | no adapters tok/s | ratio (goal >=0.80) | transformers tok/s |"
                     " ours/transformers | prefill s | HBM TB/s | peak GB / plan GB (goal +-15 %)")
        for B, r in sorted(s.get("rows", {}).items(), key=lambda kv: int(kv[0])):
            a, b = r.get("adapters", {}), r.get("base", {})
            hf = h.get("rows", {}).get(B, {}).get("hf", {})
            mem = r.get("memory", {})
            peak = "n/a" if mem.get("peak_bytes") is None else (
                f"{mem['peak_bytes'] / gb:.1f} / {mem['plan_bytes'] / gb:.1f} = {mem['ratio']:.2f}"
                + (" (bounded by setup)" if mem.get("bounded_by_setup") else ""))
            ratio = f"{r['adapters_vs_base']:.2f}" if "adapters_vs_base" in r else "-"
            vs_hf = f"{a['decode_tok_s'] / hf['decode_tok_s']:.2f}x" if a and hf else "-"
            lines.append(f"  {B:>5} | {a.get('decode_tok_s', 0):18.0f} | {b.get('decode_tok_s', 0):17.0f} | {ratio:>19} |"
                         f" {hf.get('decode_tok_s', 0):18.0f} | {vs_hf:>17} | {a.get('prefill_s', 0):9.2f} |"
                         f" {a.get('hbm_tb_s', 0):8.2f} | {peak}")
        up = u.get("update")
        if up:
            mem = up["memory"]
            peak = "n/a" if mem.get("peak_bytes") is None else (
                f"{mem['peak_bytes'] / gb:.1f} GB / plan {mem['plan_bytes'] / gb:.1f} GB = {mem['ratio']:.2f}")
            lines.append(f"  update: {up['sequences']} x {up['seq']} tokens, micro-batch {up['micro_batch']}: "
                         f"{up['update_s']:.2f} s, {up['tokens_s']:.0f} tok/s, {up['tflop_s']:.1f} TFLOP/s counted, "
                         f"MFU {100 * up['mfu']:.1f} % (goal >= 40 %); peak {peak}")
        for p, r in phases.items():
            for msg in r.get("skipped", []) + r.get("errors", []):
                lines.append(f"  {p}: {msg}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
