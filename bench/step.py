"""Where a training step's time goes: N HGRPO steps of a fixed config, the per-phase breakdown
(``run/profile.py``: plan, route, prefill, decode, compile, verify, update, checkpoint, other),
optionally against a peer checkout (before / after a change) in the same run.

Each side runs in a fresh subprocess (``python bench/step.py --child ...`` with the side's
checkout first on ``sys.path`` and as the working directory): the job is built, then
``run.train_loop.train`` runs ``--steps`` steps from scratch in a temporary work directory. With
``--peer`` the sides alternate (this, peer, this, peer, ... for ``--rounds`` rounds), so load on a
shared machine hits both alike. The table gives each phase's mean seconds per step (over all
steps and rounds; compile is its own row), the ratio peer / this, and ``wall (records)``: the time
between consecutive ``train`` metrics records, measured by the child itself, which exists on a
peer that predates the profile too (there only that row and ``rollout`` / ``update`` from the
train records are filled).

Usage:
  python bench/step.py [--steps 2] [--learn] [--peer ../other_checkout] [--rounds 1]
                       [--set rollout.max_new_tokens=48 ...] [--compilation-cache DIR]
  --learn: configs/learn_cpu.py:D (PyFuncs) instead of configs/quickstart.py (SciCode, variant D).

Measured: see README "Where a step's time goes".
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve()
REPO = HERE.parents[1]
MARK = "STEP_PROFILE_JSON "
PHASE_ROWS = ("plan", "route", "prefill", "decode", "compile", "verify", "update", "checkpoint", "other")


def child(args) -> None:
    """Runs in the side's checkout: build the job, train ``args.steps`` steps, print the records."""
    import importlib.util

    from morse_jax.config.validate import validate_config
    from morse_jax.run.build import Job
    from morse_jax.run.metrics_log import MetricsWriter
    from morse_jax.run.session import quiet_logs
    from morse_jax.run.train_loop import train

    quiet_logs()
    if args.compilation_cache:  # set directly, so a peer checkout older than the setting uses it too
        import jax

        jax.config.update("jax_compilation_cache_dir", str(Path(args.compilation_cache).expanduser()))
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)
    path, _, variant = args.config.partition(":")
    spec = importlib.util.spec_from_file_location("bench_config", Path(path).resolve())
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    cfg = mod.get_config(variant or "D")
    cfg.workdir, cfg.fresh, cfg.train.steps, cfg.train.epochs = args.workdir, True, args.steps, 0
    for item in args.set:
        key, _, value = item.partition("=")
        *parents, leaf = key.split(".")
        node = cfg
        for p in parents:
            node = getattr(node, p)
        try:
            value = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            pass  # a plain string
        setattr(node, leaf, value)
    validate_config(cfg)
    t0 = time.perf_counter()
    job = Job(cfg)
    setup = time.perf_counter() - t0
    writer = MetricsWriter(args.workdir, tensorboard=False)
    stamps = []  # when each train record was written: step walls without the profile
    write = writer.write

    def stamped(metrics, *, step, kind):
        if kind == "train":
            stamps.append(time.perf_counter())
        return write(metrics, step=step, kind=kind)

    writer.write = stamped
    t_train = time.perf_counter()
    train(job, writer)
    walls = [b - a for a, b in zip([t_train, *stamps], stamps)]
    out = {"setup_s": setup, "record_walls": walls, "step_time": writer.read("step_time"),
           "train": [{k: r.get(k) for k in ("step", "rollout_s", "update_s", "reward_mean", "skipped_update")}
                     for r in writer.read("train")]}
    print(MARK + json.dumps(out), flush=True)


def run_side(checkout: Path, args, config: str) -> dict:
    with tempfile.TemporaryDirectory(prefix="bench_step_") as tmp:
        cmd = [sys.executable, str(HERE), "--child", "--config", config, "--steps", str(args.steps),
               "--workdir", str(Path(tmp) / "run"), *sum((["--set", s] for s in args.set), []),
               *(["--compilation-cache", args.compilation_cache] if args.compilation_cache else [])]
        env = dict(os.environ, PYTHONPATH=str(checkout) + os.pathsep + os.environ.get("PYTHONPATH", ""))
        r = subprocess.run(cmd, cwd=checkout, env=env, capture_output=True, text=True)
    lines = [line for line in r.stdout.splitlines() if line.startswith(MARK)]
    if r.returncode != 0 or not lines:
        raise SystemExit(f"{checkout}: the child failed (rc {r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-5000:]}")
    for line in r.stdout.splitlines():  # the per-step progress lines of the train loop
        if line.startswith("step ") and " s = " in line:
            print(f"  [{checkout.name}] {line}", flush=True)
    res = json.loads(lines[-1][len(MARK):])
    for t in res["train"]:
        print(f"  [{checkout.name}] train step {t['step']}: reward {t['reward_mean']:.3f}, update {t['update_s']:.1f} s"
              + (" (skipped: no advantage)" if t.get("skipped_update") else ""), flush=True)
    return res


