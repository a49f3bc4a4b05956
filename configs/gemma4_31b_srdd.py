"""Paper config: gemma4_31b on srdd (App. E hyper-parameters, see morse_jax/config/paper.py).

    python -m morse_jax.main --config configs/gemma4_31b_srdd.py --config.model.path=/path/to/checkpoint
    python -m morse_jax.main --config configs/gemma4_31b_srdd.py:B ...   # ablation row B (A, B, B++, C, D, single_agent, single_agent_rl, base)
"""

from morse_jax.config.paper import paper_config


def get_config(variant="D"):
    return paper_config("gemma4_31b", "srdd", variant)
