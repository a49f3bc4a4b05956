"""Sharding rules for MoR's adapter params: each factor's model-width axis is split as the
backbone splits the same projection's kernel; the rest is replicated; what does not divide falls
back to replication."""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import PartitionSpec as P

from morse_jax.models import ModelConfig
from morse_jax.mor.config import MoRConfig
from morse_jax.mor.params import PAPER, init_mor_params, llama_3_2_1b_instruct
from morse_jax.parallel import make_mesh, mor_param_shardings, mor_param_specs, to_global


class ShapeMesh:
    """The part of a Mesh the rules read: axis sizes."""

    def __init__(self, data: int, fsdp: int, tensor: int):
        self.shape = {"data": data, "fsdp": fsdp, "tensor": tensor}


def test_llama_1b_paper_adapter_is_split_like_the_backbone_kernels():
    cfg = llama_3_2_1b_instruct()
    shapes = jax.eval_shape(lambda k: init_mor_params(k, cfg, PAPER), jax.random.PRNGKey(0))
    specs = mor_param_specs(ShapeMesh(2, 4, 2), shapes, cfg)
    assert specs["a"]["q"] == P(None, None, "fsdp")  # [L, N, d_in = hidden, r]
    assert specs["b"]["q"] == P(None, None, None, "tensor")  # [L, N, r, d_out = heads]
    assert specs["b"]["k"] == P(None, None, None, "tensor")  # 8 kv heads split over 2
    assert specs["a"]["o"] == P(None, None, "tensor") and specs["b"]["o"] == P(None, None, None, "fsdp")
    assert specs["a"]["down"] == P(None, None, "tensor") and specs["b"]["up"] == P(None, None, None, "tensor")
    assert specs["router"]["q"] == P(None, "fsdp") and specs["router"]["down"] == P(None, "tensor")


def test_what_does_not_divide_is_replicated_and_a_one_device_mesh_places_the_tree():
    odd = ModelConfig(family="llama", vocab_size=61, hidden_size=30, intermediate_size=48, num_layers=2, num_heads=3,
                      num_kv_heads=1, head_dim=10)
    cfg = MoRConfig(rank=2, shared_gate="sigmoid")
    params = init_mor_params(jax.random.PRNGKey(0), odd, cfg)
    specs = mor_param_specs(ShapeMesh(1, 4, 2), params, odd)
    assert specs["a"]["q"] == P() and specs["b"]["q"] == P()  # hidden 30 % 4, 3 heads % 2
    assert specs["b"]["gate"] == P(None, None, None, "tensor") and specs["gate"]["down"] == P(None, "tensor")
    mesh = make_mesh((-1, 1, 1))
    placed = to_global(params, mor_param_shardings(mesh, params, odd))
    for got, want in zip(jax.tree.leaves(placed), jax.tree.leaves(params)):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
