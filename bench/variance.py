"""Prop 3.1 measured: variance of the LoRA-expert gradient estimator, HGRPO within-route vs flat GRPO advantages.

    python bench/variance.py [--workdir runs/learn_cpu_D] [--nodes 6 --routes 2 --pool 12 --group 4]

On the same rollouts: for each of ``--nodes`` execute nodes of PyFuncs TRAIN tasks, ``--routes`` routes
are drawn from the router and ``--pool`` answers sampled per route at the training temperature
(configs/learn_cpu.py:D, experts from the checkpoint in ``--workdir`` if there is one), scored by
the verifier, and each answer's score function g = d/dPhi sum_t log p(y_t) (the whole expert bank
Phi, read at ``--coords`` fixed random coordinates) is computed with the real model. Then, many
times (``--resamples``), each route's group of ``--group`` answers is redrawn from its pool with
replacement and the expert gradient estimator sum_{b,m} A[b,m] g[b,m] / (B M) is formed with
HGRPO's within-route advantages and with flat GRPO advantages (``morse_jax.rl.hgrpo``'s registry:
``get_advantage_fn("hgrpo").within`` and ``get_advantage_fn("grpo").within``), both unnormalised
(the estimator Prop 3.1 is stated for) and normalised (the implemented one, Corollary G.1). The
variance is the trace of the estimator's covariance over resamplings, summed over nodes; the
ratio HGRPO / flat comes with a 95 % bootstrap interval over the resamplings. Prop 3.1 predicts < 1.

Untrained experts (B = 0) make every route the same policy, so the cross-route variance is only
sampling noise: ``--perturb S`` adds N(0, S^2) to the B matrices to give routes different policies
(reported in the output); a trained checkpoint needs none.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def estimator_variance(rewards: np.ndarray, grads: np.ndarray, idx: np.ndarray, advantage, *,
                       normalize: bool) -> tuple[np.ndarray, np.ndarray]:
    """Estimates of one node over resamplings.

    Args:
      rewards: float[B, P] each route's pool of rewards; grads: float[B, P, D] their score functions.
      idx: int[R, B, M] the resampled pool indices; advantage: fn(rewards[R, B, M]) -> HGRPOAdvantages.
    Returns:
      (estimates float[R, D] = sum_{b,m} A[b,m] g[b,m] / (B M), squared deviations float[R] from their mean).
    """
    R, B, M = idx.shape
    u = np.take_along_axis(np.broadcast_to(rewards, (R, *rewards.shape)), idx, axis=2)  # [R, B, M]
    adv = np.asarray(advantage(u, normalize=normalize).within)  # [R, B, M]
    g = grads[np.arange(B)[None, :, None], idx]  # [R, B, M, D]
    est = np.einsum("rbm,rbmd->rd", adv, g) / (B * M)
    dev = ((est - est.mean(0)) ** 2).sum(1)
    return est, dev


def ratio_with_ci(dev_h: np.ndarray, dev_f: np.ndarray, *, boots: int = 2000, seed: int = 0) -> tuple[float, float, float]:
    """ratio = sum(dev_h) / sum(dev_f) over [nodes, R] deviations, with a 95 % bootstrap interval
    (resampling the R resamplings of every node jointly for both estimators)."""
    rng = np.random.default_rng(seed)
    if dev_f.sum() == 0:  # every pool constant: no estimator varies, there is nothing to compare
        return float("nan"), float("nan"), float("nan")
    ratio = float(dev_h.sum() / dev_f.sum())
    R = dev_h.shape[1]
    out = []
    for _ in range(boots):
        j = rng.integers(0, R, R)
        den = dev_f[:, j].sum()
        if den > 0:
            out.append(dev_h[:, j].sum() / den)
    lo, hi = np.percentile(out, [2.5, 97.5])
    return ratio, float(lo), float(hi)


def collect(args):
    """Rollouts with rewards and projected score functions: list of (rewards[B, P], grads[B, P, D])."""
    import jax
    import jax.numpy as jnp

    from morse_jax.run.build import Job
    from morse_jax.mole.experts import execute_set
    from morse_jax.rl.examples import SequenceExample
    from morse_jax.rl.batch import pad_sequences
    from morse_jax.rl.logprobs import sequence_logprobs
    from morse_jax.sampling.sampler import Request
    from morse_jax.tasks.pyfuncs.family import PyFuncsFamily
    from morse_jax.tasks.pyfuncs.data import SOLVE, load_split

    spec_ = importlib.util.spec_from_file_location("learn_cpu", ROOT / "configs/learn_cpu.py")
    mod = importlib.util.module_from_spec(spec_)
    spec_.loader.exec_module(mod)
    cfg = mod.get_config("D")
    cfg.mode, cfg.workdir, cfg.seed = "eval", args.workdir, args.seed
    job = Job(cfg, load_tasks=False)
    loaded = job.restore()
    if args.perturb > 0:
        key = jax.random.key(args.seed + 1)
        b = job.trainable["bank"]["b"]
        keys = jax.random.split(key, len(b))
        job.trainable["bank"]["b"] = {t: v + args.perturb * jax.random.normal(k, v.shape, v.dtype)
                                      for k, (t, v) in zip(keys, sorted(b.items()))}
    fam = PyFuncsFamily()
    nodes = []
    for t in load_split("train", 4 * args.nodes):
        for n in fam.fixed_plan(t).nodes:
            if n.id != SOLVE and len(nodes) < args.nodes:
                nodes.append((t, n))
    spec = job.spec
    leaves, treedef = jax.tree.flatten(job.trainable["bank"])
    sizes = [int(np.prod(x.shape)) for x in leaves]
    coords = np.sort(np.random.default_rng(args.seed).choice(sum(sizes), size=min(args.coords, sum(sizes)), replace=False))
    frozen, mcfg = job.backbone.params, job.backbone.config

    def total_logp(bank, batch):
        return sequence_logprobs(frozen, mcfg, spec, bank, batch).sum()

    grad_fn = jax.jit(jax.grad(total_logp))
    out = []
    t0 = time.time()
    for t, n in nodes:
        draw = job.route([n.description], num_samples=args.routes, greedy=False)
        msgs = fam.execute_messages(t, n, "", None)
        prefix = fam.answer_prefix(t, n, "execute")
        ids = job.encode([*msgs, {"role": "assistant", "content": prefix}])
        routes = [tuple(int(k) for k in draw.members[0, s]) for s in range(args.routes)]
        actives = [execute_set(spec, r) for r in routes]
        reqs = [Request(prompt_ids=ids, expert_ids=tuple(e for e, _ in a), expert_weights=tuple(w for _, w in a),
                        max_new_tokens=cfg.rollout.max_new_tokens, temperature=cfg.rollout.temperature,
                        top_p=cfg.rollout.top_p, stop_token_ids=job.stop_ids)
                for a in actives for _ in range(args.pool)]
        comps = job.generate(reqs)
        rewards = np.zeros((args.routes, args.pool))
        grads = np.zeros((args.routes, args.pool, len(coords)), np.float32)
        for j, c in enumerate(comps):
            b, p = divmod(j, args.pool)
            rewards[b, p] = fam.verify(t, n, fam.extract_artifact(t, n, prefix + c.text)).reward
            ex = SequenceExample(ids, list(c.token_ids), np.asarray(c.logprobs, np.float32),
                                 reqs[j].expert_ids, reqs[j].expert_weights, 0.0)
            batch = pad_sequences([ex], rows=1, length_buckets=(256, 384, 512, 768, 1024), max_active=spec.max_active)
            g = grad_fn(job.trainable["bank"], jax.tree.map(jnp.asarray, batch))
            flat = np.concatenate([np.asarray(x, np.float32).ravel() for x in jax.tree.leaves(g)])
            grads[b, p] = flat[coords]
        print(f"node {t.task_id}/{n.id} routes {routes}: route mean rewards "
              f"{np.round(rewards.mean(1), 3).tolist()} ({time.time() - t0:.0f}s)", flush=True)
        out.append((rewards, grads))
    return out, loaded


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workdir", default="runs/learn_cpu_D", help="a D run's work directory (its checkpoint is used)")
    ap.add_argument("--nodes", type=int, default=6)
    ap.add_argument("--routes", type=int, default=2, help="B")
    ap.add_argument("--pool", type=int, default=12, help="answers sampled per route (the pool groups are drawn from)")
    ap.add_argument("--group", type=int, default=4, help="M: answers per route in one group")
    ap.add_argument("--resamples", type=int, default=2000)
    ap.add_argument("--coords", type=int, default=20000, help="random coordinates of the expert bank read")
    ap.add_argument("--perturb", type=float, default=0.0, help="std of noise added to the B matrices")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="", help="also write the figures as JSON here")
    args = ap.parse_args(argv)
    from morse_jax.run.session import quiet_logs
    from morse_jax.rl.hgrpo import get_advantage_fn

    quiet_logs()
    data, loaded = collect(args)
    rng = np.random.default_rng(args.seed)
    res = {"experts": loaded, "perturb": args.perturb, "nodes": len(data), "B": args.routes, "M": args.group,
           "pool": args.pool, "resamples": args.resamples}
    skipped_all = sum(float(np.std(r)) == 0.0 for r, _ in data)
    res["nodes_with_constant_rewards"] = skipped_all
    for normalize in (False, True):
        dev_h, dev_f = [], []
        for rewards, grads in data:
            idx = rng.integers(0, args.pool, (args.resamples, args.routes, args.group))
            dev_h.append(estimator_variance(rewards, grads, idx, get_advantage_fn("hgrpo"), normalize=normalize)[1])
            dev_f.append(estimator_variance(rewards, grads, idx, get_advantage_fn("grpo"), normalize=normalize)[1])
        ratio, lo, hi = ratio_with_ci(np.array(dev_h), np.array(dev_f), seed=args.seed)
        name = "normalised" if normalize else "unnormalised"
        res[name] = {"ratio": ratio, "ci95": [lo, hi], "var_hgrpo": float(np.sum(dev_h) / args.resamples),
                     "var_flat": float(np.sum(dev_f) / args.resamples)}
        print(f"variance ({name} advantages): HGRPO / flat GRPO = {ratio:.3f} (95% CI {lo:.3f}-{hi:.3f})", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=2))
    if skipped_all == len(data):
        print("variance: n/a -- every sampled reward of every node was equal (no estimator varies); "
              "use more nodes, a larger --pool or trained experts")
        return 1
    print(f"variance: HGRPO / flat GRPO LoRA-expert gradient variance ratio {res['unnormalised']['ratio']:.3f} "
          f"(95% CI {res['unnormalised']['ci95'][0]:.3f}-{res['unnormalised']['ci95'][1]:.3f}; normalised "
          f"{res['normalised']['ratio']:.3f}) over {len(data)} nodes, B={args.routes}, M={args.group}; experts: {loaded}"
          f"{f', B perturbed by {args.perturb}' if args.perturb else ''}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
