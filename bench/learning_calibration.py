"""How often does the untrained backbone pass PyFuncs nodes? (issue 16: aim at 20-50 % of execute nodes)

Samples ``--samples`` answers per execute node of the first ``--tasks`` TRAIN tasks (never the
eval splits) at the training temperature of configs/learn_cpu.py, with the family's prompts and
answer prefix; ``solve`` gets the helpers' reference code as context (a correct merge). Also
samples merge calls on the reference helpers. Prints pass rates (all tests), mean reward, and the
fraction of nodes with mixed outcomes (the nodes whose HGRPO groups are not skipped), plus
greedy (T=0) figures. Run: ``python bench/learning_calibration.py [--tasks 12 --samples 8]``
(``--no-merges --no-greedy``: only the sampled execute figure, a third of the decoding).
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tasks", type=int, default=12)
    ap.add_argument("--first", type=int, default=0, help="skip this many train tasks (another sample of tasks)")
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--temperature", type=float, default=None, help="default: the config's rollout.temperature")
    ap.add_argument("--out", default="", help="write the figures as JSON here")
    ap.add_argument("--dump", default="", help="append every completion with its reward as JSON lines here")
    ap.add_argument("--merges", action=argparse.BooleanOptionalAction, default=True,
                    help="also sample merge calls (--no-merges: execute nodes only, the calibrated figure)")
    ap.add_argument("--greedy", action=argparse.BooleanOptionalAction, default=True,
                    help="also decode each call greedily once (--no-greedy saves a pass on a busy machine)")
    args = ap.parse_args(argv)

    import importlib.util

    spec = importlib.util.spec_from_file_location("learn_cpu", Path(__file__).resolve().parents[1] / "configs/learn_cpu.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    cfg = mod.get_config("base")
    cfg.workdir = "/tmp/learning_calibration"
    temp = cfg.rollout.temperature if args.temperature is None else args.temperature

    from morse_jax.run.build import Job
    from morse_jax.sampling.sampler import Request
    from morse_jax.tasks.pyfuncs.family import merged_reference
    from morse_jax.tasks.pyfuncs.data import SOLVE, load_split

    job = Job(cfg, load_tasks=False)
    from morse_jax.tasks.pyfuncs.family import PyFuncsFamily

    fam = PyFuncsFamily()
    tasks = load_split("train", args.first + args.tasks)[args.first:]
    calls = []  # (task, node, role, prompt ids, prefix)
    for t in tasks:
        plan = fam.fixed_plan(t)
        for node in plan.nodes:
            ctx = merged_reference(t.payload) if node.id == SOLVE else ""
            msgs = fam.execute_messages(t, node, ctx, None)
            prefix = fam.answer_prefix(t, node, "execute")
            calls.append((t, node, "execute", job.encode([*msgs, {"role": "assistant", "content": prefix}]), prefix, ctx))
            if node.id == SOLVE and args.merges:
                arts = [fam.reference_artifact(t, plan.node(p)) for p in node.depends_on]
                mprefix = fam.answer_prefix(t, node, "merge")
                calls.append((t, node, "merge", job.encode([*fam.merge_messages(t, node, arts),
                                                            {"role": "assistant", "content": mprefix}]), mprefix, ""))
    out = {}
    passes = [("sampled", temp, args.samples)] + ([("greedy", 0.0, 1)] if args.greedy else [])
    for label, temperature, k in passes:
        reqs = [Request(prompt_ids=ids, max_new_tokens=cfg.rollout.max_new_tokens, temperature=temperature,
                        top_p=cfg.rollout.top_p if temperature > 0 else 1.0, stop_token_ids=job.stop_ids,
                        stop_strings=fam.stop_strings)
                for (_, _, _, ids, _, _) in calls for _ in range(k)]
        t0 = time.time()
        comps = job.generate(reqs)
        gen_s = time.time() - t0
        jobs = []
        for i, (t, node, role, _, prefix, ctx) in enumerate(calls):
            for j in range(k):
                text = prefix + comps[i * k + j].text
                if role == "merge":
                    jobs.append((i, role, lambda t=t, n=node, x=text: fam.verify_merge(t, n, fam.extract_merge_artifact(t, n, x))))
                else:
                    jobs.append((i, role, lambda t=t, n=node, x=text, c=ctx: fam.verify(t, n, fam.extract_artifact(t, n, x, context=c))))
        t0 = time.time()
        with ThreadPoolExecutor(2) as pool:
            results = list(pool.map(lambda j: j[2](), jobs))
        ver_s = time.time() - t0
        if args.dump:
            with open(args.dump, "a") as f:
                for i, (t, node, role, _, prefix, _) in enumerate(calls):
                    for j in range(k):
                        r = results[i * k + j]
                        f.write(json.dumps({"label": label, "task": t.task_id, "node": node.id, "role": role,
                                            "reward": r.reward, "gate": r.gate, "diagnostic": r.diagnostic,
                                            "tokens": len(comps[i * k + j].token_ids),
                                            "text": prefix + comps[i * k + j].text}) + "\n")
        per = collections.defaultdict(list)
        for (i, role, _), r in zip(jobs, results):
            per[(i, role)].append(r)
        fig = {}
        for role in ("execute", "merge") if args.merges else ("execute",):
            groups = [v for (i, r), v in per.items() if r == role]
            flat = [r for v in groups for r in v]
            fig[role] = {"nodes": len(groups), "samples": len(flat),
                         "gate": sum(r.gate for r in flat) / len(flat),
                         "pass_all": sum(r.reward == 1.0 for r in flat) / len(flat),
                         "mean_reward": sum(r.reward for r in flat) / len(flat),
                         "mixed_nodes": sum(len({r.reward for r in v}) > 1 for v in groups) / len(groups)}
        by_kind = collections.defaultdict(list)
        for (i, role), v in per.items():
            if role == "execute":
                by_kind[calls[i][0].payload.step(calls[i][1].id).spec.kind] += [r.reward for r in v]
        fig["execute_by_kind"] = {k: round(sum(v) / len(v), 3) for k, v in sorted(by_kind.items())}
        fig["generate_s"], fig["verify_s"], fig["temperature"] = round(gen_s, 1), round(ver_s, 1), temperature
        out[label] = fig
        print(f"{label} (T={temperature}): " + json.dumps(fig), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=2))
    e = out["sampled"]["execute"]
    print(f"calibration: untrained backbone passes {100 * e['pass_all']:.1f} % of execute-node samples at "
          f"T={temp} (mean reward {e['mean_reward']:.3f}, {100 * e['mixed_nodes']:.0f} % of nodes mixed; "
          f"{e['nodes']} nodes x {args.samples} samples, train tasks {args.first}..{args.first + args.tasks - 1})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
