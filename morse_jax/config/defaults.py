"""Every config field with its default and its meaning. Config files in ``configs/`` start from here.

The ablation variants (what a ``config.variant`` name sets) are in ``config/variants.py``.
Override any field on the command line: ``--config.train.steps=3 --config.model.path=/ckpt/Qwen3-4B``.
"""

from __future__ import annotations

import ml_collections

MODES = ("train", "eval", "plan", "solve", "diagnose", "describe")


def get_config() -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.mode = "train"  # one of MODES
    # morse: MoRSE (planner, DAG, MoLE experts, HGRPO) | moragent: MoRAgent (role loop, MoR, SFT, BFCL; moragent.*)
    c.system = "morse"
    # one of config.variants.VARIANTS (system morse: adapters and credit; training: mode; DAG or not:
    # rollout.single_agent) or AGENT_VARIANTS (system moragent)
    c.variant = "D"
    c.workdir = "runs/default"  # checkpoints, metrics, report; an existing run there is resumed
    c.fresh = False  # True: ignore checkpoints in workdir and start over
    c.seed = 0
    c.task = ""  # free-text task for mode=solve / plan
    # Persistent XLA compilation cache ("" = off): compiled programs are kept on disk, so a rerun,
    # a resumed run or the next seed of an experiment loads them instead of compiling again (step 1
    # of the quickstart spends ~110 s compiling on 2 CPU cores). Programs that compile in under
    # a second are not stored. Shared by every run of the same user; safe to delete.
    c.compilation_cache = "~/.cache/morse_jax/xla"

    c.model = ml_collections.ConfigDict()
    c.model.path = "embedded"  # HF safetensors dir, a .gguf file, or "embedded" (SmolLM2-135M GGUF)
    c.model.dtype = "float32"  # float32 on CPU, bfloat16 on GPU

    c.data = ml_collections.ConfigDict()
    c.data.family = "scicode"  # scicode | srdd | pyfuncs (generated coding tasks, splits train / iid / ood)
    c.data.dir = "../shared/data/morse-reference"  # reference splits (SciCode JSONL, SRDD CSV)
    c.data.train = "package:dev"  # split name, "package:dev"/"package:all" (SciCode), or a file path
    c.data.eval = "package:dev"
    c.data.train_ids = ()  # restrict to these task ids (empty = all usable)
    c.data.eval_ids = ()
    c.data.max_train_tasks = 0  # 0 = no limit
    c.data.max_eval_tasks = 0
    c.data.tasks_per_step = 2  # tasks rolled out per HGRPO step
    c.data.scicode_h5 = ""  # official test_data.h5 (optional); else targets rebuilt from ground truth
    c.data.cache_dir = ""  # rebuilt SciCode targets; default <workdir>/../.cache/scicode
    # leave out SciCode problems with a step known to take > 15 s to score (fast runs only; the
    # paper configs use every problem); the job prints what it left out
    c.data.skip_slow_steps = False

    c.scicode = ml_collections.ConfigDict()  # SciCode family options (DESIGN §5 / README Fidelity)
    c.scicode.binary_reward = False  # step reward 1 only when every test passes (authors' code) instead of the pass fraction
    c.scicode.gold_context = False  # upstream steps' code in training prompts is the ground truth (authors' code), not the model's

    c.srdd = ml_collections.ConfigDict()  # SRDD family options (DESIGN §5 / README Fidelity)
    c.srdd.use_gate = True  # hard gate first (paper); False: a crashing program still earns comp/cons (authors' code)
    c.srdd.completeness_mode = "ast"  # ast: stubs/TODOs by syntax tree | line_rule: ChatDev's line rule
    c.srdd.planner_hint = True  # add the authors' software-project rules to the planner prompt

    c.mole = ml_collections.ConfigDict()
    c.mole.num_subtask = 4  # K_s
    c.mole.rank = 8  # rho
    c.mole.alpha = 16.0
    c.mole.n_adapt = 8  # L_adapt: last blocks carrying experts
    c.mole.targets = ("q", "v", "o")
    c.mole.top_k = 2  # K routed experts per execute call
    c.mole.compose = "gather"  # gather | onehot (see bench/lora_compose.py)
    c.mole.merge_mode = "union"  # union | random_subset
    c.mole.single_rank = 24  # rank of the single LoRA of variants B / B++ / single_agent_rl (the one source; B++ overlay: 48)

    c.rollout = ml_collections.ConfigDict()
    c.rollout.routes = 4  # B
    c.rollout.candidates = 4  # M
    c.rollout.max_attempts = 3  # calls per node in training (1 + regenerations after a failed verification)
    c.rollout.single_agent = False  # no DAG: one node holding the whole task (variants single_agent*)
    c.rollout.temperature = 1.0  # training decoding
    c.rollout.top_p = 0.95
    c.rollout.max_new_tokens = 1024
    c.rollout.eval_temperature = 0.0  # evaluation decoding (0 = greedy; App. I: 0.2)
    c.rollout.eval_max_new_tokens = 1024  # App. I: 8192
    c.rollout.eval_top_p = 1.0  # nucleus mass at evaluation (App. I: 0.95)
    c.rollout.eval_max_attempts = 3  # calls per node at evaluation (1 = no revision, App. I)
    # merge calls in training: "routes_x_candidates" (B x M, the same loop as execute calls, Alg. 1;
    # a merge "route" is one draw of the inherited expert set) or "candidates" (M only; cheaper)
    c.rollout.merge_candidates = "routes_x_candidates"
    c.rollout.scicode_dag = "chain"  # chain: SciCode steps in order | planner: dependencies inferred by the planner
    c.rollout.planner_max_new_tokens = 512
    c.rollout.min_nodes = 2  # planner bounds on the DAG size (authors' SRDD planner: 5-8)
    c.rollout.max_nodes = 8
    c.rollout.max_replans = 2  # planner re-asks after a rejected plan before the one-node fallback
    c.rollout.planner_prefix = '{"nodes": ['  # the planner's answer starts here ("" = free-form)
    c.rollout.answer_prefix = True  # families may start answers (SciCode: the step's function header)
    c.rollout.heal_answer_prefix = True  # token healing: drop the prompt's last token, first token re-writes it
    # sandboxed verifications in flight at once (0 = one per CPU: sandbox timeouts are wall-clock)
    c.rollout.verify_workers = 0
    # verify each sampler micro-batch while the next generates (False: after the wave's generation)
    c.rollout.verify_overlap = True

    c.train = ml_collections.ConfigDict()
    c.train.steps = 100  # HGRPO steps (each rolls out data.tasks_per_step tasks)
    c.train.epochs = 0  # > 0: overrides steps with epochs * ceil(train tasks / tasks_per_step)
    c.train.lora_lr = 8e-5
    c.train.router_lr = 3e-5
    c.train.weight_decay = 0.01
    # > 0: clip the LoRA and the router gradients each to this norm, separately (paper and authors'
    # code: no clipping)
    c.train.max_grad_norm = 0.0
    c.train.ppo_eps = 0.2
    c.train.ppo_epochs = 1  # optimisation passes over each rollout batch (the clip acts from the 2nd; Alg. 1: 1)
    # per-candidate aggregation of the token terms: sequence_mean (authors' code) | sequence_sum (Eq. 7)
    c.train.loss_normalisation = "sequence_mean"
    # a merge call's loss also trains the inherited subtask experts (authors' code); False: only
    # the merge role expert (Alg. 1)
    c.train.merge_trains_subtask_experts = False
    c.train.alpha_pi = 0.15
    c.train.entropy_weight = 0.02
    c.train.orthogonality_weight = 0.05
    c.train.kl_beta = 0.0
    c.train.approx_set_logp = False  # the authors' sum-of-log-probs router likelihood
    c.train.micro_batch = 4
    # the sampler hands the update each sequence's residual stream entering the first adapted layer
    # and the update starts there (the frozen prefix is not run twice); costs d values per token
    # of host memory until the update (SamplerConfig.return_prefix_states)
    c.train.reuse_prefix_states = True
    # what the update's backward pass keeps of the adapted layers: none (every layer's residuals,
    # [micro_batch, heads, T, T] attention scores included) | layer (each layer's input only; its
    # forward runs again in the backward pass: long sequences fit, more compute). The paper configs: layer
    c.train.remat = "none"
    c.train.min_std = 5e-4
    c.train.clip_advantage = 5.0
    c.train.checkpoint_every = 1
    c.train.keep_checkpoints = 3
    c.train.eval_every = 0  # 0 = only at the end

    c.sampler = ml_collections.ConfigDict()
    c.sampler.max_batch = 16  # rows per sampler micro-batch (batch buckets: powers of two up to it)
    c.sampler.chunk = 32  # decode steps between host checks (stop strings, all-done)
    # native C++ CPU kernels for decode steps (built with g++ at first use): auto | on | off
    # (auto: where they apply, XLA otherwise; see SamplerConfig.cpu_kernels)
    c.sampler.cpu_kernels = "auto"
    # a GGUF's Q4_1 / Q8_0 blocks for decode steps of 1-4 rows on those kernels: auto | off
    # (SamplerConfig.block_weights)
    c.sampler.block_weights = "auto"
    # prompt tokens per prefill chunk, summed over the rows (SamplerConfig.prefill_rows); 0 = by backend:
    # 512 on CPU (measured best there, README "prefill"), 4096 on GPU/TPU, where a 512-row chunk left the
    # prefill of 64 x 512 tokens ~10x slower than its FLOPs on an H200 (README "GPU figures")
    c.sampler.prefill_rows = 0
    # slot refill: a finished row's slot takes the next queued request of the same generate call
    # instead of idling until its micro-batch ends (SamplerConfig.refill, sampling/refill.py)
    c.sampler.refill = False

    c.moragent = moragent_defaults()

    c.parallel = ml_collections.ConfigDict()
    c.parallel.mesh = (-1, 1, 1)  # (data, fsdp, tensor); -1 fills with the remaining devices
    c.parallel.coordinator = ""  # host:port for jax.distributed.initialize (empty: from env / single)
    c.parallel.num_processes = 0
    c.parallel.process_id = -1
    return c


