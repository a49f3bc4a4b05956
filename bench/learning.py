"""Does it learn? Train variants x seeds on PyFuncs and evaluate held-out reward every k steps (issue 16).

    python bench/learning.py --variants A,B,C,D --seeds 0 1 2 --steps 20 --eval-every 5 --workdir runs/learning

Each (variant, seed) trains through the main job (:class:`morse_jax.run.build.Job`, ``run.train_loop.train``, the config
``configs/learn_cpu.py:<variant>`` with ``seed``) in chunks of ``--eval-every`` steps (each chunk
resumes from the previous chunk's checkpoint), and after every chunk (and before the first)
evaluates the fixed first ``--eval-tasks`` tasks of the iid and of the OOD split with greedy
decoding. Variant A (untrained) is evaluated once per seed, and always runs as the reference;
its evaluation is the step-0 point of every trained variant of that seed (all start from the
backbone: LoRA B matrices are zero at init, so greedy outputs are identical).
A finished (variant, seed) is kept (``<workdir>/<variant>_s<seed>/learning_run.json``) and not rerun,
and an interrupted one goes on from its last evaluated chunk (its evaluations so far are in
``learning_partial.json`` beside the chunk's checkpoint; other settings start it afresh), so an
interrupted matrix resumes; ``--fresh`` starts over. ``--records DIR`` (the repository keeps
its runs' records in ``docs/learning/runs``) makes the matrix span machines and sessions: a record
``DIR/<variant>_s<seed>.json`` counts as a kept run when its settings (steps, ``--eval-every``,
``--eval-tasks``, ``--eval-split``, ``--set``, config file) equal this invocation's, and every run
finished here is copied there.
``--eval-split validation`` evaluates on the last ``2 x --eval-tasks`` tasks of the *train* split
instead (training cycles through the train split from task 0 and never reaches them in such a
run): the split for choosing hyper-parameters (learning rate, steps) without seeing iid or OOD;
its columns are labelled ``val-a`` / ``val-b`` in the printout. Writes ``learning.json``,
``learning.md`` and ``learning.png`` (bench/learning_report.py) to ``--workdir``; the last printed
line is ``learning: D-A +X.X points on held-out iid tasks (seeds ...)``.
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import json
import shutil
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from learning_report import router_entropy, headline, write_outputs  # noqa: E402


def load_config(path: Path, variant: str):
    spec = importlib.util.spec_from_file_location("learn_config", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.get_config(variant)


def apply_overrides(cfg, overrides):
    """``group.field=value`` strings (values as Python literals, else strings)."""
    for item in overrides:
        key, _, raw = item.partition("=")
        try:
            value = ast.literal_eval(raw)
        except (ValueError, SyntaxError):
            value = raw
        node, *path = key.split(".")
        group = cfg
        for part in [node, *path][:-1]:
            group = group[part]
        group[[node, *path][-1]] = value
    return cfg


def eval_record(job, step: int, iid, ood) -> dict:
    from morse_jax.run.evaluate import evaluate

    rec = {"step": step}
    for split, tasks in (("iid", iid), ("ood", ood)):
        m = evaluate(job, tasks=tasks)
        rec[split] = {k: v for k, v in m.items() if isinstance(v, (int, float))}
        if split == "iid":
            rec["router_entropy"] = router_entropy(m.get("router_probs", []))
            rec["expert_sets"] = m.get("expert_sets", {})
    return rec


def run_one(args, variant: str, seed: int, iid, ood, step0: dict | None = None) -> dict:
    """Train and evaluate one (variant, seed); ``step0``: the untrained evaluation to reuse as
    step 0 (A's of the same seed: every variant starts from zero B matrices, i.e. the backbone)."""
    from morse_jax.config.validate import validate_config
    from morse_jax.run.build import Job
    from morse_jax.run.metrics_log import MetricsWriter
    from morse_jax.run.session import enable_compilation_cache
    from morse_jax.run.train_loop import train

    run_dir = Path(args.workdir) / f"{variant}_s{seed}"
    done = run_dir / "learning_run.json"
    if not args.fresh:
        kept = kept_record(args, variant, seed)
        if kept is not None:
            return kept
    resumed = None if args.fresh else resume_point(args, variant, seed)
    if resumed is None:
        shutil.rmtree(run_dir, ignore_errors=True)
    cfg = load_config(Path(args.config), variant)
    cfg.seed = seed
    cfg.workdir = str(run_dir)
    cfg.fresh = False
    cfg.train.steps = 0 if variant == "A" else args.steps
    cfg.train.checkpoint_every = args.eval_every
    apply_overrides(cfg, args.set)
    validate_config(cfg)
    enable_compilation_cache(cfg.compilation_cache)  # later seeds and variants reuse the programs
    evals, wall_before = resumed if resumed is not None else ([], 0.0)
    t0 = time.time() - wall_before
    job = Job(cfg, load_tasks=True)
    writer = MetricsWriter(run_dir)
    partial = run_dir / PARTIAL

    def record(ev):
        evals.append(ev)
        print(f"[{variant} seed {seed}] step {ev['step']}: iid {100 * ev['iid']['reward']:.1f} "
              f"ood {100 * ev['ood']['reward']:.1f} ({time.time() - t0:.0f}s)", flush=True)
        partial.write_text(json.dumps({"settings": run_settings(args, variant), "wall_s": time.time() - t0,
                                       "evals": evals}, default=str))

    if resumed is not None:
        print(f"[{variant} seed {seed}] resumed after step {evals[-1]['step']} ({len(evals)} evaluations kept)",
              flush=True)
    else:
        record(dict(step0, step=0, reused_from="A") if step0 is not None else eval_record(job, 0, iid, ood))
    if job.trains:
        for target in chunk_ends(args):
            if target <= evals[-1]["step"]:
                continue
            cfg.train.steps = target
            train(job, writer)
            record(eval_record(job, target, iid, ood))
    train = last_per_step(writer.read("train"))
    writer.close()
    rec = {"variant": variant, "seed": seed, "steps": cfg.train.steps if job.trains else 0,
           "wall_s": time.time() - t0, "settings": run_settings(args, variant), "evals": evals, "train": train}
    done.write_text(json.dumps(rec, default=str))
    partial.unlink(missing_ok=True)
    if args.records is not None:
        args.records.mkdir(parents=True, exist_ok=True)
        (args.records / f"{variant}_s{seed}.json").write_text(json.dumps(rec, default=str))
    return rec


PARTIAL = "learning_partial.json"  # an unfinished run's settings, wall time so far and evaluations


def chunk_ends(args) -> list[int]:
    """The steps after which a trained run is evaluated (and checkpointed)."""
    return list(range(args.eval_every, args.steps, args.eval_every)) + [args.steps]


def last_per_step(records) -> list[dict]:
    """The numeric fields of the last ``train`` record of each step, by step: a resumed run
    rewrites the steps after its checkpoint that the interrupted process had already logged."""
    by_step = {r["step"]: {k: v for k, v in r.items() if isinstance(v, (int, float))} for r in records}
    return [by_step[s] for s in sorted(by_step)]


def resume_point(args, variant: str, seed: int) -> tuple[list[dict], float] | None:
    """(evaluations so far, wall seconds so far) of an interrupted run of (variant, seed) that
    can go on: its partial record has this invocation's settings and its newest checkpoint is
    the last evaluated step or the chunk after it (killed before that chunk's evaluation; the
    run then restores it and evaluates). None: start it afresh (and say why when it existed)."""
    from morse_jax.checkpoint import Checkpointer

    run_dir = Path(args.workdir) / f"{variant}_s{seed}"
    path = run_dir / PARTIAL
    if not path.exists():
        return None
    rec = json.loads(path.read_text())
    if rec.get("settings") != run_settings(args, variant) or not rec.get("evals"):
        print(f"[{variant} seed {seed}] an unfinished run with other settings is in {run_dir}; starting afresh",
              flush=True)
        return None
    last = rec["evals"][-1]["step"]
    ckpt_dir = run_dir / "checkpoints"
    newest = 0
    if ckpt_dir.is_dir():
        ckpt = Checkpointer(ckpt_dir, async_save=False)
        newest = max(ckpt.all_steps(), default=0)
        ckpt.close()
    after = [t for t in chunk_ends(args) if t > last]
    if newest != last and newest != (after[0] if after else None):
        print(f"[{variant} seed {seed}] unfinished run evaluated up to step {last} but its newest checkpoint is "
              f"step {newest}; starting afresh", flush=True)
        return None
    return rec["evals"], float(rec.get("wall_s", 0.0))


def run_settings(args, variant: str) -> dict:
    """What makes two records of one (variant, seed) comparable: everything but the machine."""
    return {"steps": 0 if variant == "A" else args.steps, "eval_every": args.eval_every,
            "eval_tasks": args.eval_tasks, "eval_split": args.eval_split, "set": sorted(args.set),
            "config": Path(args.config).name}


def kept_record(args, variant: str, seed: int) -> dict | None:
    """A finished record of (variant, seed) with this invocation's settings: the run directory's,
    else ``--records``'s (each copied to the other place when missing there). Records written before settings were
    stored are matched on their step count alone."""
    want = run_settings(args, variant)
    run_dir = Path(args.workdir) / f"{variant}_s{seed}"
    places = [run_dir / "learning_run.json"]
    if args.records is not None:
        places.append(args.records / f"{variant}_s{seed}.json")
    for path in places:
        if not path.exists():
            continue
        rec = json.loads(path.read_text())
        have = rec.get("settings", {"steps": rec.get("steps")})
        if all(want[k] == v for k, v in have.items()) and rec.get("steps") == want["steps"]:
            for other in places:  # both places hold it afterwards
                if not other.exists():
                    other.parent.mkdir(parents=True, exist_ok=True)
                    other.write_text(path.read_text())
            print(f"[{variant} seed {seed}] kept from {path}", flush=True)
            return rec
        print(f"[{variant} seed {seed}] {path} has other settings ({have}); running it", flush=True)
    return None


def validation_tasks(args, ap):
    """Two slices of ``--eval-tasks`` from the end of the train split, checked to lie beyond
    every task these runs train on (training takes tasks_per_step tasks per step from task 0)."""
    from morse_jax.tasks.pyfuncs.data import load_split

    train = load_split("train")
    n = args.eval_tasks
    used = 0
    for v in args.variants.split(","):
        cfg = apply_overrides(load_config(Path(args.config), v.strip() or "D"), args.set)
        used = max(used, args.steps * cfg.data.tasks_per_step)
    if used > len(train) - 2 * n:
        ap.error(f"--eval-split validation: training reads train tasks 0..{used - 1}, which reaches the "
                 f"validation slices (the last {2 * n} of {len(train)}); use fewer --steps or --eval-tasks")
    return train[-n:], train[-2 * n:-n]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variants", default="A,B,C,D", help="comma-separated (A is always run as the reference)")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--eval-every", type=int, default=5)
    ap.add_argument("--eval-tasks", type=int, default=20, help="first N tasks of the iid and of the OOD split")
    ap.add_argument("--workdir", default="runs/learning")
    ap.add_argument("--config", default=str(ROOT / "configs/learn_cpu.py"))
    ap.add_argument("--set", action="append", default=[], metavar="GROUP.FIELD=VALUE",
                    help="config override for every run, e.g. --set rollout.max_new_tokens=64")
    ap.add_argument("--fresh", action="store_true", help="rerun (variant, seed) pairs that already finished")
    ap.add_argument("--records", type=Path, default=None, metavar="DIR",
                    help="finished-run records shared across machines and sessions (e.g. docs/learning/runs): "
                         "a record with this invocation's settings counts as kept; every run finished here is "
                         "copied there")
    ap.add_argument("--eval-split", choices=("heldout", "validation"), default="heldout",
                    help="heldout: iid + OOD splits (the experiment); validation: two slices from the end of the "
                         "train split, never trained on (for choosing hyper-parameters)")
    args = ap.parse_args(argv)
    if args.steps < 1 or args.eval_every < 1:
        ap.error("--steps and --eval-every must be >= 1")
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    if "A" not in variants:
        variants = ["A", *variants]
    unknown = [v for v in variants if v not in ("A", "B", "B++", "C", "D")]
    if unknown:
        ap.error(f"--variants: unknown {unknown}; choose from A, B, B++, C, D")
    from morse_jax.run.session import quiet_logs
    from morse_jax.tasks.pyfuncs.data import load_split

    quiet_logs()
    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    if args.eval_split == "validation":
        iid, ood = validation_tasks(args, ap)
        print(f"validation mode: 'iid' = train tasks {iid[0].task_id}..{iid[-1].task_id}, "
              f"'ood' = {ood[0].task_id}..{ood[-1].task_id} (never trained on here)", flush=True)
    else:
        iid, ood = load_split("iid", args.eval_tasks), load_split("ood", args.eval_tasks)
    t0 = time.time()
    runs = [run_one(args, "A", s, iid, ood) for s in args.seeds]
    a_eval = {r["seed"]: r["evals"][0] for r in runs}
    runs += [run_one(args, v, s, iid, ood, a_eval[s]) for v in variants if v != "A" for s in args.seeds]
    info = {"command": "python bench/learning.py " + " ".join(sys.argv[1:] if argv is None else argv),
            "config": Path(args.config).name,
            "eval tasks": (f"{len(iid)} iid + {len(ood)} OOD (greedy)" if args.eval_split == "heldout" else
                           f"VALIDATION: 'iid' = {len(iid)} + 'ood' = {len(ood)} train-split tail tasks (greedy)"),
            "wall time of this invocation (s)": round(time.time() - t0, 1),
            "wall time of all runs (s)": round(sum(r["wall_s"] for r in runs), 1)}
    summary = write_outputs(workdir, runs, info)
    print(f"wrote {workdir / 'learning.md'}, learning.json, learning.png")
    line = headline(summary)
    if args.eval_split == "validation":
        line = line.replace("held-out iid tasks", "validation tasks (train-split tail)")
    print(line)
    return 0


if __name__ == "__main__":
    from morse_jax.run.allocator import reexec_with_allocator

    reexec_with_allocator()  # as morse_jax.main: MORSE_JAX_MALLOC
    raise SystemExit(main())
