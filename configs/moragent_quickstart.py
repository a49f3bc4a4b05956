"""MoRAgent quickstart: SFT of a reduced MoR on the generated function-calling set, then BFCL on a
fixed subset, offline on 2 CPU cores.

``python -m morse_jax.main --config configs/moragent_quickstart.py`` trains MoR on the embedded
SmolLM2-135M-Instruct (SFT on multi-role trajectories converted from ``tasks.bfcl.synthetic``'s
leakage-free records), answers the fixed BFCL subset with the role loop and writes report.md in
runs/moragent_quickstart. Other rows of the same table (written to runs/moragent_quickstart_<variant>,
and gathered into each run's report): ``configs/moragent_quickstart.py:base`` (the backbone with
BFCL's own prompt, no training), ``:lora`` (plain LoRA, MoR's budget), ``:mor_no_router``,
``:mor_no_balance``, ``:mor_no_orth``.

Reduced for 2 cores (the faithful setting would train about half as many parameters as the 135M
model has): rank 4 on the last 8 layers (all seven projections, the paper's 1+4 / 1+4 / 1+3 LoRAs
and top 3 / 3 / 2), 300 generated trajectories (40 held out), the paper's 4 epochs (132 steps of
8), and a learning rate of 5e-4 instead of the paper's 5e-5 (raised for a set ~100x smaller than
the paper's; 5e-5 was not measured here). The BFCL subset is 50 simple_python + 25 multiple + 25
parallel + 25 irrelevance items, half the issue's 250: the base model alone took 11-38 min for it on
this machine's 2 cores beside two training runs (README "MoRAgent on BFCL" has every row's time).

Answering: the reasoner's first thought is read as a closed set (``moragent.first_thought="closed"``)
with a bias towards "no call" chosen per adapter on BFCL's dev split (items issue 19's subsets never
select; ``python -m morse_jax.run.no_call_calibration``, README): on that split the closed thought
with its bias averaged 50.7 for MoR against 34.7 for the generated thought. The MoR ablations use
MoR's bias (not calibrated separately).
"""

from morse_jax.config.defaults import get_config as defaults
from morse_jax.config.variants import apply_agent_variant, variant_dir

NO_CALL_BIAS = {"mor": 3.7169, "lora": 4.3626}


def get_config(variant="mor"):
    c = defaults()
    c.system = "moragent"
    c.mode = "train"
    c.workdir = "runs/moragent_quickstart" if variant == "mor" else f"runs/moragent_quickstart_{variant_dir(variant)}"
    c.model.path = "embedded"
    m = c.moragent
    m.rank = 4
    m.n_adapt = 8
    m.synthetic_examples = 300
    m.heldout_examples = 40
    m.epochs = 4
    m.lr = 5e-4
    m.batch_size = 8
    m.micro_batch = 4
    m.max_len = 1024
    m.checkpoint_every = 10
    m.eval_subset = ("simple_python:50", "multiple:25", "parallel:25", "irrelevance:25")
    m.eval_batch = 8
    m.first_thought = "closed"
    # selected on the dev split (72 items: simple_python 24, multiple 12, parallel 12, irrelevance 24)
    # from each adapter's checkpoint after the 4 epochs above; never on the scored subset
    m.no_call_bias = NO_CALL_BIAS["lora" if variant == "lora" else "mor"]
    c.sampler.max_batch = 8
    return apply_agent_variant(c, variant)
