"""Slot refill (``SamplerConfig.refill``, ``sampling.refill``) against static batching.

The reference for every request is the same request generated *alone* (a static batch of one)
and inside a static micro-batch: per-request keys (``Request.seed``) make a request's tokens a
function of the request only, so a refilled request must give the same tokens, finish reasons
and (to float32 rounding: different batch shapes sum in different orders) log-probs. Few slots
and many requests of long-tailed budgets make every slot refill several times and the cache
compact (``last_stats["compactions"]``), on a model with sliding-window layers too.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest
from test_sampler import SPEC, TINY, PieceTokenizer, tiny_backbone, tiny_bank

from morse_jax.sampling.sampler import Request, Sampler, SamplerConfig

BASE = SamplerConfig(batch_buckets=(1, 2, 4), prompt_buckets=(32,), new_token_buckets=(16,), max_batch=4, chunk=4,
                     max_active=3, prefill_rows=16, cpu_kernels="off")
REFILL = dataclasses.replace(BASE, max_batch=2, refill=True)  # 2 slots: every request after the 2nd refills one
LOGP_ATOL = 2e-5  # float32 rounding of the same sums in another batch shape


def long_tailed_requests(n: int, seed: int = 0, **kw) -> list[Request]:
    """Prompts of 1-31 tokens, budgets mostly short with a long tail, mixed settings and expert
    sets (the refilled slot must take the new request's), stop tokens, per-request seeds."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        experts = [[], [i % 6], [(i + 1) % 6, (i + 3) % 6]][i % 3]
        weights = [1.0 / max(1, len(experts))] * len(experts)
        out.append(Request(rng.integers(0, TINY["vocab_size"], size=int(rng.integers(1, 32))).tolist(),
                           expert_ids=experts, expert_weights=weights,
                           max_new_tokens=int(min(16, 1 + rng.geometric(0.15))),
                           temperature=(0.0, 1.0, 0.7)[i % 3], top_k=(0, 0, 20)[i % 3], top_p=(1.0, 1.0, 0.9)[i % 3],
                           seed=1000 + 7 * i, **kw))
    return out


def with_stop_ids(sampler, bank, reqs, key):
    """``reqs`` with stop ids that some rows draw: the 3rd token of each of the first rows
    generating 4+ tokens (draws before a stop id do not depend on it, so those rows then end with
    ``eos`` by their 3rd token)."""
    first = sampler.generate(bank, reqs, key=key)
    ids = tuple(dict.fromkeys(c.token_ids[2] for c in first if len(c.token_ids) >= 4))[:3]
    assert ids
    return [dataclasses.replace(r, stop_token_ids=ids) for r in reqs]


@pytest.fixture(scope="module", params=["llama", "gemma3"])
def setup(request):
    bb = tiny_backbone(request.param, tokenizer=PieceTokenizer(TINY["vocab_size"]))
    return bb, tiny_bank(bb.config), Sampler(bb, SPEC, BASE), Sampler(bb, SPEC, REFILL)


def assert_same(a, b):
    assert len(a) == len(b)
    for i, (x, y) in enumerate(zip(a, b)):
        assert x.token_ids == y.token_ids, f"request {i}"
        assert (x.finish_reason, x.text, x.prompt_len) == (y.finish_reason, y.text, y.prompt_len), f"request {i}"
        np.testing.assert_allclose(x.logprobs, y.logprobs, rtol=0, atol=LOGP_ATOL, err_msg=f"request {i}")


def test_refill_static_and_alone_give_the_same_completions(setup):
    bb, bank, static, refill = setup
    assert refill.refill and not static.refill
    key = jax.random.PRNGKey(3)
    reqs = with_stop_ids(static, bank, long_tailed_requests(11), key)
    alone = [static.generate(bank, [r], key=key)[0] for r in reqs]
    batched = static.generate(bank, reqs, key=key)
    refilled = refill.generate(bank, reqs, key=key)
    assert refill.last_stats["compactions"] >= 1  # the cache ran out of room and was shifted
    assert_same(batched, alone)
    assert_same(refilled, alone)
    # the budgets and stop tokens took effect (the test would not see a wrong slot reset otherwise)
    assert {c.finish_reason for c in refilled} == {"eos", "length"}
    assert all(len(c.token_ids) <= r.max_new_tokens for c, r in zip(refilled, reqs))
    # per-row expert sets reach the refilled slots: without its experts a request changes
    plain = refill.generate(bank, [dataclasses.replace(r, expert_ids=(), expert_weights=()) for r in reqs], key=key)
    assert any(p.token_ids != c.token_ids for p, c, r in zip(plain, refilled, reqs) if r.expert_ids)


def test_seeds_decide_the_draws_not_positions(setup):
    bb, bank, static, refill = setup
    reqs = [dataclasses.replace(r, temperature=1.0, top_k=0, top_p=1.0, stop_token_ids=())
            for r in long_tailed_requests(6, seed=1)]
    key = jax.random.PRNGKey(0)
    first = refill.generate(bank, reqs, key=key)
    # reversed order: other slots, other neighbours, same seeds -> same completions
    assert_same(refill.generate(bank, reqs[::-1], key=key)[::-1], first)
    # another seed -> another sample (sampled at T = 1 over 300 tokens: equal paths are unlikely)
    other = refill.generate(bank, [dataclasses.replace(r, seed=r.seed + 1) for r in reqs], key=key)
    assert any(a.token_ids != b.token_ids for a, b in zip(first, other))
    # without seeds a request's stream is its index in the call
    unseeded = [dataclasses.replace(r, seed=None) for r in reqs]
    assert_same(refill.generate(bank, unseeded, key=key),
                refill.generate(bank, [dataclasses.replace(r, seed=i) for i, r in enumerate(reqs)], key=key))


def test_refill_stop_strings_and_on_ready(setup):
    bb, bank, static, refill = setup
    reqs = long_tailed_requests(9, seed=2, stop_strings=("ab", "fed"))
    key = jax.random.PRNGKey(5)
    seen = []
    refilled = refill.generate(bank, reqs, key=key, on_ready=lambda idx, cs: seen.extend(zip(idx, cs)))
    assert_same(refilled, static.generate(bank, reqs, key=key))
    assert any(c.finish_reason == "stop" for c in refilled)
    assert sorted(i for i, _ in seen) == list(range(len(reqs)))
    assert all(refilled[i] is c for i, c in seen)


def test_refill_returns_the_same_prefix_states():
    bb = tiny_backbone("llama")
    bank = tiny_bank(bb.config)
    base = dataclasses.replace(BASE, return_prefix_states=True)
    static = Sampler(bb, SPEC, base)
    refill = Sampler(bb, SPEC, dataclasses.replace(base, max_batch=2, refill=True))
    reqs = long_tailed_requests(5, seed=3)
    key = jax.random.PRNGKey(1)
    a, b = static.generate(bank, reqs, key=key), refill.generate(bank, reqs, key=key)
    assert_same(b, a)
    for x, y, r in zip(a, b, reqs):
        assert y.prefix_states.shape == (len(r.prompt_ids) + len(y.token_ids), bb.config.hidden_size)
        np.testing.assert_allclose(y.prefix_states, x.prefix_states, rtol=0, atol=1e-4)


def test_bad_seed_is_rejected(setup):
    bb, bank, static, refill = setup
    with pytest.raises(ValueError, match="seed"):
        refill.generate(bank, [Request([1, 2], seed=-1)], key=jax.random.PRNGKey(0))


def test_refill_prefills_each_distinct_prompt_once(setup):
    """Groups of candidates sharing prompt and experts (an HGRPO route's M) are prefilled once
    per group, the slots given out together prefill as one batch, and every request still gives
    its own completion alone."""
    bb, bank, static, refill = setup
    key = jax.random.PRNGKey(7)
    groups = long_tailed_requests(4, seed=4)
    reqs = [dataclasses.replace(g, seed=100 * i + m, max_new_tokens=1 + (5 * m + i) % 16, temperature=1.0)
            for i, g in enumerate(groups) for m in range(3)]
    refilled = refill.generate(bank, reqs, key=key)
    assert_same(refilled, [static.generate(bank, [r], key=key)[0] for r in reqs])
    st = refill.last_stats
    assert st["prefilled_requests"] == len(groups)  # each distinct prompt once
    assert st["prefill_calls"] <= len(groups)
    # the first fill gives both slots to candidates of group 0: one prefill for both
    assert any(a.token_ids != b.token_ids for a, b in zip(refilled[0::3], refilled[1::3]))
    # with sharing off every request prefills, in batches of those given slots together
    off = Sampler(bb, SPEC, dataclasses.replace(REFILL, share_prefill=False))
    assert_same(off.generate(bank, reqs, key=key), refilled)
    assert off.last_stats["prefilled_requests"] == len(reqs)
    assert off.last_stats["prefill_calls"] < len(reqs)  # the first fill prefills two together