def summary(results: list[dict]) -> dict[str, float | None]:
    """Mean seconds per step of each row over every step of every round (None: not recorded)."""
    steps = [r for res in results for r in res["step_time"]]
    trains = [r for res in results for r in res["train"]]
    walls = [w for res in results for w in res["record_walls"]]
    out: dict[str, float | None] = {}
    for p in PHASE_ROWS:
        out[p] = sum(r[f"time/{p}_s"] for r in steps) / len(steps) if steps else None
    out["wall (profile)"] = sum(r["time/wall_s"] for r in steps) / len(steps) if steps else None
    out["wall (records)"] = sum(walls) / len(walls) if walls else None
    out["wall, steps 2+"] = (sum(r["time/wall_s"] for r in steps if r["step"] > 1)
                             / max(1, sum(r["step"] > 1 for r in steps))) if any(r["step"] > 1 for r in steps) else None
    out["rollout (train rec.)"] = sum(r["rollout_s"] for r in trains) / len(trains) if trains else None
    out["update (train rec.)"] = sum(r["update_s"] for r in trains) / len(trains) if trains else None
    out["idle share"] = sum(r["time/idle_share"] for r in steps) / len(steps) if steps else None
    return out


def table(sides: dict[str, dict]) -> str:
    names = list(sides)
    rows = list(next(iter(sides.values())))
    head = f"{'':22s}" + "".join(f"{n:>14s}" for n in names) + ("   peer/this" if len(names) == 2 else "")
    lines = [head]
    for row in rows:
        vals = [sides[n][row] for n in names]
        cells = "".join(f"{'-':>14s}" if v is None else f"{100 * v:>13.1f}%" if row == "idle share"
                        else f"{v:>13.2f}s" for v in vals)
        ratio = ""
        if len(vals) == 2 and None not in vals and vals[0] > 1e-3 and row != "idle share":
            ratio = f"   {vals[1] / vals[0]:.2f}x"
        lines.append(f"{row:22s}{cells}{ratio}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--learn", action="store_true", help="configs/learn_cpu.py:D instead of the quickstart")
    ap.add_argument("--peer", help="another checkout to run the same steps on (before / after)")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--set", action="append", default=[], help="config override key=value (repeatable)")
    ap.add_argument("--compilation-cache", default="",
                    help="a persistent XLA compilation cache dir for both sides (default: none, every "
                         "child compiles from scratch); run twice to measure warm restarts")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--config", help=argparse.SUPPRESS)
    ap.add_argument("--workdir", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args)
        return
    config = "configs/learn_cpu.py:D" if args.learn else "configs/quickstart.py:D"
    checkouts = {"this": REPO}
    if args.peer:
        checkouts["peer"] = Path(args.peer).resolve()
    from morse_jax.run import allocator

    print(f"# {config}, {args.steps} steps x {args.rounds} round(s), overrides {args.set or 'none'}; "
          f"cores {os.cpu_count()}, load {os.getloadavg()[0]:.1f} at start, malloc {allocator.current()} "
          f"(both sides)", flush=True)
    results: dict[str, list[dict]] = {n: [] for n in checkouts}
    for r in range(args.rounds):
        for name, path in checkouts.items():  # alternating sides
            t0 = time.perf_counter()
            res = run_side(path, args, config)
            results[name].append(res)
            print(f"# round {r + 1} {name} ({path}): {time.perf_counter() - t0:.0f} s in all, setup "
                  f"{res['setup_s']:.0f} s", flush=True)
    print(f"# mean seconds per step (load {os.getloadavg()[0]:.1f} at the end)")
    print(table({n: summary(v) for n, v in results.items()}))


if __name__ == "__main__":
    if "--child" not in sys.argv:  # a child (this side's or a peer checkout's) inherits the preload
        sys.path.insert(0, str(REPO))
        from morse_jax.run.allocator import reexec_with_allocator

        reexec_with_allocator()  # both sides under one malloc: MORSE_JAX_MALLOC
    main()
