"""The paper's experiment configs (App. E) for each backbone and benchmark.

``configs/<backbone>_<benchmark>.py`` files are thin wrappers around :func:`paper_config`;
the model directory is always given by the user (``--config.model.path=/ckpt/Qwen3-4B``),
nothing is downloaded.
"""

from __future__ import annotations

import ml_collections

from morse_jax.config.defaults import get_config as defaults
from morse_jax.config.variants import apply_variant, variant_dir

# backbone name -> (what to pass as model.path, epochs, mesh (data, fsdp, tensor))
BACKBONES = {
    # 4B and 8B fit replicated on one 80-141 GB GPU: pure data parallelism over the GPUs.
    "qwen3_4b": ("an HF directory of Qwen/Qwen3-4B-Instruct-2507", 5, (-1, 1, 1)),
    "llama31_8b": ("an HF directory of meta-llama/Llama-3.1-8B-Instruct", 5, (-1, 1, 1)),
    # 31B: parameters sharded over the GPUs of a host (FSDP), App. E used 1-2 epochs.
    "gemma4_31b": ("an HF directory of google/gemma-4-31b-it", 1, (1, -1, 1)),
}
BENCHMARKS = ("srdd", "scicode")


def paper_config(backbone: str, benchmark: str, variant: str = "D") -> ml_collections.ConfigDict:
    """App. E hyper-parameters: L_adapt=8, rank 8, alpha 16, 2 role + 4 subtask experts, K=2,
    B=4 routes x M=4 candidates, advantage clip 5, skip std 5e-4, alpha_pi 0.15, AdamW with
    LoRA lr 8e-5 / router lr 3e-5, top-p 0.95, entropy 0.02, orthogonality 0.05; App. I evaluation
    decoding (8192 tokens, T 0.2, top-p 0.95; no revision on SciCode, 3 attempts on SRDD) and splits."""
    if backbone not in BACKBONES:
        raise ValueError(f"backbone: unknown {backbone!r}; choose one of {sorted(BACKBONES)}")
    if benchmark not in BENCHMARKS:
        raise ValueError(f"benchmark: unknown {benchmark!r}; choose one of {BENCHMARKS}")
    _, epochs, mesh = BACKBONES[backbone]
    c = defaults()
    c.workdir = f"runs/{backbone}_{benchmark}/{variant_dir(variant)}"
    c.model.path = ""  # required: --config.model.path=/path/to/hf_checkpoint_dir
    c.model.dtype = "bfloat16"
    c.data.family = benchmark
    c.data.dir = "../shared/data/morse-reference"
    c.data.skip_slow_steps = False  # every problem of every split (App. I: 60 / 20, OOD 64 / 16)
    if benchmark == "srdd":
        c.data.train, c.data.eval = "iid_train", "iid_test"
        c.rollout.max_new_tokens = 2048  # whole small codebases
        # the authors' SRDD planner asks for 5-8 subtasks
        c.rollout.min_nodes, c.rollout.max_nodes = 5, 8
        c.rollout.eval_max_attempts = 3  # App. I: at most 3 attempts on SRDD for every pipeline
    else:
        # The authors' file names are inverted (README Fidelity): mytest.jsonl is the training split.
        c.data.train, c.data.eval = "morse_train", "morse_test"
        c.data.scicode_h5 = ""  # required: the official SciCode test_data.h5 (hidden-test targets)
        c.rollout.max_new_tokens = 1024
        c.rollout.eval_max_attempts = 1  # App. I: no revision at SciCode evaluation for any method
        # Sec. 3.1 / App. E: the planner makes every task's DAG (the steps are its nodes)
        c.rollout.scicode_dag = "planner"
    # App. I: every method decodes with an 8192-token budget, temperature 0.2, top-p 0.95
    c.rollout.eval_temperature, c.rollout.eval_top_p, c.rollout.eval_max_new_tokens = 0.2, 0.95, 8192
    c.data.tasks_per_step = 4
    c.mole.num_subtask, c.mole.rank, c.mole.alpha, c.mole.n_adapt = 4, 8, 16.0, 8
    c.mole.targets, c.mole.top_k = ("q", "v", "o"), 2
    c.rollout.routes, c.rollout.candidates, c.rollout.max_attempts = 4, 4, 3
    c.rollout.temperature, c.rollout.top_p = 1.0, 0.95
    c.rollout.merge_candidates = "routes_x_candidates"  # Alg. 1: "Merger nodes follow the same loop"
    c.train.epochs = epochs
    c.train.lora_lr, c.train.router_lr, c.train.weight_decay = 8e-5, 3e-5, 0.01
    c.train.alpha_pi, c.train.clip_advantage, c.train.min_std = 0.15, 5.0, 5e-4
    c.train.entropy_weight, c.train.orthogonality_weight = 0.02, 0.05
    c.train.micro_batch = 8
    # long sequences: without rematerialisation the backward pass keeps every adapted layer's
    # [micro_batch, heads, T, T] attention (micro-batch 4 x 3072 tokens ran out of memory on an H200)
    c.train.remat = "layer"
    c.train.checkpoint_every = 10
    c.sampler.max_batch = 64  # the job's batch buckets are powers of two up to this
    c.parallel.mesh = mesh
    return apply_variant(c, variant)
