"""One process of a multi-controller run on CPU (started by launch/local_multiprocess.sh).

    MORSE_ENTRY="python tests/parallel_two_process_step.py --mode step --out DIR" \\
        launch/local_multiprocess.sh -n 2 -d 2

Takes the ``--config.parallel.*`` flags the launcher appends, initialises ``jax.distributed``
through ``morse_jax.parallel.initialize`` and runs one of:

* ``--mode logits``: a broadcast from the coordinator and backbone logits over a mesh spanning
  both processes; process 0 also computes the single-device logits locally as the reference.
* ``--mode step``: one full HGRPO update step through the library: the coordinator "plans"
  (prompts and routes from its own RNG) and broadcasts the plan; every process generates with
  the sharded sampler; the coordinator scores the completions (plus noise from its own RNG, as a
  verifier's wall-clock-dependent result would differ between hosts) and broadcasts the rewards;
  every process builds the same batch and takes the sharded Trainer update.

Each process writes ``DIR/process_<id>.npz`` (its host copy of the results) and exits 0.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from morse_jax.parallel import (  # noqa: E402
    broadcast_from_coordinator,
    initialize,
    is_coordinator,
    make_mesh,
    process_allgather,
    replicate,
    replicated_jit,
    run_on_coordinator,
    sharded_logits,
)

TARGET = np.arange(16)  # reward: fraction of generated tokens in this set


def parse():
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", choices=("logits", "step"), required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--mesh", default="-1,1,2", help="data,fsdp,tensor")
    ap.add_argument("--config.parallel.coordinator", dest="coordinator", default="")
    ap.add_argument("--config.parallel.num_processes", dest="num_processes", type=int, default=0)
    ap.add_argument("--config.parallel.process_id", dest="process_id", type=int, default=-1)
    return ap.parse_args()


def flat(tree, prefix: str) -> dict[str, np.ndarray]:
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {prefix + jax.tree_util.keystr(p): np.asarray(x) for p, x in leaves}


def mode_logits(mesh) -> dict:
    from morse_jax.models import logits
    from parallel_common import CFG, backbone

    sent = {"plan": {"nodes": ["a", "b"], "edges": [(0, 1)]}, "rewards": np.array([0.25, 1.0], np.float32),
            "scale": np.float32(2.5)}
    got = broadcast_from_coordinator(sent if is_coordinator() else None)
    ok = (got["plan"] == sent["plan"] and np.array_equal(got["rewards"], sent["rewards"])
          and got["rewards"].dtype == np.float32 and got["scale"] == np.float32(2.5)
          and isinstance(got["plan"]["edges"][0], tuple))
    # host work on process 0 only; a failure there reaches every process instead of a hang
    ran = run_on_coordinator(lambda: {"by": jax.process_index()})
    try:
        run_on_coordinator(lambda: 1 / 0)
        raised = ""
    except (ZeroDivisionError, RuntimeError) as e:
        raised = type(e).__name__
    ok = ok and ran == {"by": 0} and raised == ("ZeroDivisionError" if is_coordinator() else "RuntimeError")

    bb = backbone()
    tokens = np.random.default_rng(2).integers(0, 64, (4, 12))
    fn = sharded_logits(mesh, bb)
    out = fn(tokens)
    res = {"logits": np.asarray(process_allgather(out)), "broadcast_ok": np.array(ok),
           "logits_spec": np.array(str(out.sharding.spec))}

    # a routing draw as the job makes it: sharded embedding, replicated router, host inputs
    from morse_jax.mole import router as rt

    def route(router, embed, ids, mask, key):
        probs = rt.router_probs(router, rt.subtask_embedding(embed, ids, mask))
        return rt.sample_route(key, probs, 2), probs

    router = rt.init_router(jax.random.key(4), CFG.hidden_size, num_experts=4, dim=16)
    ids = tokens[:, :6].astype(np.int32)
    mask = np.ones(ids.shape, bool)
    members, probs = replicated_jit(mesh, route)(replicate(mesh, router), fn.params["embed"], ids, mask,
                                                 jax.random.key(5))
    res["route_members"], res["route_probs"] = np.asarray(members), np.asarray(probs)
    if is_coordinator():  # single-device reference, on this process' first device only
        res["reference"] = np.asarray(logits(bb, tokens))
        m, p = jax.jit(route)(router, bb.params["embed"], ids, mask, jax.random.key(5))
        res["route_members_ref"], res["route_probs_ref"] = np.asarray(m), np.asarray(p)
    return res


def mode_step(mesh) -> dict:
    from morse_jax.rl.examples import examples_from_groups
    from morse_jax.rl.update import Trainer
    from morse_jax.sampling.sampler import Request, Sampler
    from parallel_common import CFG, SAMPLER, SPEC, TRAIN, backbone, trainable0

    # 1. the coordinator plans: 2 nodes, each with 2 routes x 4 candidates (other processes' RNG
    #    would give other prompts: only the broadcast makes the global batch the same everywhere)
    rng = np.random.default_rng(100 + jax.process_index())
    plan = None
    if is_coordinator():
        plan = {"nodes": [{"prompt": rng.integers(0, 64, 3 + n).tolist(),
                           "routes": [tuple(int(x) for x in rng.choice(4, 2, replace=False)) for _ in range(2)],
                           "description": rng.integers(0, 64, 6).tolist()} for n in range(2)]}
    plan = broadcast_from_coordinator(plan)

    # 2. every process generates the same global batch on the sharded sampler
    bb = backbone()
    trainable = trainable0()
    sampler = Sampler(bb, SPEC, SAMPLER, mesh=mesh)
    reqs, where = [], []
    for n, node in enumerate(plan["nodes"]):
        for b, route in enumerate(node["routes"]):
            ids = [SPEC.role_id("execute")] + [SPEC.subtask_id(k) for k in route]
            for m in range(4):  # 4 candidates per route: different prompts suffixes, greedy
                reqs.append(Request(node["prompt"] + [m], ids, [1.0 / 3] * 3, max_new_tokens=8, temperature=0.0))
                where.append((n, b, m))
    bank = jax.tree.map(jnp.asarray, trainable["bank"])
    if mesh is not None:
        bank = replicate(mesh, bank)
    outs = sampler.generate(bank, reqs, key=jax.random.key(7))

    # 3. the coordinator verifies and broadcasts the rewards
    rewards = None
    if is_coordinator():
        rewards = np.array([np.isin(o.token_ids, TARGET).mean() for o in outs], np.float32)
        rewards = rewards + rng.uniform(0, 0.5, rewards.shape).astype(np.float32)
    rewards = broadcast_from_coordinator(rewards)

    # 4. the same batch everywhere, one sharded update
    class Cand:
        def __init__(self, r, o):
            self.prompt_ids, self.token_ids, self.logprobs = r.prompt_ids, o.token_ids, o.logprobs
            self.expert_ids, self.expert_weights = r.expert_ids, r.expert_weights

    class Group:
        def __init__(self, n, node):
            idx = [i for i, w in enumerate(where) if w[0] == n]
            self.node_id, self.description, self.routes = str(n), node["description"], list(node["routes"])
            self.rewards = rewards[idx].reshape(2, 4)
            self.candidates = [[Cand(reqs[i], outs[i]) for i in idx[b * 4:(b + 1) * 4]] for b in range(2)]
            self.route_set_logp_old = np.full(2, -1.5, np.float32)

    groups = [Group(n, node) for n, node in enumerate(plan["nodes"])]
    seqs, routes, _ = examples_from_groups(groups, advantage="hgrpo", description_ids=lambda d: d)
    trainer = Trainer(CFG, bb.params, SPEC, TRAIN, mesh=mesh)
    state = jax.tree.map(jnp.asarray, trainable)
    if mesh is not None:
        state = replicate(mesh, state)
    opt = trainer.init_opt_state(state)
    new, opt, metrics = trainer.update(state, opt, seqs, routes, num_groups=len(groups))
    res = flat(process_allgather(new), "trainable")
    res["tokens"] = np.array([o.token_ids + [-1] * (8 - len(o.token_ids)) for o in outs])
    res["rewards"] = rewards
    res["metrics"] = np.array(json.dumps({k: v for k, v in metrics.items() if isinstance(v, float)}))
    res["n_seqs"] = np.array(len(seqs))
    return res


def main() -> int:
    args = parse()
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    info = initialize(args.coordinator, args.num_processes, args.process_id)
    mesh = None
    if info.num_processes > 1 or jax.device_count() > 1:
        mesh = make_mesh(tuple(int(x) for x in args.mesh.split(",")))
    res = (mode_logits if args.mode == "logits" else mode_step)(mesh)
    res["process_count"] = np.array(jax.process_count())
    res["device_count"] = np.array(jax.device_count())
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    np.savez(out / f"process_{info.process_id}.npz", **res)
    print(f"process {info.process_id}/{info.num_processes} ({info.source}) wrote {out}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
