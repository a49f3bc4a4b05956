"""Rollout time with verification overlapped with generation vs after it (issue 20, item 3).

One training rollout of the main job (``configs/learn_cpu.py`` by default: the embedded
SmolLM2-135M, PyFuncs, B=2 x M=4, 96 new tokens, 2 tasks), run alternately with
``rollout.verify_overlap=False`` (each wave's candidates verified after its whole generation)
and ``True`` (each sampler micro-batch verified while the next generates), in one process, the
order swapped every repetition so load on a shared machine hits both alike. Every run starts
from the same PRNG key, so both schedules sample the same completions; the script checks that
their rewards are identical. An untimed run first compiles the sampler.

Per run it reports wall time, the time inside ``generate`` (sampling, planning included) and the
rest (host work plus the verification not hidden behind sampling), and the verifier's busy time
(summed over threads). Medians over ``--reps``; ratio = after / overlapped wall time, per
repetition (both runs back to back) and its median.

Measured (2 shared cores, load 6-9; ``--reps 5 --set rollout.max_new_tokens=48``): rewards
identical in every run; rest (outside generation) 16.5 s median after vs 12.5 s overlapped,
generate 132.5 vs 146.0 s (the sandbox runs compete with the CPU sampler for the two cores); wall
0.93x, per pair 0.81, 1.46, 1.13, 0.93, 0.76: within the noise, no gain measurable here.

Usage:  python bench/verify_overlap.py [--reps 3] [--variant D] [--config configs/learn_cpu.py]
        [--set rollout.max_new_tokens=96 ...] [--workers 0]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from learning import apply_overrides, load_config  # noqa: E402


def timed_family(family, busy: list[float]):
    """Wrap the family's verify / verify_merge so their time is summed into ``busy[0]``."""
    lock = threading.Lock()
    for name in ("verify", "verify_merge"):
        fn = getattr(family, name, None)
        if not callable(fn):
            continue

        def wrapped(*a, _fn=fn, **k):
            t0 = time.perf_counter()
            try:
                return _fn(*a, **k)
            finally:
                with lock:
                    busy[0] += time.perf_counter() - t0

        setattr(family, name, wrapped)


def one_run(job, key, tasks, overlap: bool, busy: list[float]) -> dict:
    job.cfg.rollout.verify_overlap = overlap
    job.key = key  # the same samples in both schedules
    gen_s = [0.0]
    plain = job.generate

    def generate(requests, on_ready=None):
        t0 = time.perf_counter()
        try:
            return plain(requests, on_ready=on_ready)
        finally:
            gen_s[0] += time.perf_counter() - t0

    job.generate = generate
    busy[0] = 0.0
    t0 = time.perf_counter()
    try:
        res = job.orchestrator("train").run(tasks)
    finally:
        del job.generate  # back to the class's method
    wall = time.perf_counter() - t0
    rewards = [[c.reward for row in g.candidates for c in row] for g in res.groups]
    return {"wall": wall, "generate": gen_s[0], "rest": wall - gen_s[0], "verify_busy": busy[0],
            "requests": res.counters.requests, "verifier_calls": res.counters.verifier_calls, "rewards": rewards}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=str(ROOT / "configs/learn_cpu.py"))
    ap.add_argument("--variant", default="D")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--workers", type=int, default=0, help="rollout.verify_workers (0 = one per CPU)")
    ap.add_argument("--set", action="append", default=[], metavar="GROUP.FIELD=VALUE")
    args = ap.parse_args(argv)
    from morse_jax.config.validate import validate_config
    from morse_jax.run.build import Job
    from morse_jax.run.session import quiet_logs

    quiet_logs()
    cfg = load_config(Path(args.config), args.variant)
    cfg.workdir = str(ROOT / "runs" / "bench_verify_overlap")
    cfg.rollout.verify_workers = args.workers
    apply_overrides(cfg, args.set)
    validate_config(cfg)
    job = Job(cfg, load_tasks=True)
    busy = [0.0]
    timed_family(job.family, busy)
    tasks = job.train_tasks[:cfg.data.tasks_per_step]
    key = job.key
    t0 = time.perf_counter()
    one_run(job, key, tasks, False, busy)  # compiles
    print(f"warm-up (compiles) {time.perf_counter() - t0:.1f}s", flush=True)
    runs: dict[bool, list[dict]] = {False: [], True: []}
    for rep in range(args.reps):
        for overlap in ((False, True) if rep % 2 == 0 else (True, False)):
            r = one_run(job, key, tasks, overlap, busy)
            runs[overlap].append(r)
            print(f"rep {rep} {'overlapped' if overlap else 'after     '}: wall {r['wall']:.1f}s generate "
                  f"{r['generate']:.1f}s rest {r['rest']:.1f}s verify busy {r['verify_busy']:.1f}s "
                  f"({r['requests']} requests, {r['verifier_calls']} verifications)", flush=True)
    same = all(r["rewards"] == runs[False][0]["rewards"] for rs in runs.values() for r in rs)

    def med(overlap, k):
        return statistics.median(r[k] for r in runs[overlap])

    print(f"\nmedians over {args.reps} reps (variant {args.variant}, {len(tasks)} tasks, "
          f"verify_workers {args.workers or 'one per CPU'}):")
    for k in ("wall", "generate", "rest", "verify_busy"):
        print(f"  {k:12s} after {med(False, k):7.1f}s   overlapped {med(True, k):7.1f}s")
    # each repetition's pair ran back to back: its ratio is steadier than a ratio of medians when
    # the machine's load swings between repetitions
    pairs = [a["wall"] / b["wall"] for a, b in zip(runs[False], runs[True])]
    print(f"rewards identical in every run: {same}")
    print("per-repetition after / overlapped wall: " + ", ".join(f"{x:.2f}" for x in pairs))
    print(f"verify_overlap: after / overlapped wall = {statistics.median(pairs):.3f}x (median of the pairs; "
          f"ratio of medians {med(False, 'wall') / med(True, 'wall'):.3f}x)")
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
