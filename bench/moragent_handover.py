"""The reasoner's hand-over on held-out synthetic trajectories, text reading vs likelihood reading.

    python bench/moragent_handover.py --workdir runs/moragent_quickstart [--per-kind 4]

Restores the latest checkpoint of a MoRAgent work dir (the quickstart's config), takes the
generator's held-out trajectories (``moragent.heldout_examples``, never BFCL items), generates each
request's reasoner turn once (greedy), reads the hand-over both ways (``run.role_loop.next_role``
on the text; ``run.role_loop.choose_decisions``, the model's likelihood of the two closed turns),
generates the executor turn where a reading hands over to it, and prints per kind of item
(single call / multi call / no call) how often each reading picks the trajectory's own next role
and how often the executor's calls equal the trajectory's executor turn exactly.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
from pathlib import Path

from morse_jax.run import role_loop as rl
from morse_jax.run.agent_training import restore_or_train, training_trajectories
from morse_jax.run.moragent import AgentJob, loop_config
from morse_jax.sampling.requests import Request
from morse_jax.tasks.trajectories import ROLE_NAMES, Turn

REPO = Path(__file__).resolve().parents[1]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workdir", required=True)
    ap.add_argument("--config", default=str(REPO / "configs" / "moragent_quickstart.py"))
    ap.add_argument("--per-kind", type=int, default=0, help="items per kind (0: every held-out item)")
    args = ap.parse_args()
    spec = importlib.util.spec_from_file_location("cfg", args.config)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    cfg = mod.get_config("mor")
    cfg.workdir, cfg.mode = args.workdir, "eval"
    job = AgentJob(cfg)
    print(restore_or_train(job, train=False))
    tok, lc = job.backbone.tokenizer, loop_config(cfg)

    def kind(t):
        calls = next((x.content for x in t.turns if x.role == "executor"), "")
        return "none" if not calls else ("multi" if calls.count("(") > 1 else "single")

    _, held = training_trajectories(cfg)
    if args.per_kind:
        held = [t for k in ("single", "multi", "none") for t in [h for h in held if kind(h) == k][:args.per_kind]]
    starts = [dataclasses.replace(t, turns=t.turns[:1]) for t in held]

    def generate(trajs, role):
        reqs = []
        for t in trajs:
            ids, roles = rl.turn_prompt(t, role, tok)
            reqs.append(Request(prompt_ids=ids, prompt_roles=roles, role=ROLE_NAMES.index(role),
                                max_new_tokens=lc.budget(role), temperature=0.0, stop_token_ids=tuple(job.stop_ids)))
        return [c.text.strip() or "(empty)" for c in job.generate(reqs)] if reqs else []

    texts = generate(starts, "reasoner")
    readings = {"text": [(rl.next_role(x), x) for x in texts],
                "likelihood": rl.choose_decisions(starts, texts, job.score, tok)}
    print("| reading | kind | items | right role | exact calls |\n|---|---|---:|---:|---:|")
    for name, picks in readings.items():
        ex = [i for i, (role, _) in enumerate(picks) if role == "executor"]
        calls = dict(zip(ex, generate([dataclasses.replace(starts[i], turns=starts[i].turns + (
            Turn("reasoner", picks[i][1]),)) for i in ex], "executor")))
        for k in ("single", "multi", "none"):
            idx = [i for i, t in enumerate(held) if kind(t) == k]
            want = ["summarizer" if k == "none" else "executor" for _ in idx]
            right = sum(picks[i][0] == w for i, w in zip(idx, want))
            gold = [next((x.content for x in held[i].turns if x.role == "executor"), "") for i in idx]
            exact = sum(calls.get(i, "") == g for i, g in zip(idx, gold))
            print(f"| {name} | {k} | {len(idx)} | {right} | {exact} |")


if __name__ == "__main__":
    main()
