"""HGRPO update-step time: morse_jax ``Trainer.update`` vs transformers + PEFT (torch), CPU.

SmolLM2-135M-Instruct (the embedded GGUF, float32). One update over one HGRPO group of
B x M = 4 x 4 = 16 candidates of 384 tokens: one 200-token prompt (a window of the repo's own
source; ``--distinct-prompts`` gives every candidate its own), each candidate its own 184-token
completion; PPO-clip token loss weighted by HGRPO within-route advantages of random rewards,
behaviour log-probs = current policy + noise (ratios near 1, ~2 % clipped); AdamW (lr 8e-5,
weight decay 0.01) after global-norm clipping at 1.0.

Ours: ``morse_jax.rl.update.Trainer.update`` with the default bank (2 role + 4 subtask experts,
rank 8, alpha 16, q/v/o of the last 8 layers), a different active set per route (role expert +
2 subtask experts), plus the router loss over the 4 sampled routes (a few ms). As in a training
run, each sequence carries the sampler's prefix states (the residual stream entering layer 22,
the first adapted one; ``SamplerConfig.return_prefix_states``), so the update runs layers 22-29
only. The bench computes those states with a forward through layers 0-21 before timing, because
its completions are not sampled (the sampler's states equal that forward within 1e-5,
tests/test_prefix_states.py; capturing them left the sampler's batch-16 decode rate unchanged,
194.6 vs 199.7 tok/s, within noise). ``ours:recompute`` is the same update with
``reuse_prefix_states=False`` (all 30 layers), timed alongside.
transformers: the same GGUF loaded by transformers (``gguf_file=``), a PEFT LoRA (r=8, alpha=16,
q_proj/v_proj/o_proj of the last 8 layers), forward + the same PPO-clip loss + backward through
the LoRA + ``clip_grad_norm_`` + AdamW; each candidate as a whole prompt + completion row, same
micro-batches (8 rows), same behaviour log-probs and advantages. Two variants, both timed:
``torch:all`` takes ``model(...).logits`` and log_softmax at every position (a plain PEFT loop,
and the authors' code); ``torch:generated`` runs the LM head on the completion positions only
(what TRL's ``logits_to_keep`` buys). Both banks have non-zero B, so the adapters do real work.

The sides take turns (ours, torch:all, torch:generated, ours, ...), so load on the shared machine
hits them alike; medians, [min-max], and process CPU seconds per step (steadier than wall time
when other jobs hold the cores). Each library runs in its own process, as it would for a user:
transformers runs in a child process that steps on request (``--peer-in-process``: in ours, as
before 2026-12-07). In one process the two runtimes slowed each other: after a torch step our
update's kernel time for first-touching its fresh temporary buffers (~1M page faults per
update) rose from ~3 to 6-12 CPU-s, and torch's steps were slower too. Compile time (trace + lowering + XLA
compile of everything the first update builds, from jax.monitoring) is reported separately and
never counted in the step time.

Usage:  python bench/train_step.py [--reps 3] [--rows 16] [--seq 384] [--prompt 200,200]
        [--distinct-prompts] [--micro-batch 8] [--ours-only] [--no-recompute]
        [--torch-logits all,generated] [--train-config "dict(share_prompts=False)"]
        MORSE_JAX_MALLOC=system|tcmalloc|jemalloc picks both sides' malloc (default tcmalloc where
        installed; the script re-executes itself with it preloaded, the peer's child inherits it:
        morse_jax/run/allocator.py).

Measured on this machine (2 shared cores), starting from the sampler's prefix states, load 1.2-2:

                                ours          ours:recompute      torch:all          torch:generated
  shared prompt (default)       9.6 s/17.3    14.7 s/26.9 1.53x   29.5 s/51.0 3.07x  22.4 s/40.3 2.33x
  distinct prompts              16.0 s/28.1   -                   32.5 s/50.9 2.03x  22.6 s/39.9 1.41x
  (wall median / process CPU s per step; ratio = theirs / ours by wall; CPU ratios 2.95x / 2.34x
  and 1.81x / 1.42x.) The 2x target is met against the plain PEFT loop in both layouts and
  against the TRL-style loop with the shared prompt of an HGRPO group (the bench's default,
  what every update sees); with a distinct prompt per candidate the TRL-style loop is 1.4x.

On the AVX2-only host (2026-12-07; no AVX-512; shared prompt, --reps 3 --no-recompute; wall
median [min-max] / process CPU s per step; ratio = theirs / ours by wall):

  code, peer placement                       ours                  torch:all      torch:generated
  74aed7e (before), peer in-process (x2)     13.9 / 13.6 s         2.35x / 2.37x  1.79x / 1.67x
  74aed7e, same process, rerun today         14.3 s [11.6-15.1]    2.18x          1.70x
  74aed7e, peer in its own process           11.7 s [10.2-12.8]    2.38x          1.56x (18.2 s)
  bb85333 (head_logprobs), own process       9.8 s [8.9-10.1]/18.8 2.89x          2.28x (22.4 s)
  bb85333, peer in-process                   9.3 s [8.9-11.9]/18.0 2.93x          1.97x (18.4 s)
  bb85333, own process, second run           8.8 s [8.5-8.9]/16.9  2.82x          2.12x (18.6 s)
  9bb7f3a (same update code), own process    10.1 s [9.5-11.0]/19.1 3.12x         2.27x (22.9 s)
  The peer's own times swing 16.5-25.7 s between runs; ours alone (one process, no torch) ran
  8.9-12.6 s at 74aed7e (five runs) and 9.9-12.1 s at bb85333 (two runs, alternated with two of them), so the head change
  shows in the bench (fewer page faults next to torch) more than alone.

Before prefix states (whole model in the update; 2 shared cores, other jobs kept the load at 2-5):

                                      ours          torch:all           torch:generated
  shared prompt (default), load 2-3   13.5 s/25.2   25.0 s/45.3 1.86x   20.6 s/37.5 1.53x
  shared prompt, load 4-5             24.6 s/23.3   38.8 s/36.9 1.58x   31.9 s/30.2 1.30x
  shared prompt, P=190, load 3-4      26.2 s/26.9   44.8 s/45.7 1.71x   33.2 s/37.2 1.27x
  distinct prompts, load 2            20.7 s/38.6   26.4 s/47.7 1.28x   21.1 s/38.4 1.02x
  (wall median / process CPU s per step; ratio = theirs / ours by wall, >1: ours faster; CPU
  ratios within 0.15 of the wall ones; rep ranges within +-10 %. With P=190 the 194-token
  completions pad to the 224 bucket.)
  Compile (ours, first update): 6-21 s depending on load; the behaviour log-prob pass compiles
  separately before (15-23 s including one forward).
  The 2x target is not met: 1.6-1.9x against the plain PEFT loop, 1.3-1.5x against the
  TRL-style one, parity when no prompt is shared. What is left is FLOPs, not overhead (below).

  Changes, ours only, same inputs, interleaved (CPU s per update, median of 3; wall on the
  quietest rep): the update as it was (flat rows, full-vocab log_softmax at all 384 positions)
  43.7 (22.7 s) -> LM head only at generated positions, as logit[target] - logsumexp 37.0
  (19.7 s) -> prompt shared per (prompt, active set), i.e. run 4x per group, not 16x
  24.1 (13.7 s): 1.8x in all.
  Profile findings:
  * The frozen prefix is never differentiated: in the gradient's jaxpr the 22-layer scan appears
    once per forward pass and only the 8-layer scan is transposed (no stop_gradient needed; XLA
    keeps no prefix activations).
  * XLA's dots run at ~70 GFLOP per CPU-second here (LM head [1536,576]x[576,49152] fwd+bwd
    2.4 CPU-s), the same per FLOP as torch (distinct-prompt row above: equal work, equal CPU).
  * No gain (within noise): layer scan vs unrolled (28.4 vs 28.8 CPU-s), micro-batch 8 vs 16
    (28.5 vs 29.4), gather vs one-hot LoRA composition (28.8 vs 27.9), head via embed.T vs
    embed without transpose vs an optimization barrier (2.4-2.6 CPU-s).
  * Full-vocab log_softmax instead of logsumexp: 2.95 vs 2.37 CPU-s for 1536 positions.
  * Where the shared-prompt update goes now: the 22 frozen layers' forward ~35 %, the 8 adapted
    layers forward + backward ~40 % (the backward ~1.5x the forward's CPU: attention-probability
    residuals and their zero-initialised stacked buffers under the layer scan), the LM head ~25 %.
    The same update on a model cut to the last 8 layers takes 16-18 CPU-s vs 28-30 for all 30:
    starting the trainer at the adapter boundary from the layer-22 residual stream (which the
    sampler computes anyway, with the same frozen weights) -- now done, table above.
"""

