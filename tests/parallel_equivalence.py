"""Sharded vs single-device results on a tiny random model (run by tests/test_parallel.py).

    python tests/parallel_equivalence.py --meshes 2,2,2 8,1,1 --parts logits,sampler,update

Forces 8 host CPU devices (unless XLA_FLAGS already sets a count), computes backbone logits,
greedy sampler outputs and one Trainer update on one device, then on each mesh, and prints one
JSON object: per mesh the largest differences plus evidence that the work really was sharded
(the specs the arrays carried). The caller judges the numbers.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from morse_jax.models import logits  # noqa: E402
from morse_jax.parallel import make_mesh, replicate, sharded_logits  # noqa: E402
from morse_jax.rl.update import Trainer  # noqa: E402
from morse_jax.sampling.sampler import Sampler  # noqa: E402
from parallel_common import (CFG, SAMPLER, SPEC, TRAIN, backbone, examples, requests, trainable0,  # noqa: E402
                             with_prefix_states)


def run_logits(bb, mesh, tokens):
    if mesh is None:
        return np.asarray(logits(bb, tokens)), None
    fn = sharded_logits(mesh, bb)
    out = fn(tokens)
    return np.asarray(out), {"logits": str(out.sharding.spec),
                             "q_kernel": str(fn.params["layers"][0]["q"]["kernel"].sharding.spec),
                             "embed": str(fn.params["embed"].sharding.spec)}


def run_sampler(bb, mesh, bank, sizes):
    s = Sampler(bb, SPEC, SAMPLER, mesh=mesh)
    outs = [s.generate(bank, requests(n), key=jax.random.key(3)) for n in sizes]
    info = None
    if mesh is not None:
        info = {"qkv_w": str(s.params["layers"][0]["qkv"]["w"].sharding.spec), "programs": s.compile_count}
    return outs, info


def run_update(bb, mesh, states=False):
    tr = Trainer(CFG, bb.params, SPEC, TRAIN, mesh=mesh)
    t = jax.tree.map(jnp.asarray, trainable0())
    if mesh is not None:
        t = replicate(mesh, t)
    opt = tr.init_opt_state(t)
    seqs, routes = examples()
    if states:  # the update starts at the adapted layer from the examples' prefix states
        seqs = with_prefix_states(bb, seqs)
    new, opt, metrics = tr.update(t, opt, seqs, routes, num_groups=3)
    info = None
    if mesh is not None:
        info = {"frozen_q_kernel": str(tr.frozen["layers"][-1]["q"]["kernel"].sharding.spec)}
    return jax.tree.map(np.asarray, new), metrics, info


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--meshes", nargs="+", default=["2,2,2"])
    ap.add_argument("--parts", default="logits,sampler,update,update_states")
    ap.add_argument("--sampler-sizes", default="8", help="request counts per generate call, e.g. 8,3 "
                    "(3 rows: a batch bucket of 4 that the data axis of (8,1,1) does not divide)")
    args = ap.parse_args()
    parts = set(args.parts.split(","))
    meshes = [tuple(int(x) for x in m.split(",")) for m in args.meshes]
    sizes = tuple(int(x) for x in args.sampler_sizes.split(","))
    bb = backbone()
    bank = jax.tree.map(jnp.asarray, trainable0()["bank"])
    tokens = np.random.default_rng(2).integers(0, 64, (8, 12))
    t0 = time.time()
    ref = {}
    if "logits" in parts:
        ref["logits"] = run_logits(bb, None, tokens)[0]
    if "sampler" in parts:
        ref["sampler"] = run_sampler(bb, None, bank, sizes)[0]
    if "update" in parts:
        ref["update"] = run_update(bb, None)
    if "update_states" in parts:
        ref["update_states"] = run_update(bb, None, states=True)
    result = {"devices": jax.device_count(), "reference_s": round(time.time() - t0, 1), "meshes": []}
    old = trainable0()
    for shape in meshes:
        t0 = time.time()
        mesh = make_mesh(shape)
        r: dict = {"mesh": list(shape), "specs": {}}
        if "logits" in parts:
            out, info = run_logits(bb, mesh, tokens)
            r["logits_max_abs"] = float(np.abs(out - ref["logits"]).max())
            r["logits_scale"] = float(np.abs(ref["logits"]).max())
            r["specs"].update(info)
        if "sampler" in parts:
            outs, info = run_sampler(bb, mesh, bank, sizes)
            pairs = [(a, b) for ra, rb in zip(ref["sampler"], outs) for a, b in zip(ra, rb)]
            r["sampler_tokens_equal"] = all(a.token_ids == b.token_ids for a, b in pairs)
            r["sampler_n_tokens"] = sum(len(a.token_ids) for a, _ in pairs)
            r["sampler_logprob_max_abs"] = max(float(np.abs(a.logprobs - b.logprobs).max()) for a, b in pairs)
            r["sampler_states_max_abs"] = max(float(np.abs(a.prefix_states - b.prefix_states).max()) for a, b in pairs)
            r["specs"].update(info)
        if "update" in parts:
            new, metrics, info = run_update(bb, mesh)
            ref_new, ref_metrics, _ = ref["update"]
            diff = jax.tree.map(lambda a, b: float(np.abs(a - b).max()), ref_new, new)
            step = jax.tree.map(lambda a, b: float(np.abs(a - b).max()), ref_new, old)
            r["update_param_max_abs"] = max(jax.tree.leaves(diff))
            r["update_step_min_of_max"] = min(jax.tree.leaves(step))  # every leaf moved by about this much
            r["update_metrics"] = {k: [ref_metrics[k], metrics[k]] for k in ("lora_loss", "grad_norm", "router_loss")}
            r["specs"].update(info)
        if "update_states" in parts:
            new, metrics, _ = run_update(bb, mesh, states=True)
            ref_new, ref_metrics, _ = ref["update_states"]
            diff = jax.tree.map(lambda a, b: float(np.abs(a - b).max()), ref_new, new)
            r["update_states_param_max_abs"] = max(jax.tree.leaves(diff))
            if "update" in parts:  # starting from the states equals running the whole model
                whole = jax.tree.map(lambda a, b: float(np.abs(a - b).max()), ref["update"][0], new)
                r["update_states_vs_whole_max_abs"] = max(jax.tree.leaves(whole))
        r["seconds"] = round(time.time() - t0, 1)
        result["meshes"].append(r)
        print(f"mesh {shape} done in {r['seconds']}s", file=sys.stderr, flush=True)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
