"""SFT step time: MoR vs plain LoRA of the same trainable budget (ours) vs transformers + PEFT, CPU.

SmolLM2-135M-Instruct (the embedded GGUF, float32, real weights). One optimiser step on one
micro-batch of ``--rows`` rendered multi-role trajectories (the synthetic function-calling set,
converted and rendered with SmolLM2's chat template; the first ones that fit), padded to ``--seq``
tokens: forward, role-masked CE over the role-turn tokens, backward through the adapters, global
norm clipping at 1.0, AdamW (lr 5e-5).

* ``ours:mor``: ``morse_jax.sft`` train step with MoRAgent's objective (``mor.objective.sft_loss``:
  CE + 1e-3 balance + 1e-4 orthogonality) and the paper's groups (1+4 / 1+4 / 1+3 LoRAs, top
  3 / 3 / 2, rank 16, q k v o gate up down) on the last ``--layers`` layers.
* ``ours:lora``: the same step with plain LoRA of the same budget (``mor.params.plain_lora_config``:
  one LoRA of rank ≈ MoR's count / a rank-1 LoRA's, same targets and layers, every token).
* ``torch:peft``: transformers (the same GGUF) + a PEFT LoRA of that rank and scale 1 on the same
  modules and layers, forward (``model(...).logits``), the same CE, ``backward``,
  ``clip_grad_norm_``, ``torch.optim.AdamW``.

Adapters start with B = 0 on every side (their FLOPs do not depend on the values). All sides run
in one process, interleaved, so load on the shared machine hits them alike; medians and process
CPU seconds per step; compiles happen before timing.

* ``ours:mor+head-all`` (``--head-all``): MoR's step with the LM head and CE at every position,
  as before the objective gathered the target positions (``SFTBatch.logit_index``, on by default
  in ``ours:mor`` / ``ours:lora`` since 2026-12-05; the figures below dated earlier ran the head
  everywhere).
* ``ours:mor+prefix`` (``--prefix``, needs ``--layers`` below 30): MoR's step on the same batch
  carrying its frozen-prefix states (``moragent.cache_frozen_prefix``): the layers below the
  adapted ones ran once beforehand (their one-time cost is printed, not timed per step).

Usage:  python bench/sft_step.py [--reps 2] [--rows 2] [--seq 512] [--layers 30] [--ours-only] [--prefix]

Goal (issue 18): ours:mor <= 1.5x ours:lora.

Measured 2026-12-03 on the 2 shared cores, load 8-8.4 (other jobs), defaults (2 x 512 tokens, 717
real, 179 targets; all 30 layers; MoR 70.03M trainable, plain LoRA rank 229 69.91M), 2 reps:

  ours:mor    173.1 s [171.7-174.4]  cpu 56.8   1.97x wall, 1.84x cpu of ours:lora
  ours:lora    87.8 s [82.6-93.0]    cpu 30.8
  torch:peft   76.7 s [75.4-78.0]    cpu 22.9   0.87x wall, 0.74x cpu of ours:lora

Re-measured 2026-12-04 (``python bench/sft_step.py --reps 3 --ours-only``, defaults otherwise; the
load of other jobs changes from run to run, so each line is one run's median of 3 alternated reps):

  code                                      load    ours:mor   ours:lora   ratio wall / cpu
  before (13db8a0, sort top-k, autodiff Gram)  ~2      14.39 s    11.19 s     1.29x / 1.34x
  before (13db8a0)                           5-6      31.71 s    27.87 s     1.14x / 1.19x
  group-fused products (0837c36, reverted)  7.5-8.4    51.54 s    44.21 s     1.17x / 1.23x
  after (this version)                      4.6-5.1    30.01 s    24.43 s     1.23x / 1.17x
  after (this version), a second run          5-6     37.15 s    29.55 s     1.26x / 1.18x

So the 1.97x of 2026-12-03 does not reproduce: the same code gives 1.14-1.29x, and the goal
(<= 1.5x) is met before and after. The changes below make no difference measurable through this
noise in the whole step (1.23x and 1.26x wall after vs 1.14-1.29x before). Where MoR's extra time goes (pieces timed alone, fwd+bwd,
SmolLM2 shapes, B x T = 2 x 512): one adapted layer's seven adapters 248 ms (MoR) vs 220 ms (plain
LoRA rank 229); the orthogonality loss over 30 layers ~640 ms (its Gram blocks are 2·(E·r)²·(d_in +
d_out) FLOPs per wrapped linear and role, ~6.4 GFLOP forward at 30 layers); the balance loss ~80 ms. Changes:
the Gram blocks' gradient is written out (one product instead of autodiff's two: 0.58-0.87x of
the autodiff time per target), and top-k is a fused comparison mask (``mor/topk.py``; one layer's
adapters 240 ms vs 248 ms). Fusing each input group's A and router products into one product was
tried and measured slower (330 ms vs 240 ms per layer: the concatenated weights and sliced outputs
cost more than the saved products), so it is not used. With 6 adapted layers (``--layers 6``)
MoR is 1.04x plain LoRA (before). The transformers + PEFT row was not re-run (``--ours-only``).

Frozen-prefix states (``--prefix``), measured 2026-12-05 with ``python bench/sft_step.py --ours-only
--prefix --layers 8 --reps 3`` (the MoRAgent quickstart's 8 adapted layers; two other jobs on
the cores, load 5.9-6.8), median of 3 alternated reps:

  ours:mor          35.48 s   cpu 10.66
  ours:lora         30.72 s   cpu  9.31
  ours:mor+prefix   25.19 s   cpu  7.59   1.41x faster than ours:mor (wall; 1.40x cpu)

after a one-time 38.8 s (compile + run) for the 22 frozen layers of this batch. Less than the
~1.9x that layer counts suggest: the backward through the 8 adapted layers, the LM head and the
CE over 49k logits per token stay in every step.

Target gathering (``--head-all``), 2026-12-05, ``python bench/sft_step.py --ours-only --prefix --head-all
--layers 8 --reps 3`` (three training runs on the cores, load 6.5), median of 3 interleaved reps:

  ours:mor            14.09 s   cpu 7.82   (LM head at the 179 target positions)
  ours:lora           13.11 s   cpu 7.34
  ours:mor+head-all   15.15 s   cpu 9.02   (LM head at all 1024 positions: 1.08x wall, 1.15x cpu slower)
  ours:mor+prefix     10.11 s   cpu 5.80   (prefix states and the gathered head)
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # torch next to XLA's pool on few cores (bench/train_step.py)

import argparse
import statistics
import sys
import time
import warnings
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=2, help="timed steps per side (interleaved)")
    ap.add_argument("--rows", type=int, default=2, help="trajectories per step (one micro-batch)")
    ap.add_argument("--seq", type=int, default=512, help="padded length (trajectories longer are skipped)")
    ap.add_argument("--layers", type=int, default=30, help="adapted layers, the last N (SmolLM2 has 30)")
    ap.add_argument("--ours-only", action="store_true", help="skip transformers + PEFT")
    ap.add_argument("--head-all", action="store_true",
                    help="also time MoR's step with the LM head at every position (before target gathering)")
    ap.add_argument("--prefix", action="store_true",
                    help="add ours:mor+prefix: MoR's step from frozen-prefix states (moragent.cache_frozen_prefix)")
    args = ap.parse_args(argv)
    if args.reps < 1 or args.rows < 1 or args.seq < 2 or args.layers < 1:
        ap.error("need --reps, --rows, --layers >= 1 and --seq >= 2")
    return args


def clock(fn):
    t, c = time.perf_counter(), time.process_time()
    out = fn()
    return out, time.perf_counter() - t, time.process_time() - c


class TorchPeer:
    """transformers + PEFT plain LoRA, the same role-masked CE, clipping and AdamW, float32 on CPU."""

    def __init__(self, path: Path, rank: int, layers: int):
        import torch
        from peft import LoraConfig, get_peft_model
        from transformers import AutoModelForCausalLM
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
        n = model.config.num_hidden_layers
        cfg = LoraConfig(r=rank, lora_alpha=rank, lora_dropout=0.0, layers_to_transform=list(range(n - layers, n)),
                         target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
        self.model = get_peft_model(model, cfg)
        self.model.train()
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.opt = torch.optim.AdamW(self.params, lr=5e-5, weight_decay=0.0)
        self.torch = torch
        self.count = sum(p.numel() for p in self.params)

    def step(self, batch) -> float:
        torch = self.torch
        tokens = torch.from_numpy(np.asarray(batch.tokens[0], np.int64))
        valid = torch.from_numpy(np.asarray(batch.valid[0], np.int64))
        mask = torch.from_numpy(np.asarray(batch.loss_mask[0] & batch.valid[0])[:, 1:].astype(np.float32))
        self.opt.zero_grad(set_to_none=True)
        logits = self.model(input_ids=tokens, attention_mask=valid).logits[:, :-1]
        nll = -torch.log_softmax(logits.float(), -1).gather(-1, tokens[:, 1:, None])[..., 0]
        loss = (nll * mask).sum() / mask.sum().clamp(min=1.0)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.params, 1.0)
        self.opt.step()
        return float(loss)


def main(argv=None) -> int:
    args = parse_args(argv)
    warnings.simplefilter("ignore")
    import jax

    from morse_jax.models import embedded_model_path, load_backbone
    from morse_jax.models.transformer import split_segments
    from morse_jax.mor.config import MoRConfig
    from morse_jax.mor.objective import frozen_prefix
    from morse_jax.mor.params import init_mor_params, param_count, plain_lora_config
    from morse_jax.sft.batching import BucketedData, StepPlan
    from morse_jax.sft.config import SFTConfig
    from morse_jax.sft.data import render
    from morse_jax.sft.objective import mor_objective
    from morse_jax.sft.state import SFTState, make_optimizer
    from morse_jax.sft.trainer import compiled_train_step
    from morse_jax.tasks.bfcl import synthetic
    from morse_jax.tasks.bfcl.trajectories import from_function_calling

    path = embedded_model_path()
    t = time.perf_counter()
    backbone = load_backbone(path)
    model_cfg = backbone.config
    rendered = [render(from_function_calling(r), backbone.tokenizer) for r in synthetic.generate(32, seed=0)]
    fits = [x for x in rendered if len(x.tokens) <= args.seq][:args.rows]
    if len(fits) < args.rows:
        raise SystemExit(f"only {len(fits)} of 32 trajectories fit {args.seq} tokens; raise --seq")
    data = BucketedData(fits, (args.seq,))
    batch = data.batch(StepPlan(args.seq, tuple(range(args.rows))), args.rows, 1)
    n_tok = int(sum(len(x.tokens) for x in fits))
    print(f"# loaded and rendered in {time.perf_counter() - t:.1f} s; {args.rows} trajectories, {n_tok} tokens "
          f"padded to {args.rows} x {args.seq}, {int(np.asarray(batch.loss_mask).sum())} targets", flush=True)

    frozen = split_segments(backbone.params, args.layers)
    mor_cfg = MoRConfig(n_adapt=args.layers)
    lora_cfg = plain_lora_config(model_cfg, mor_cfg)
    sft = SFTConfig(learning_rate=5e-5, warmup_fraction=0.0)
    total = 1000

    def side(mc, step_batch):
        """One optimiser step of a fresh adapter of ``mc`` on ``step_batch``, as a thunk -> loss."""
        step = compiled_train_step(mor_objective(model_cfg, mc), sft, total)
        tx = make_optimizer(sft, total)
        box = {"state": SFTState.create(init_mor_params(jax.random.key(0), model_cfg, mc), tx, jax.random.key(1))}

        def run():
            box["state"], m = step(box["state"], frozen, step_batch)
            return float(jax.block_until_ready(m["loss"]))
        return run

    ours = {}
    plain = BucketedData(fits, (args.seq,), gather_targets=False).batch(StepPlan(args.seq, tuple(range(args.rows))),
                                                                        args.rows, 1)
    for name, mc, b in (("ours:mor", mor_cfg, batch), ("ours:lora", lora_cfg, batch),
                        ("ours:mor+head-all", mor_cfg, plain)):
        if name.endswith("head-all") and not args.head_all:
            continue
        ours[name] = side(mc, b)
        _, first, _ = clock(ours[name])
        print(f"# {name}: {param_count(model_cfg, mc) / 1e6:.2f}M trainable (rank {mc.rank}, {mc.num_loras} LoRAs "
              f"per projection), first step (compile + run) {first:.1f} s", flush=True)
    if args.prefix:
        if args.layers >= model_cfg.num_layers:
            raise SystemExit("--prefix needs --layers below the backbone's layer count (a frozen prefix to keep)")
        prefix_fn = jax.jit(lambda b: frozen_prefix(frozen, b, model_cfg, mor_cfg))
        _, first, _ = clock(lambda: data.compute_prefix_states(prefix_fn, args.rows))
        ours["ours:mor+prefix"] = side(mor_cfg, data.batch(StepPlan(args.seq, tuple(range(args.rows))), args.rows, 1))
        _, first_step, _ = clock(ours["ours:mor+prefix"])
        print(f"# ours:mor+prefix: the {model_cfg.num_layers - args.layers} frozen layers below run once per example "
              f"(compile + run {first:.1f} s for this batch, {data.prefix_bytes / 2**20:.1f} MB kept); first step "
              f"(compile + run) {first_step:.1f} s", flush=True)
    sides = dict(ours)
    if not args.ours_only:
        peer = TorchPeer(path, lora_cfg.rank, args.layers)
        print(f"# torch:peft: {peer.count / 1e6:.2f}M trainable (rank {lora_cfg.rank}), torch threads "
              f"{peer.torch.get_num_threads()}", flush=True)
        clock(lambda: peer.step(batch))  # warm-up
        sides["torch:peft"] = lambda: peer.step(batch)
    wall = {k: [] for k in sides}
    cpu = {k: [] for k in sides}
    for _ in range(args.reps):
        for k, fn in sides.items():
            _, w, c = clock(fn)
            wall[k].append(w)
            cpu[k].append(c)
        print("#   rep: " + ", ".join(f"{k} {wall[k][-1]:.2f} s" for k in sides)
              + f"; load {os.getloadavg()[0]:.1f}", flush=True)
    med = statistics.median
    base = "ours:lora"
    print(f"SFT step, {args.rows} x {args.seq} tokens, last {args.layers} layers adapted; s/step median [min-max], "
          f"process CPU s/step median; ratio = side / {base}:")
    for k in sides:
        print(f"  {k:15s} {med(wall[k]):7.2f} [{min(wall[k]):.2f}-{max(wall[k]):.2f}]  cpu {med(cpu[k]):6.2f}"
              f"   {med(wall[k]) / med(wall[base]):.2f}x wall, {med(cpu[k]) / med(cpu[base]):.2f}x cpu", flush=True)
    print(f"goal ours:mor <= 1.5x ours:lora: {'met' if med(wall['ours:mor']) <= 1.5 * med(wall[base]) else 'NOT met'} "
          f"(wall)")
    return 0


if __name__ == "__main__":
    from morse_jax.run.allocator import reexec_with_allocator

    reexec_with_allocator()  # both sides under one malloc: MORSE_JAX_MALLOC
    sys.exit(main())
