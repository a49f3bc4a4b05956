"""sampling.shared_prefill: requests with the same prompt and adapter prefill once, and the
generations are what every row prefilling its own prompt gives."""

from __future__ import annotations

import contextlib
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from morse_jax.kernels import unavailable_reason
from morse_jax.models import Backbone, ModelConfig, init_params
from morse_jax.mole.experts import ExpertBankSpec, init_expert_bank
from morse_jax.sampling.requests import Request, SamplerConfig
from morse_jax.sampling.sampler import Sampler
from morse_jax.sampling.shared_prefill import cache_row_layout, prefill_groups, row_index, share_rows
from morse_jax.sampling.state import PrefillOutput

CFG = ModelConfig(family="llama", vocab_size=200, hidden_size=32, intermediate_size=64, num_layers=3, num_heads=4,
                  num_kv_heads=2, head_dim=8)
SPEC = ExpertBankSpec(num_subtask=4, rank=4, alpha=6.0, n_adapt=2)
CONFIG = SamplerConfig(batch_buckets=(1, 2, 4, 8), prompt_buckets=(32,), new_token_buckets=(16,), max_batch=8,
                       chunk=4, max_active=2, prefill_rows=32,
                       cpu_kernels="on" if unavailable_reason() is None else "off")


def test_groups_point_at_the_first_request_with_the_same_prefill():
    a = Request([1, 2, 3], expert_ids=[0], expert_weights=[1.0])
    same_as_a = Request([1, 2, 3], expert_ids=[0], expert_weights=[1.0], temperature=0.3, max_new_tokens=5)
    other_experts = Request([1, 2, 3], expert_ids=[1], expert_weights=[1.0])
    other_weights = Request([1, 2, 3], expert_ids=[0], expert_weights=[0.5])
    other_prompt = Request([1, 2], expert_ids=[0], expert_weights=[1.0])
    other_roles = Request([1, 2, 3], expert_ids=[0], expert_weights=[1.0], prompt_roles=[0, 0, 1])
    reqs = [a, other_experts, same_as_a, other_weights, other_prompt, other_roles, same_as_a]
    # decoding settings (temperature, budget) do not enter the prefill
    assert prefill_groups(reqs) == [0, 1, 0, 3, 4, 5, 0]
    distinct, index = row_index(prefill_groups(reqs), 8)
    assert distinct == [0, 1, 3, 4, 5]
    assert index.tolist() == [0, 1, 0, 2, 3, 4, 0, 0]  # the padding row reads distinct row 0


def test_share_rows_copies_whole_rows_in_both_cache_layouts():
    K, D, S, V = 3, 2, 5, 7

    def fused_layout(b):  # batch and kv heads folded into one axis, as models.decode lays it out
        return {"k": (jnp.zeros((b * K, D, S)),), "valid": jnp.zeros((b, S), bool), "index": jnp.zeros((), jnp.int32)}

    layout = cache_row_layout(fused_layout)
    leaves = jax.tree.leaves(jax.eval_shape(lambda: fused_layout(1)))
    assert len(layout) == len(leaves) == 3
    U = 2
    k = np.arange(U * K * D * S, dtype=np.float32).reshape(U * K, D, S)
    valid = np.arange(U * S).reshape(U, S) % 3 == 0
    pre = PrefillOutput(logits=jnp.arange(U * V, dtype=jnp.float32).reshape(U, V),
                        cache={"k": (jnp.asarray(k),), "valid": jnp.asarray(valid), "index": jnp.int32(4)},
                        pos=jnp.asarray([3, 5], jnp.int32))
    index = np.array([1, 0, 1, 1])
    out = share_rows(pre, jnp.asarray(index), layout)
    for r, u in enumerate(index):  # reference: row r of every leaf is row u of the input
        np.testing.assert_array_equal(np.asarray(out.cache["k"][0])[r * K:(r + 1) * K], k[u * K:(u + 1) * K])
        np.testing.assert_array_equal(np.asarray(out.cache["valid"])[r], valid[u])
        np.testing.assert_array_equal(np.asarray(out.logits)[r], np.asarray(pre.logits)[u])
        assert int(out.pos[r]) == int(pre.pos[u])
    assert int(out.cache["index"]) == 4
    assert out.prefix_states is None


