"""Paper config: llama31_8b on srdd (App. E hyper-parameters, see morse_jax/config/paper.py).

    python -m morse_jax.main --config configs/llama31_8b_srdd.py --config.model.path=/path/to/checkpoint
    python -m morse_jax.main --config configs/llama31_8b_srdd.py:B ...   # ablation row B (A, B, B++, C, D, single_agent, single_agent_rl, base)
"""

from morse_jax.config.paper import paper_config


def get_config(variant="D"):
    return paper_config("llama31_8b", "srdd", variant)
