"""Cost of verifying SciCode steps: this tree against a peer tree (e.g. the verifier before a change).

Each round verifies the ground truth of the same development steps once per tree, in a fresh
interpreter with that tree first on ``sys.path``, alternating which tree goes first; targets are
built (and cached per tree) in an untimed warm-up round. Prints per-round wall-clock seconds
(sandboxes included) and the CPU seconds of the verifier's own process (work done outside the
sandbox: decoding, comparisons; the sandboxed interpreters' CPU is not counted), and the median
ratios this/peer. Each round is a fresh process, so one-time imports count in every round.

    python bench/verify_cost.py --peer ../morse_jax_old --rounds 5 --steps 1.1 10.3 10.6 29.3 78.1
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def _inner(steps: list[str], cache: str) -> None:
    from morse_jax.tasks.scicode import family as sc  # the tree's own package (cwd first on sys.path)

    dev = {p.problem_id: p for p in sc.load_problems("package:dev")}
    fam = sc.SciCodeFamily(sc.RebuiltTargets(cache), limits=sc.ExecLimits(timeout_s=600, test_timeout_s=300))
    import resource

    def cpu() -> float:  # the verifier's own process (the sandboxed interpreters are not its reaped children)
        a, b = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
        return a.ru_utime + a.ru_stime + b.ru_utime + b.ru_stime

    total, total_cpu, per = 0.0, 0.0, {}
    for sid in steps:
        p = dev[sid.split(".")[0]]
        task = sc.problem_to_task(p)
        node = fam.fixed_plan(task).node(sid)
        art = sc.join_program(sc.gold_upstream(p, sid), sid, p.step(sid).ground_truth)
        fam.targets.step_targets(p, p.step(sid))  # cached after the warm-up round: not timed
        t, c = time.perf_counter(), cpu()
        res = fam.verify(task, node, art)
        per[sid] = time.perf_counter() - t
        total += per[sid]
        total_cpu += cpu() - c
        if res.reward != 1.0:
            raise SystemExit(f"{sid}: ground truth scored {res.reward}")
    print(json.dumps({"total": total, "cpu": total_cpu, "per_step": per, "module": sc.__file__}))


def _run(tree: Path, steps: list[str], cache: Path) -> dict:
    env = dict(os.environ, PYTHONPATH=str(tree))
    out = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--inner", "--cache", str(cache),
                          "--steps", *steps], cwd=tree, env=env, capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise SystemExit(f"{tree}: {out.stderr[-2000:]}{out.stdout[-500:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--peer", help="the other tree (a checkout of the verifier to compare with)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", nargs="+", default=["1.1", "10.3", "10.6", "29.3", "78.1"])
    ap.add_argument("--inner", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--cache", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.inner:
        _inner(args.steps, args.cache)
        return
    if not args.peer:
        ap.error("--peer is required")
    this, peer = Path(__file__).resolve().parents[1], Path(args.peer).resolve()
    with tempfile.TemporaryDirectory(prefix="verify-cost-") as tmp:
        caches = {this: Path(tmp) / "this", peer: Path(tmp) / "peer"}
        for tree in (this, peer):  # warm-up: builds the targets
            print(f"warm-up {tree}: {_run(tree, args.steps, caches[tree])['module']}", flush=True)
        times: dict[Path, list[float]] = {this: [], peer: []}
        cpus: dict[Path, list[float]] = {this: [], peer: []}
        for r in range(args.rounds):
            order = (this, peer) if r % 2 == 0 else (peer, this)
            for tree in order:
                out = _run(tree, args.steps, caches[tree])
                times[tree].append(out["total"])
                cpus[tree].append(out["cpu"])
            print(f"round {r + 1}: this {times[this][-1]:.2f} s ({cpus[this][-1]:.2f} s verifier CPU), "
                  f"peer {times[peer][-1]:.2f} s ({cpus[peer][-1]:.2f} s verifier CPU)", flush=True)
    for what, data in (("wall", times), ("verifier-process CPU", cpus)):
        ratios = [a / b for a, b in zip(data[this], data[peer])]
        print(f"{what}, steps {' '.join(args.steps)}: median this {statistics.median(data[this]):.2f} s, "
              f"peer {statistics.median(data[peer]):.2f} s, median ratio this/peer {statistics.median(ratios):.3f} "
              f"(per round: {', '.join(f'{x:.3f}' for x in ratios)})")


if __name__ == "__main__":
    main()
