"""MoRAgent on BFCL with Llama-3.2-1B-Instruct and the paper's settings (MoRAgent §4.2).

    python -m morse_jax.main --config configs/moragent_bfcl.py --config.model.path=/ckpt/Llama-3.2-1B-Instruct

MoR with 1 shared + 4 / 4 / 3 routed LoRAs per role (reasoner / executor / summarizer), top 3 / 3 / 2
per token, rank 16, all seven projections of every layer (0.16 B trainable parameters), SFT for 4
epochs at lr 5e-5 with alpha1 = 1e-3 (balance) and alpha2 = 1e-4 (orthogonality). Training data:
5000 generated leakage-free trajectories (``tasks.bfcl.synthetic``; the paper's 90k APIGen / ToolACE /
glaive mix with GPT-4o completions is not available offline), or your own multi-role JSON Lines file
(``--config.moragent.train_data=/data/train.jsonl``). Evaluation: every item of the covered BFCL v4
categories. Rows: ``:base``, ``:lora``, ``:mor`` (default), ``:mor_no_router``, ``:mor_no_balance``,
``:mor_no_orth``; each writes runs/moragent_bfcl[_<variant>] and each report gathers the rows beside it.
"""

from morse_jax.config.defaults import get_config as defaults
from morse_jax.config.variants import apply_agent_variant, variant_dir
from morse_jax.tasks.bfcl.data import CATEGORIES


def get_config(variant="mor"):
    c = defaults()
    c.system = "moragent"
    c.mode = "train"
    c.workdir = "runs/moragent_bfcl" if variant == "mor" else f"runs/moragent_bfcl_{variant_dir(variant)}"
    c.model.path = ""  # the user's Llama-3.2-1B-Instruct directory (--config.model.path=...)
    c.model.dtype = "bfloat16"
    m = c.moragent  # the defaults are the paper's adapter and SFT settings
    m.synthetic_examples = 5000
    m.heldout_examples = 200
    m.max_len = 2048
    m.batch_size = 32
    m.micro_batch = 8
    m.eval_subset = tuple(f"{cat}:0" for cat in CATEGORIES)
    m.eval_batch = 32
    c.sampler.max_batch = 32
    return apply_agent_variant(c, variant)