def moragent_defaults() -> ml_collections.ConfigDict:
    """MoRAgent's fields (``config.system="moragent"``): training data, the MoR adapter, SFT, the role
    loop and the BFCL evaluation. Paper settings (MoRAgent §4.2): rank 16, 1 shared + 4 / 4 / 3
    routed LoRAs per role with top 3 / 3 / 2, all seven projections, lr 5e-5, 4 epochs,
    alpha1 1e-3, alpha2 1e-4."""
    m = ml_collections.ConfigDict()
    # training data: "synthetic" (morse_jax.tasks.bfcl.synthetic, leakage-free, converted to the
    # multi-role format), "bfcl_live" (BFCL's live categories as records, morse_jax.tasks.bfcl.live_records:
    # items offering a function named in a scored non-live category are left out; evaluate on non-live
    # categories only), "synthetic+bfcl_live" (both, shuffled together: the generator's call syntax and
    # multi-call requests next to real requests, irrelevant ones included) or a JSON Lines file in the
    # multi-role format (morse_jax.tasks.trajectories); "questions" (morse_jax.tasks.bfcl.questions, leakage-free
    # too): questions about everyday computations and lookups, irrelevant ones outside every offered
    # tool's topic, parallel ones naming several values of one argument
    m.train_data = "synthetic"
    m.synthetic_examples = 5000  # records generated for "synthetic" / "questions" (and "synthetic+bfcl_live")
    # "bfcl_live" (and "synthetic+bfcl_live"): live records kept after a seeded shuffle (0 = all 1978),
    # before the max_len filter
    m.live_examples = 0
    m.heldout_examples = 200  # of them (or of the file's records) held out for the per-role held-out loss
    # the reasoner's templated first thought in "synthetic" trajectories: names ("Plan: call f, ...":
    # a fixed opener, function names only) | plan (every call with its arguments, the first design);
    # tasks.bfcl.trajectories.from_function_calling says why
    m.thought = "names"
    # the MoR adapter (morse_jax.mor); the role names are morse_jax.tasks.trajectories.ROLE_NAMES
    m.routed = (4, 4, 3)  # routed LoRAs per role (reasoner, executor, summarizer), plus one shared each
    m.top_k = (3, 3, 2)  # routed LoRAs kept per token in each role's group
    m.rank = 16
    m.targets = ("q", "k", "v", "o", "gate", "up", "down")
    m.n_adapt = 0  # adapted layers (the last ones); 0 = every layer
    m.shared_gate = "always"  # the shared LoRA: always on (paper) | sigmoid (authors' code: a per-token gate)
    m.scale = 1.0  # factor on every delta (the authors' code has no alpha / rank scaling)
    m.routers = True  # False: no routers, uniform weights over each group's routed LoRAs (ablation)
    m.lora_rank = 0  # rank of the plain-LoRA baseline (variant lora); 0 = MoR's trainable-parameter budget
    # SFT (morse_jax.sft)
    m.epochs = 4
    m.lr = 5e-5
    m.warmup_fraction = 0.03
    m.balance_weight = 1e-3  # alpha1: load-balance loss
    m.orth_weight = 1e-4  # alpha2: orthogonality loss
    m.batch_size = 8  # sequences per optimizer step (micro_batch x accumulation)
    m.micro_batch = 4
    m.max_len = 1024  # longer rendered trajectories are left out (counted)
    m.checkpoint_every = 50  # optimizer steps
    # when the adapter wraps only the last n_adapt layers: run the frozen layers below once per example
    # and keep their output (host memory, tokens x hidden floats), so each SFT step runs the adapted
    # layers only (same results up to rounding; sft.trainer.SFTTrainer's prefix_fn)
    m.cache_frozen_prefix = True
    # evaluation: BFCL items "category:count" (evenly spaced in BFCL's order; count 0 = all)
    m.eval_subset = ("simple_python:100", "multiple:50", "parallel:50", "irrelevance:50")
    # which items of those categories: test (the fixed subset) | dev (items issue 19's full subset never
    # selects, evenly spaced; for choosing settings such as no_call_bias; tasks.bfcl.subset)
    m.eval_split = "test"
    m.eval_batch = 8  # items answered per batch (answers are appended to <workdir>/bfcl_answers.jsonl)
    m.direct_max_new_tokens = 128  # the direct protocol's answer budget
    m.max_turns = 4  # role turns per episode (role loop)
    # the reasoner's hand-over: likelihood (the closed-set decision "Next: executor." vs "Next: summarizer."
    # scored by the model after its thought) | text (parsed from the generated text); run.role_loop
    m.role_choice = "likelihood"
    # the reasoner's first turn: generate (written by the model, the hand-over read by role_choice) |
    # closed (the "names" template's free choices, number of calls and function names, each scored
    # by the model as a closed set: a grammar-constrained greedy decode; run.closed_thought). closed
    # needs a reasoner trained on "names" thoughts (moragent.thought, or a JSONL written that way)
    m.first_thought = "generate"
    # with first_thought=closed: added to the "no call" thought's log-probability (0 = the model's own
    # preference; > 0 leans to no call). Select it on a dev split (the answers file records each
    # item's head log-probabilities), never on the categories the report scores
    m.no_call_bias = 0.0
    # the executor's turn: generate (written by the model) | guided (the calls the reasoner's "names"
    # thought decided, each parameter name a closed-set choice among the schema's parameters not yet
    # written, ")" only once every required one is, the values generated; run.guided_calls). guided
    # needs a reasoner trained on "names" thoughts; an episode whose thought is not one is generated
    m.executor = "generate"
    m.reasoner_max_new_tokens = 96
    m.executor_max_new_tokens = 128
    m.summarizer_max_new_tokens = 64
    return m