@contextlib.contextmanager
def counting_prefill_rows(sampler):
    """Records the batch rows of every prefill call the sampler makes inside the block."""
    rows, inner = [], sampler._prefill

    def spy(params, bank_arg, prompts, *args, **kwargs):
        rows.append(prompts.tokens.shape[0])
        return inner(params, bank_arg, prompts, *args, **kwargs)

    sampler._prefill = spy
    try:
        yield rows
    finally:
        sampler._prefill = inner


@pytest.fixture(scope="module")
def samplers():
    params = init_params(jax.random.PRNGKey(0), CFG)
    params = jax.tree_util.tree_map_with_path(lambda p, x: x if "norm" in jax.tree_util.keystr(p) else 10.0 * x,
                                              params)  # peaked logits: a wrong row changes the argmax
    bb = Backbone(CFG, params, tokenizer=None)
    rng = np.random.default_rng(1)
    shapes = jax.eval_shape(lambda: init_expert_bank(jax.random.PRNGKey(0), CFG, SPEC))
    bank = {"a": {t: jnp.asarray(rng.uniform(-1, 1, x.shape).astype(np.float32) / np.sqrt(x.shape[-2]))
                  for t, x in shapes["a"].items()},
            "b": {t: jnp.asarray(0.5 * rng.normal(size=x.shape).astype(np.float32)) for t, x in shapes["b"].items()}}
    shared = Sampler(bb, SPEC, CONFIG)
    alone = Sampler(bb, SPEC, dataclasses.replace(CONFIG, share_prefill=False))
    return bank, shared, alone


def _candidate_requests(temperature):
    """Two prompts x two expert sets x two candidates (an HGRPO node's routes and candidates):
    four distinct prefills among eight rows, in shuffled order."""
    rng = np.random.default_rng(2)
    prompts = [rng.integers(0, CFG.vocab_size, size=n).tolist() for n in (9, 14)]
    sets = [([0, 2], [0.6, 0.4]), ([1], [1.0])]
    reqs = [Request(p, expert_ids=e, expert_weights=w, temperature=temperature, max_new_tokens=12)
            for p in prompts for e, w in sets for _ in range(2)]
    order = rng.permutation(len(reqs))
    return [reqs[i] for i in order]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_shared_prefill_generates_what_separate_prefills_generate(samplers, temperature):
    bank, shared, alone = samplers
    reqs = _candidate_requests(temperature)
    with counting_prefill_rows(shared) as rows_prefilled:
        got = shared.generate(bank, reqs, key=jax.random.PRNGKey(7))
    want = alone.generate(bank, reqs, key=jax.random.PRNGKey(7))
    assert rows_prefilled == [4]  # 4 distinct prefills for 8 rows: the 4-row bucket, not the 8-row one
    for g, w in zip(got, want):
        assert g.token_ids == w.token_ids
        np.testing.assert_allclose(g.logprobs, w.logprobs, rtol=1e-5, atol=1e-5)
    if temperature == 0.0:  # greedy: the candidates of one (prompt, set) are the same text
        by_key = {}
        for r, g in zip(reqs, got):
            by_key.setdefault((tuple(r.prompt_ids), tuple(r.expert_ids)), []).append(g.token_ids)
        assert all(a == b for a, b in by_key.values())


def test_no_sharing_when_the_distinct_requests_fill_the_same_bucket(samplers):
    bank, shared, _ = samplers
    distinct = {(tuple(r.prompt_ids), tuple(r.expert_ids)): r for r in _candidate_requests(0.0)}
    reqs = list(distinct.values())[:3] + [list(distinct.values())[0]]  # 3 distinct of 4: bucket 4 either way
    with counting_prefill_rows(shared) as rows_prefilled:
        shared.generate(bank, reqs, key=jax.random.PRNGKey(0))
    assert rows_prefilled == [4]
