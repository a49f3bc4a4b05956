"""Quickstart: the whole MoRSE loop offline on 2 CPU cores in a few minutes.

The embedded SmolLM2-135M-Instruct GGUF, scorable SciCode development problems (targets rebuilt
from their ground-truth code), small B / M / token budgets, two HGRPO steps, evaluation, a
checkpoint and a report in runs/quickstart. Running it again resumes from the checkpoint;
add --config.fresh=True (or delete runs/quickstart) to start over. Another ablation row of the
same loop: ``--config configs/quickstart.py:B`` (A, B, B++, C, D, single_agent, single_agent_rl, base), written to
runs/quickstart_<variant>.
"""

from morse_jax.config.defaults import get_config as defaults
from morse_jax.config.variants import apply_variant, variant_dir


def get_config(variant="D"):
    c = defaults()
    c.mode = "train"
    c.workdir = "runs/quickstart" if variant == "D" else f"runs/quickstart_{variant_dir(variant)}"
    c.model.path = "embedded"
    c.data.family = "scicode"
    c.data.train = "package:dev"
    c.data.eval = "package:dev"
    c.data.train_ids = ("19", "38")
    c.data.eval_ids = ("4", "19")
    c.data.tasks_per_step = 2
    c.data.skip_slow_steps = True  # fast runs only: leave out problems with a step that takes > 15 s to score
    c.rollout.routes = 2
    c.rollout.candidates = 2
    c.rollout.max_attempts = 2
    c.rollout.max_new_tokens = 160
    c.rollout.eval_max_new_tokens = 160
    c.rollout.temperature = 0.8
    c.train.steps = 2
    c.train.micro_batch = 4
    c.train.lora_lr = 1e-4
    return apply_variant(c, variant)