from __future__ import annotations

import os

# torch's OpenMP threads spin-wait between ops; next to XLA's thread pool on a small shared
# machine that made transformers several times slower. Passive waiting is what a fair peer gets.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse
import dataclasses
import statistics
import sys
import time
import warnings
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

B_ROUTES, M_CANDS = 4, 4


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog="See the module docstring for results.")
    ap.add_argument("--reps", type=int, default=3, help="timed repetitions per side (interleaved)")
    ap.add_argument("--rows", type=int, default=B_ROUTES * M_CANDS, help="sequences per update (multiple of 4)")
    ap.add_argument("--seq", type=int, default=384, help="tokens per sequence (prompt + completion)")
    ap.add_argument("--prompt", default="200,200", help="prompt length range lo,hi (inclusive), drawn per group")
    ap.add_argument("--distinct-prompts", action="store_true",
                    help="every candidate its own prompt (no prompt sharing possible; default: one per group)")
    ap.add_argument("--micro-batch", type=int, default=None, help="rows per micro-batch, both sides "
                    "(default: TrainConfig.micro_batch)")
    ap.add_argument("--train-config", default="dict()", help="TrainConfig overrides, a Python dict literal")
    ap.add_argument("--torch-logits", default="all,generated",
                    help="comma list of transformers variants, each timed: 'all' = LM head + log_softmax over "
                         "every position (model(...).logits, as a plain PEFT loop does), 'generated' = over the "
                         "completion positions only (hidden states gathered first; what TRL's logits_to_keep buys)")
    ap.add_argument("--ours-only", action="store_true")
    ap.add_argument("--peer-in-process", action="store_true",
                    help="run transformers in this process (default: in a child process of its own)")
    ap.add_argument("--no-recompute", action="store_true",
                    help="skip 'ours:recompute' (the update running all layers instead of starting from the "
                         "sampler's prefix states)")
    args = ap.parse_args(argv)
    lo, hi = (int(x) for x in args.prompt.split(","))
    args.torch_logits = [v for v in args.torch_logits.split(",") if v]
    if set(args.torch_logits) - {"all", "generated"}:
        ap.error("--torch-logits takes 'all' and/or 'generated'")
    if args.reps < 1 or args.rows < 1 or args.rows % B_ROUTES or not 1 <= lo <= hi < args.seq:
        ap.error("need --reps >= 1, --rows a positive multiple of 4, 1 <= prompt lo <= hi < --seq")
    args.prompt_range = (lo, hi)
    return args


def timed(fn):
    t = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t


# --------------------------------------------------------------------------- inputs


def build_examples(bb, spec, args, rng):
    """HGRPO groups of 4 routes x 4 candidates over windows of the repo's own source: all 16
    candidates of a group answer one prompt (``--distinct-prompts``: each its own), each route
    has its own active set (role expert + 2 subtask experts); advantages from ``hgrpo_advantages``
    on random rewards; behaviour log-probs filled in later (``with_behaviour``)."""
    from morse_jax.mole.experts import execute_set
    from morse_jax.rl.examples import RouteExample, SequenceExample
    from morse_jax.rl.hgrpo import hgrpo_advantages

    src = "\n".join(p.read_text() for p in sorted((Path(__file__).resolve().parents[1] / "morse_jax").rglob("*.py")))
    corpus = bb.tokenizer(src, add_special_tokens=False)["input_ids"]
    groups = args.rows // (B_ROUTES * M_CANDS) or 1
    routes_per_group = min(B_ROUTES, args.rows // M_CANDS)
    pairs = [(0, 1), (2, 3), (1, 2), (0, 3)]
    seqs, routes = [], []
    for g in range(groups):
        rewards = rng.uniform(size=(routes_per_group, M_CANDS)).astype(np.float32)
        adv = hgrpo_advantages(rewards)
        within, cross = np.asarray(adv.within), np.asarray(adv.cross)
        P = int(rng.integers(args.prompt_range[0], args.prompt_range[1] + 1))
        prompt = corpus[100_003 * g % len(corpus):][:P]
        for b in range(routes_per_group):
            s = execute_set(spec, pairs[b % len(pairs)])
            for m in range(M_CANDS):
                i = len(seqs)
                window = corpus[997 * i: 997 * i + args.seq]
                if args.distinct_prompts:
                    P = int(rng.integers(args.prompt_range[0], args.prompt_range[1] + 1))
                    prompt = window[:P]
                seqs.append(SequenceExample(prompt, window[P:], np.zeros(args.seq - P, np.float32),
                                            [e for e, _ in s], [w for _, w in s], float(within[b, m])))
            routes.append(RouteExample(prompt[:64], pairs[b % len(pairs)], float(np.log(1 / 6)), float(cross[b])))
    return seqs, routes, groups


def with_behaviour(seqs, logps, rng):
    """Behaviour log-probs = current policy + small noise, so PPO ratios sit near 1 with some clipping."""
    import dataclasses

    return [dataclasses.replace(s, behaviour_logprobs=(lp + rng.normal(0, 0.1, lp.shape)).astype(np.float32))
            for s, lp in zip(seqs, logps)]


def with_prefix_states(trainer, seqs, rows: int = 8):
    """Each sequence's residual stream entering the first adapted layer: what the sampler returns
    (``SamplerConfig.return_prefix_states``; equal to this forward within 1e-5, see
    tests/test_prefix_states.py), computed here because the bench's completions are not sampled."""
    import dataclasses

    import jax

    from morse_jax.models.transformer import forward

    cfg, start = trainer.model_cfg, trainer.start_layer
    prefix = jax.jit(lambda p, t, v: forward(p, cfg, t, valid=v, stop_layer=start)[0])
    out = []
    for i in range(0, len(seqs), rows):
        chunk = seqs[i:i + rows]
        L = max(len(s.prompt_ids) + len(s.completion_ids) for s in chunk)
        tokens, valid = np.zeros((len(chunk), L), np.int32), np.zeros((len(chunk), L), bool)
        for r, s in enumerate(chunk):
            n = len(s.prompt_ids) + len(s.completion_ids)
            tokens[r, :n], valid[r, :n] = list(s.prompt_ids) + list(s.completion_ids), True
        states = np.asarray(prefix(trainer.frozen, tokens, valid))
        out += [dataclasses.replace(s, prefix_states=states[r, :int(valid[r].sum())]) for r, s in enumerate(chunk)]
    return out


# --------------------------------------------------------------------------- transformers


class TorchPeer:
    """transformers + PEFT LoRA, the same PPO-clip loss and AdamW, float32 on CPU."""

    def __init__(self, path: Path, tcfg):
        import torch
        from peft import LoraConfig, get_peft_model
        from transformers import AutoModelForCausalLM

        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        t = time.perf_counter()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
        n_layers = model.config.num_hidden_layers
        cfg = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "o_proj"],
                         layers_to_transform=list(range(n_layers - 8, n_layers)), lora_dropout=0.0)
        model = get_peft_model(model, cfg)
        model.train()  # no dropout anywhere in SmolLM2; train() only sets autograd-relevant flags
        gen = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name:  # PEFT initialises B = 0: make the adapter do real work
                    p.copy_(0.02 * torch.randn(p.shape, generator=gen))
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.opt = torch.optim.AdamW(self.params, lr=tcfg.lora_lr, weight_decay=tcfg.weight_decay)
        self.model, self.torch, self.tcfg = model, torch, tcfg
        self.load_s = time.perf_counter() - t
        self.threads = torch.get_num_threads()

    def _logp(self, tokens, valid, targets, mask, logits_at):
        torch = self.torch
        if logits_at == "all":
            logits = self.model(input_ids=tokens, attention_mask=valid).logits
            return torch.log_softmax(logits.float(), -1).gather(-1, targets[..., None])[..., 0] * mask
        # hidden states of the base model (LoRA inside), LM head only where a token was generated
        hidden = self.model.base_model.model.model(input_ids=tokens, attention_mask=valid).last_hidden_state
        sel = mask.bool()
        logits = self.model.base_model.model.lm_head(hidden[sel])
        lp = torch.log_softmax(logits.float(), -1).gather(-1, targets[sel][:, None])[:, 0]
        out = torch.zeros_like(mask)
        out[sel] = lp
        return out

    def step(self, batches, logits_at: str) -> dict:
        """One update over the padded micro-batches (``SequenceBatch``es from ``pad_sequences``, or
        any objects with their numpy fields: tokens, valid, targets, target_mask, old_logp,
        advantages)."""
        torch, c = self.torch, self.tcfg
        self.opt.zero_grad(set_to_none=True)
        total, nll, ntok = 0.0, 0.0, 0.0
        for b in batches:
            tokens = torch.from_numpy(b.tokens.astype(np.int64))
            valid = torch.from_numpy(b.valid.astype(np.int64))
            targets = torch.from_numpy(b.targets.astype(np.int64))
            mask = torch.from_numpy(b.target_mask)
            old = torch.from_numpy(b.old_logp)
            adv = torch.from_numpy(b.advantages)[:, None]
            new = self._logp(tokens, valid, targets, mask, logits_at)
            ratio = torch.exp(new - old)
            eps_hi = c.ppo_eps if c.ppo_eps_high is None else c.ppo_eps_high
            surr = torch.minimum(ratio * adv, torch.clamp(ratio, 1 - c.ppo_eps, 1 + eps_hi) * adv)
            loss = -((surr * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).sum()
            loss.backward()
            total += float(loss)
            nll -= float((new.detach() * mask).sum())
            ntok += float(mask.sum())
        if c.max_grad_norm:
            torch.nn.utils.clip_grad_norm_(self.params, c.max_grad_norm)
        self.opt.step()
        return {"lora_loss": total, "token_nll": nll / max(ntok, 1.0)}


def peer_fields(batch):
    """The numpy fields ``TorchPeer.step`` reads, as a plain namespace (pickles without jax)."""
    import types

    return types.SimpleNamespace(**{k: np.asarray(getattr(batch, k)) for k in
                                    ("tokens", "valid", "targets", "target_mask", "old_logp", "advantages")})


def _peer_main(conn, path: str, tcfg) -> None:
    """Child process: load the peer, then answer ("step", batches, variant) with
    (metrics, wall s, process CPU s) until ("stop",)."""
    peer = TorchPeer(Path(path), tcfg)
    conn.send((peer.load_s, peer.threads))
    while True:
        msg = conn.recv()
        if msg[0] == "stop":
            return
        _, batches, variant = msg
        t, c = time.perf_counter(), time.process_time()
        m = peer.step(batches, variant)
        conn.send((m, time.perf_counter() - t, time.process_time() - c))


class PeerProcess:
    """``TorchPeer`` in a child process of its own (spawned: no jax/XLA state inherited).
    ``step`` returns (metrics, wall s, CPU s) as measured inside the child."""

    def __init__(self, path: Path, tcfg):
        import multiprocessing as mp

        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        import types

        # the hyper-parameters the peer reads, as plain values (the child never imports jax)
        hp = types.SimpleNamespace(**{k: getattr(tcfg, k) for k in
                                      ("lora_lr", "weight_decay", "ppo_eps", "ppo_eps_high", "max_grad_norm")})
        self.proc = ctx.Process(target=_peer_main, args=(child, str(path), hp), daemon=True)
        self.proc.start()
        self.load_s, self.threads = self.conn.recv()

    def step(self, batches, variant: str):
        self.conn.send(("step", batches, variant))
        return self.conn.recv()

    def close(self) -> None:
        self.conn.send(("stop",))
        self.proc.join(timeout=30)


# --------------------------------------------------------------------------- main


def main(argv=None) -> int:
    args = parse_args(argv)
    warnings.simplefilter("ignore")
    import jax

    from morse_jax.models import embedded_model_path, load_backbone
    from morse_jax.mole.experts import ExpertBankSpec
    from morse_jax.rl.batch import pad_sequences
    from morse_jax.rl.update import Trainer, TrainConfig, init_trainable
    from morse_jax.run import allocator

    overrides = eval(args.train_config)  # noqa: S307 - a developer's command line
    if args.micro_batch:
        overrides["micro_batch"] = args.micro_batch
    tcfg = TrainConfig(**overrides)
    print(f"# load {os.getloadavg()[0]:.1f}, cpus {os.cpu_count()}, jax {jax.__version__}, "
          f"XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}, OMP_WAIT_POLICY={os.environ['OMP_WAIT_POLICY']}, "
          f"malloc {allocator.current()} (both sides)",
          flush=True)
    path = embedded_model_path()
    bb, t_load = timed(lambda: load_backbone(path))
    spec = ExpertBankSpec()  # 2 roles + 4 subtask experts, rank 8, alpha 16, q/v/o, last 8 layers
    trainer = Trainer(bb.config, bb.params, spec, tcfg)
    trainable = init_trainable(jax.random.key(0), bb.config, spec, tcfg)
    rng = np.random.default_rng(0)
    trainable["bank"]["b"] = {t: jax.numpy.asarray(0.02 * rng.normal(size=x.shape).astype(np.float32))
                              for t, x in trainable["bank"]["b"].items()}
    opt_state = trainer.init_opt_state(trainable)
    seqs, routes, groups = build_examples(bb, spec, args, rng)
    (logps, t_lp) = timed(lambda: trainer.logprobs(trainable["bank"], seqs))
    seqs = with_behaviour(seqs, logps, rng)
    (seqs, t_states) = timed(lambda: with_prefix_states(trainer, seqs))
    recompute = None
    if not args.no_recompute:  # the same update running the whole model (reuse_prefix_states=False)
        recompute = Trainer(bb.config, bb.params, spec, dataclasses.replace(tcfg, reuse_prefix_states=False))
        trainable_rc = jax.tree.map(jax.numpy.copy, trainable)
        opt_state_rc = recompute.init_opt_state(trainable_rc)
    n_gen = sum(len(s.completion_ids) for s in seqs)
    print(f"# ours: loaded in {t_load:.1f} s; {len(seqs)} sequences x {args.seq} tokens ({n_gen} generated), "
          f"{len(routes)} routes, micro-batch {tcfg.micro_batch}; behaviour log-probs (compile + forward) "
          f"{t_lp:.1f} s; prefix states (layers 0..{trainer.start_layer - 1}, what the sampler returns "
          f"with return_prefix_states) {t_states:.1f} s, not timed", flush=True)

    theirs, batches = None, None
    if not args.ours_only:
        theirs = TorchPeer(path, tcfg) if args.peer_in_process else PeerProcess(path, tcfg)
        # the peer gets the flat layout (whole prompt + completion per row), same micro-batches
        batches = [peer_fields(pad_sequences(seqs[i:i + tcfg.micro_batch], rows=min(tcfg.micro_batch, len(seqs) - i),
                                             length_buckets=tcfg.length_buckets, max_active=tcfg.max_active,
                                             scale=1.0 / groups))
                   for i in range(0, len(seqs), tcfg.micro_batch)]
        where = "this process" if args.peer_in_process else f"child process {theirs.proc.pid}"
        print(f"# transformers: loaded in {theirs.load_s:.1f} s, torch threads {theirs.threads}, in {where}",
              flush=True)

    def run_ours():
        nonlocal trainable, opt_state
        trainable, opt_state, m = trainer.update(trainable, opt_state, seqs, routes, num_groups=groups)
        jax.block_until_ready(trainable)
        return m

    def run_recompute():
        nonlocal trainable_rc, opt_state_rc
        trainable_rc, opt_state_rc, m = recompute.update(trainable_rc, opt_state_rc, seqs, routes, num_groups=groups)
        jax.block_until_ready(trainable_rc)
        return m

    def clock(fn):
        t, c = time.perf_counter(), time.process_time()
        out = fn()
        return out, time.perf_counter() - t, time.process_time() - c

    compile_s = []  # trace + lowering + XLA compile of every jitted function the first update builds
    jax.monitoring.register_event_duration_secs_listener(
        lambda event, secs, **_: compile_s.append(secs) if event.startswith("/jax/core/compile/") else None)
    m0, first, _ = clock(run_ours)
    compile_total = sum(compile_s)
    compiles = trainer.compile_count
    if recompute is not None:
        clock(run_recompute)
        compiles_rc = recompute.compile_count
    sides = ["ours"] + (["ours:recompute"] if recompute is not None else [])
    sides += [f"torch:{v}" for v in args.torch_logits] if theirs is not None else []
    wall = {k: [] for k in sides}
    cpu = {k: [] for k in sides}
    m_th = {}
    for _ in range(args.reps):  # interleaved, so load changes hit every side alike
        for side in sides:
            if side == "ours":
                _, w, c = clock(run_ours)
            elif side == "ours:recompute":
                _, w, c = clock(run_recompute)
            elif args.peer_in_process:
                m_th[side], w, c = clock(lambda: theirs.step(batches, side.split(":")[1]))
            else:  # wall and CPU seconds as the child measured them
                m_th[side], w, c = theirs.step(batches, side.split(":")[1])
            wall[side].append(w)
            cpu[side].append(c)
        print("#   rep: " + ", ".join(f"{k} {1e3 * wall[k][-1]:.0f} ms" for k in sides)
              + f"; load {os.getloadavg()[0]:.1f}", flush=True)
    med = statistics.median
    assert trainer.compile_count == compiles, "the timed updates recompiled"
    assert recompute is None or recompute.compile_count == compiles_rc, "the timed updates recompiled"
    print(f"# ours: first update {first:.1f} s, of which compiling {compile_total:.1f} s "
          f"({compiles} jitted functions); token nll {m0['token_nll']:.3f}, lora loss {m0['lora_loss']:.3f}, "
          f"clip fraction {m0['clip_fraction']:.3f}, |trainer - behaviour logp| mean {m0['logp_gap_mean']:.3f}")
    for side, m in m_th.items():  # one adapter vs per-route mixtures: close, not equal
        print(f"# {side}: token nll {m['token_nll']:.3f}, lora loss {m['lora_loss']:.3f}")
    print(f"update step, {len(seqs)} x {args.seq} tokens ({'distinct prompts' if args.distinct_prompts else 'prompt shared per group'}), "
          f"ms/step median [min-max], process CPU s/step median:")
    for side in sides:
        ratio = "" if side == "ours" else (f"   ratio {med(wall[side]) / med(wall['ours']):.2f}x wall, "
                                           f"{med(cpu[side]) / med(cpu['ours']):.2f}x cpu (>1: ours faster)")
        print(f"  {side:16s} {1e3 * med(wall[side]):8.0f} [{1e3 * min(wall[side]):.0f}-{1e3 * max(wall[side]):.0f}]"
              f"  cpu {med(cpu[side]):6.1f}{ratio}", flush=True)
    if isinstance(theirs, PeerProcess):
        theirs.close()
    return 0


if __name__ == "__main__":
    from morse_jax.run.allocator import reexec_with_allocator

    reexec_with_allocator()  # both sides (the peer's child inherits it) under one malloc: MORSE_JAX_MALLOC
    sys.exit(main())
