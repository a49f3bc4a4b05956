"""Tests for morse_jax.mole.experts: per-row LoRA composition, active sets, PEFT export.

The reference for composition is the definition in DESIGN §2: for row i the adapted layers use
W + sum_k w_ik * (alpha/rank) * A_k B_k, merged into the kernels, and a dense forward (no LoRA
inputs) through those weights, read at row i. Everything is float32 on tiny random models. Forward passes are jitted (one compile per
shape set): eager JAX compiles every primitive separately, which dominates small CPU tests.
"""

from __future__ import annotations

import functools
import json
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from morse_jax.models import ModelConfig, forward, init_cache, init_params, split_segments, unstack_segments
from morse_jax.mole.experts import (
    ExpertBankSpec,
    execute_set,
    export_all,
    export_peft,
    expert_name,
    gather_lora,
    init_expert_bank,
    merge_set,
    pad_active,
    single_set,
    target_dims,
)

TINY = dict(vocab_size=61, hidden_size=32, intermediate_size=48, num_layers=3, num_heads=4, num_kv_heads=2,
            head_dim=8, rms_norm_eps=1e-6)
# rank 4, alpha 6: scaling 1.5, so using alpha or rank alone instead of alpha/rank shows.
SPEC_KW = dict(rank=4, alpha=6.0, n_adapt=2)
CASES = {
    "llama-qvo": (ModelConfig(family="llama", **TINY), ("q", "v", "o")),
    "qwen3-kgud": (ModelConfig(family="qwen3", qk_norm=True, **TINY), ("k", "gate", "up", "down")),
}

# Rows of one batch with different active sets (6 experts: 2 roles + 4 subtask).
ROWS = [
    [(0, 0.5), (3, 0.3), (5, 0.2)],  # non-uniform weights
    [(1, 1.0)],
    [],  # empty set: the base model
    [(4, 0.0), (2, 0.0)],  # real ids, weight 0: padding
    [(5, 1 / 3), (2, 1 / 3), (0, 1 / 3)],
]
MAX_ACTIVE = 3
ROWS_ACTIVE = (0, 1, 4)
ROWS_BASE = (2, 3)


@functools.partial(jax.jit, static_argnames=("cfg", "spec"))
def lora_logits(params, bank, ids, weights, tokens, valid, cfg, spec):
    lora = gather_lora(bank, spec, ids, weights)
    return forward(params, cfg, tokens, valid=valid, lora=lora)[0]


@functools.partial(jax.jit, static_argnames=("cfg",))
def base_logits(params, tokens, valid, cfg):
    return forward(params, cfg, tokens, valid=valid)[0]


# Whole-pytree inits under one jit each: eager jax.random compiles a program per leaf shape.
_init_params = jax.jit(init_params, static_argnums=1)
_init_bank = jax.jit(init_expert_bank, static_argnums=(1, 2))


def _spec(targets, compose="gather", **kw) -> ExpertBankSpec:
    return ExpertBankSpec(targets=targets, compose=compose, **{**SPEC_KW, **kw})


def _numpy(tree):
    return jax.tree.map(np.asarray, tree)


def _params(cfg, n_adapt, seed=0) -> dict:
    """Random backbone params as host arrays, last ``n_adapt`` layers in their own segment."""
    return split_segments(_numpy(_init_params(jax.random.PRNGKey(seed), cfg)), n_adapt)


def _fresh_bank(cfg, spec, seed=1) -> dict:
    return _numpy(_init_bank(jax.random.PRNGKey(seed), cfg, spec))


def _trained_bank(cfg, spec, seed=1, b_std=0.3) -> dict:
    """A bank with B != 0 (an initialised bank is a no-op, which would hide every error)."""
    bank = _fresh_bank(cfg, spec, seed)
    rng = np.random.default_rng(seed)
    bank["b"] = {t: (b_std * rng.standard_normal(b.shape)).astype(np.float32) for t, b in bank["b"].items()}
    return bank


def _inputs(cfg, batch, seq=7, seed=0):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, cfg.vocab_size, (batch, seq)).astype(np.int32)
    valid = np.ones((batch, seq), bool)
    valid[1, :2] = False  # one left-padded row: padding must not disturb the composition
    return tokens, valid


def _merged_params(params, bank, spec, row):
    """params (split) with W + sum_k w_k * scaling * A_k B_k in the last segment's target kernels."""
    last = dict(params["layers"][-1])
    for t in spec.targets:
        kernel = np.asarray(last[t]["kernel"], np.float64)  # [L_adapt, d_in, d_out]
        for e, w in row:
            a = np.asarray(bank["a"][t][e], np.float64)
            b = np.asarray(bank["b"][t][e], np.float64)
            kernel = kernel + w * spec.scaling * np.einsum("ldr,lro->ldo", a, b)
        last[t] = {**last[t], "kernel": kernel.astype(np.float32)}
    return {**params, "layers": (*params["layers"][:-1], last)}


def _rel_err(x, ref) -> float:
    x, ref = np.asarray(x, np.float64), np.asarray(ref, np.float64)
    return float(np.max(np.abs(x - ref)) / np.max(np.abs(ref)))


# --------------------------------------------------------------------------- composition


@pytest.mark.parametrize("compose", ["gather", "onehot"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_per_row_composition_matches_merged_dense_forward(case, compose):
    cfg, targets = CASES[case]
    spec = _spec(targets, compose)
    params = _params(cfg, spec.n_adapt)
    bank = _trained_bank(cfg, spec)
    ids, weights = pad_active(ROWS, MAX_ACTIVE)
    tokens, valid = _inputs(cfg, len(ROWS))

    got = np.asarray(lora_logits(params, bank, ids, weights, tokens, valid, cfg=cfg, spec=spec))
    base = np.asarray(base_logits(params, tokens, valid, cfg=cfg))
    for i, row in enumerate(ROWS):
        # The whole batch through row i's merged weights (reuses the compiled base forward).
        ref = np.asarray(base_logits(_merged_params(params, bank, spec, row), tokens, valid, cfg=cfg))[i]
        v = valid[i]
        assert _rel_err(got[i][v], ref[v]) <= 1e-5, f"row {i} ({row})"
    for i in ROWS_ACTIVE:  # the deltas are large enough that a dropped or misrouted expert shows
        assert _rel_err(base[i], got[i]) > 1e-2, f"row {i}: LoRA had no visible effect"


def test_unrolled_segments_and_kv_cache_compose_like_the_scanned_forward():
    """The sampler's path (per-layer dicts, prefill then decode with a KV cache) gives the same rows."""
    cfg, targets = CASES["llama-qvo"]
    spec = _spec(targets)
    params = _params(cfg, spec.n_adapt)
    bank = _trained_bank(cfg, spec)
    ids, weights = pad_active(ROWS, MAX_ACTIVE)
    tokens, valid = _inputs(cfg, len(ROWS), seq=6)
    full = np.asarray(lora_logits(params, bank, ids, weights, tokens, valid, cfg=cfg, spec=spec))

    @functools.partial(jax.jit, static_argnames=("cfg", "spec"))
    def prefill_decode(params, bank, ids, weights, tokens, valid, cfg, spec):
        lora = gather_lora(bank, spec, ids, weights)
        cache = init_cache(cfg, params, tokens.shape[0], tokens.shape[1])
        _, cache = forward(params, cfg, tokens[:, :-1], valid=valid[:, :-1], cache=cache, lora=lora)
        return forward(params, cfg, tokens[:, -1:], valid=valid[:, -1:], cache=cache, lora=lora,
                       logits_mode="last")[0]

    unrolled = unstack_segments(params)
    assert isinstance(unrolled["layers"][-1], tuple)
    last = prefill_decode(unrolled, bank, ids, weights, tokens, valid, cfg=cfg, spec=spec)
    assert _rel_err(last, full[:, -1]) <= 1e-5


# --------------------------------------------------------------------------- exact no-ops


@pytest.mark.parametrize("case, compose", [("llama-qvo", "gather"), ("llama-qvo", "onehot"), ("qwen3-kgud", "gather")])
def test_untrained_bank_and_weight_zero_slots_are_exact_noops(case, compose):
    """The LoRA term of such rows is exactly 0, so the projections are bitwise the base ones. With
    LoRA on k under Qwen3's k-norm, XLA fuses the norm with the (zero) add into a different kernel
    and the normalised k can move by an ulp; that case is held to 1e-6 instead of bitwise."""
    cfg, targets = CASES[case]
    spec = _spec(targets, compose)
    if case == "llama-qvo":
        same = np.testing.assert_array_equal
    else:
        def same(x, ref, err_msg=""):
            assert _rel_err(x, ref) <= 1e-6, err_msg
    params = _params(cfg, spec.n_adapt)
    ids, weights = pad_active(ROWS, MAX_ACTIVE)
    tokens, valid = _inputs(cfg, len(ROWS))
    base = np.asarray(base_logits(params, tokens, valid, cfg=cfg))

    fresh = _fresh_bank(cfg, spec)
    assert all(np.any(np.asarray(a) != 0) for a in fresh["a"].values())
    assert all(not np.any(np.asarray(b)) for b in fresh["b"].values())
    got = np.asarray(lora_logits(params, fresh, ids, weights, tokens, valid, cfg=cfg, spec=spec))
    same(got, base)

    trained = _trained_bank(cfg, spec)
    got = np.asarray(lora_logits(params, trained, ids, weights, tokens, valid, cfg=cfg, spec=spec))
    for i in ROWS_BASE:
        same(got[i], base[i], err_msg=f"row {i} ({ROWS[i]})")
    assert _rel_err(got[0], base[0]) > 1e-2


@pytest.mark.parametrize("compose", ["gather", "onehot"])
def test_changing_expert_ids_or_weights_does_not_recompile(compose):
    cfg, targets = CASES["llama-qvo"]
    spec = _spec(targets, compose)
    params = _params(cfg, spec.n_adapt)
    bank = _trained_bank(cfg, spec)
    tokens, valid = _inputs(cfg, 4)
    traces = []

    @functools.partial(jax.jit, static_argnames=("cfg", "spec"))
    def step(params, bank, ids, weights, tokens, valid, cfg, spec):
        traces.append(1)  # runs only while tracing
        return forward(params, cfg, tokens, valid=valid, lora=gather_lora(bank, spec, ids, weights))[0]

    batches = [
        [execute_set(spec, [0, 1]), execute_set(spec, [2, 3]), merge_set(spec, [[0], [3]]), []],
        [merge_set(spec, [[0, 1], [2, 3]])[:3], [(5, 1.0)], [(0, 0.0)], execute_set(spec, [3])],
        [[(1, 0.25), (1, 0.25), (4, 0.5)], [], [], [(2, 0.9)]],
    ]
    outs = []
    params, bank, tokens, valid = jax.device_put((params, bank, tokens, valid))
    for rows in batches:
        ids, weights = map(jnp.asarray, pad_active(rows, MAX_ACTIVE))
        outs.append(np.asarray(step(params, bank, ids, weights, tokens, valid, cfg=cfg, spec=spec)))
    # Same ids, new weights.
    outs.append(np.asarray(step(params, bank, ids, weights * 0.5, tokens, valid, cfg=cfg, spec=spec)))

    assert len(traces) == 1
    assert step._cache_size() == 1
    for a, b in zip(outs, outs[1:]):
        assert not np.array_equal(a, b)


@pytest.mark.parametrize("compose", ["gather", "onehot"])
def test_gradients_reach_only_experts_active_in_the_batch(compose):
    cfg, targets = CASES["llama-qvo"]
    spec = _spec(targets, compose)
    params = _params(cfg, spec.n_adapt)
    bank = _trained_bank(cfg, spec)  # B != 0, so A gets gradients too
    # Expert 0 is the padding id of every short row but is active nowhere.
    rows = [[(1, 0.5), (3, 0.5)], [(4, 1.0)], [], [(0, 0.0), (2, 0.0)]]
    ids, weights = pad_active(rows, MAX_ACTIVE)
    tokens, valid = _inputs(cfg, len(rows))
    proj = np.random.default_rng(2).standard_normal((len(rows), tokens.shape[1], cfg.vocab_size)).astype(np.float32)

    @jax.jit
    def grads(bank):
        def loss(bank):
            return jnp.sum(lora_logits(params, bank, ids, weights, tokens, valid, cfg=cfg, spec=spec) * proj)

        return jax.grad(loss)(bank)

    g = grads(bank)
    active = {1, 3, 4}
    for part in ("a", "b"):
        for t in targets:
            norms = np.abs(np.asarray(g[part][t])).reshape(spec.num_experts, -1).max(axis=1)
            for e in range(spec.num_experts):
                if e in active:
                    assert norms[e] > 0, f"{part}[{t}] expert {e}: no gradient"
                else:
                    assert norms[e] == 0, f"{part}[{t}] expert {e}: gradient {norms[e]} though inactive"


def test_out_of_range_ids_are_padding_in_both_compose_modes():
    """Traced ids cannot raise; both modes must drop them alike (plain indexing would wrap -1 to the
    last expert and clamp 6 to it while one_hot drops both)."""
    cfg, targets = CASES["llama-qvo"]
    params = _params(cfg, SPEC_KW["n_adapt"])
    tokens, valid = _inputs(cfg, len(ROWS))
    clean_ids, clean_w = pad_active(ROWS, MAX_ACTIVE)
    ids, weights = clean_ids.copy(), clean_w.copy()
    ids[1, 1:], weights[1, 1:] = (-1, 6), (0.7, 0.7)  # row 1: expert 1 plus two invalid slots
    ids[2], weights[2] = (-1, 6, 99), (1.0, 1.0, 1.0)  # row 2: nothing valid
    outs = {}
    for compose in ("gather", "onehot"):
        spec = _spec(targets, compose)
        bank = _trained_bank(cfg, spec)
        outs[compose] = np.asarray(lora_logits(params, bank, ids, weights, tokens, valid, cfg=cfg, spec=spec))
        clean = np.asarray(lora_logits(params, bank, clean_ids, clean_w, tokens, valid, cfg=cfg, spec=spec))
        np.testing.assert_array_equal(outs[compose][2], clean[2])  # = base: row 2 of ROWS is empty
        assert _rel_err(outs[compose], clean) <= 1e-6
    assert _rel_err(outs["gather"], outs["onehot"]) <= 1e-6


def test_gather_lora_shapes_and_input_checks():
    cfg, targets = CASES["llama-qvo"]
    ids, weights = pad_active(ROWS, MAX_ACTIVE)
    B = len(ROWS)
    for compose in ("gather", "onehot"):
        spec = _spec(targets, compose)
        bank = _fresh_bank(cfg, spec)
        lora = gather_lora(bank, spec, ids, weights)
        for t in targets:
            d_in, d_out = target_dims(cfg, t)
            assert bank["a"][t].shape == (spec.num_experts, spec.n_adapt, d_in, spec.rank)
            assert bank["b"][t].shape == (spec.num_experts, spec.n_adapt, spec.rank, d_out)
            lead = (spec.n_adapt, B, MAX_ACTIVE) if compose == "gather" else (spec.n_adapt, spec.num_experts)
            assert lora.a[t].shape == (*lead, d_in, spec.rank)
            assert lora.b[t].shape == (*lead, spec.rank, d_out)
        if compose == "gather":
            np.testing.assert_allclose(lora.scale, weights * spec.scaling, rtol=1e-7)
            np.testing.assert_array_equal(lora.a["q"][1, 0, 1], bank["a"]["q"][3, 1])
        else:
            assert lora.scale.shape == (B, spec.num_experts)
            np.testing.assert_allclose(lora.scale[0], np.array([0.5, 0, 0, 0.3, 0, 0.2]) * spec.scaling, rtol=1e-6)
            np.testing.assert_array_equal(lora.scale[3], 0.0)
        with pytest.raises(AssertionError):
            gather_lora(bank, spec, ids[0], weights[0])
        with pytest.raises(AssertionError):
            gather_lora(bank, spec, ids, weights[:, :2])

    spec = _spec(targets)
    bank = _fresh_bank(cfg, spec)
    unsplit = _numpy(_init_params(jax.random.PRNGKey(0), cfg))
    tokens, valid = _inputs(cfg, B)
    with pytest.raises(ValueError, match="split_segments"):
        forward(unsplit, cfg, tokens, lora=gather_lora(bank, spec, ids, weights))
    with pytest.raises(ValueError, match="n_adapt"):
        init_expert_bank(jax.random.PRNGKey(0), cfg, _spec(targets, n_adapt=cfg.num_layers + 1))


# --------------------------------------------------------------------------- active sets


def test_execute_set():
    spec = ExpertBankSpec()  # execute, merge + 4 subtask experts
    assert execute_set(spec, [1, 3]) == [(0, 1 / 3), (3, 1 / 3), (5, 1 / 3)]
    assert execute_set(spec, np.array([2])) == [(0, 0.5), (4, 0.5)]
    assert execute_set(spec, []) == [(0, 1.0)]
    assert execute_set(spec, [0], role="merge") == [(1, 0.5), (2, 0.5)]
    with pytest.raises(ValueError, match="duplicate"):
        execute_set(spec, [2, 2])
    with pytest.raises(ValueError, match="out of range"):
        execute_set(spec, [4])
    with pytest.raises(ValueError, match="out of range"):
        execute_set(spec, [-1])
    with pytest.raises(ValueError, match="unknown role"):
        execute_set(spec, [0], role="plan")


def test_merge_set_union_and_random_subset():
    spec = ExpertBankSpec()
    merge = spec.role_id("merge")
    assert merge_set(spec, [[0, 2], [2, 3]]) == [(merge, 0.25), (2, 0.25), (4, 0.25), (5, 0.25)]
    assert merge_set(spec, [[3, 1]]) == [(merge, 1 / 3), (3, 1 / 3), (5, 1 / 3)]
    assert merge_set(spec, []) == [(merge, 1.0)]
    assert merge_set(spec, [[], []], mode="random_subset") == [(merge, 1.0)]
    with pytest.raises(ValueError, match="merge mode"):
        merge_set(spec, [[0]], mode="intersection")
    with pytest.raises(ValueError, match="merge mode"):
        merge_set(spec, [], mode="intersection")

    union = {spec.subtask_id(k) for k in (0, 2, 3)}
    seen = set()
    for seed in range(60):
        s = merge_set(spec, [[0, 2], [3, 2]], mode="random_subset", rng=np.random.default_rng(seed))
        ids = [e for e, _ in s]
        assert ids[0] == merge
        sub = ids[1:]
        assert 1 <= len(sub) <= 2 and len(set(sub)) == len(sub) and set(sub) <= union
        assert all(w == pytest.approx(1 / len(ids)) for _, w in s)
        seen.add(frozenset(sub))
    assert len(seen) == 6  # all 3 singletons and all 3 pairs occur
    for seed in range(5):  # a single parent expert: the subset is that expert
        assert merge_set(spec, [[1], [1]], mode="random_subset", rng=np.random.default_rng(seed)) == [
            (merge, 0.5), (3, 0.5)]
    s = merge_set(spec, [[0, 1]], mode="random_subset")  # default rng
    assert 2 <= len(s) <= 3


def test_single_set_and_names():
    single = ExpertBankSpec(role_names=("single",), num_subtask=0, rank=24, alpha=48.0)
    assert single.num_experts == 1 and single_set(single) == [(0, 1.0)]
    assert expert_name(single, 0) == "role_single"
    spec = ExpertBankSpec()
    with pytest.raises(ValueError, match="exactly one expert"):
        single_set(spec)
    assert [expert_name(spec, e) for e in range(spec.num_experts)] == [
        "role_execute", "role_merge", "subtask_0", "subtask_1", "subtask_2", "subtask_3"]
    assert spec.subtask_id(0) == 2 and spec.role_id("merge") == 1


def test_pad_active():
    ids, weights = pad_active([[(3, 0.5), (1, 0.5)], [], [(2, 1.0)]], 3)
    assert ids.dtype == np.int32 and weights.dtype == np.float32
    np.testing.assert_array_equal(ids, [[3, 1, 0], [0, 0, 0], [2, 0, 0]])
    np.testing.assert_array_equal(weights, [[0.5, 0.5, 0], [0, 0, 0], [1, 0, 0]])
    assert pad_active([], 2)[0].shape == (0, 2)
    with pytest.raises(ValueError, match=r"row 1 has 3 active experts, more than max_active=2"):
        pad_active([[(0, 1.0)], [(0, 0.3), (1, 0.3), (2, 0.4)]], 2)
    with pytest.raises(ValueError, match=r"row 0: expert id -1 out of range"):
        pad_active([[(-1, 1.0)]], 2)
    with pytest.raises(ValueError, match=r"row 1: expert id 6 out of range \[0, 6\)"):
        pad_active([[(5, 1.0)], [(6, 1.0)]], 2, num_experts=6)
    with pytest.raises(ValueError, match="non-finite weight"):
        pad_active([[(0, float("nan"))]], 2)
    with pytest.raises(ValueError, match="max_active must be positive"):
        pad_active([[]], 0)


@pytest.mark.parametrize("kwargs, field", [
    (dict(rank=0), "mole.rank"),
    (dict(rank=-8), "mole.rank"),
    (dict(n_adapt=0), "mole.n_adapt"),
    (dict(role_names=(), num_subtask=0), "at least one expert"),
    (dict(num_subtask=-1), "at least one expert"),
    (dict(targets=("q", "qkv")), "mole.targets"),
    (dict(targets=()), "mole.targets"),
    (dict(compose="dense"), "mole.compose"),
    (dict(alpha=0.0), "mole.alpha"),
    (dict(targets="qvo"), "mole.targets must be a sequence"),
    (dict(targets=("q", "v", "q")), "mole.targets has duplicates"),
    (dict(role_names=("execute", "execute")), "mole.role_names has duplicates"),
])
def test_spec_validation(kwargs, field):
    with pytest.raises(ValueError, match=field):
        ExpertBankSpec(**kwargs)


def test_spec_ids_and_errors():
    spec = ExpertBankSpec(num_subtask=3)
    assert (spec.num_roles, spec.num_experts, spec.scaling) == (2, 5, 2.0)
    hash(spec)  # a jit static argument
    from_config = ExpertBankSpec(role_names=["execute", "merge"], targets=["q", "v", "o"], num_subtask=3)
    assert from_config == spec and hash(from_config) == hash(spec)  # lists (from a config) become tuples
    with pytest.raises(ValueError, match="unknown role"):
        spec.role_id("critic")
    with pytest.raises(ValueError, match="out of range"):
        spec.subtask_id(3)


# --------------------------------------------------------------------------- PEFT export


def _hf_llama(tmp_path, cfg_kwargs):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    hf_cfg = LlamaConfig(**cfg_kwargs)
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = LlamaForCausalLM(hf_cfg).to(torch.float32).eval()
        model.save_pretrained(tmp_path)
    return model


@pytest.mark.parametrize("targets", [("q", "v", "o"), ("k", "gate", "up", "down")])
def test_peft_round_trip(tmp_path, targets):
    """One exported expert, applied by PEFT to the transformers model, gives our logits."""
    import torch
    from peft import PeftModel

    from morse_jax.models import load_backbone

    model = _hf_llama(tmp_path / "base", dict(
        vocab_size=61, hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-6, tie_word_embeddings=False,
        initializer_range=0.15, attn_implementation="eager"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        backbone = load_backbone(tmp_path / "base", tokenizer=False)
    cfg = backbone.config
    spec = _spec(targets)
    params = split_segments(backbone.params, spec.n_adapt)
    bank = _trained_bank(cfg, spec, seed=3, b_std=0.5)  # random A and B
    expert = spec.subtask_id(1)

    out = export_peft(bank, spec, cfg, expert, tmp_path / "adapter", base_model_name_or_path="tiny")
    conf = json.loads((out / "adapter_config.json").read_text())
    assert (conf["r"], conf["lora_alpha"]) == (spec.rank, spec.alpha)
    assert conf["layers_to_transform"] == [1, 2]

    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 9)).astype(np.int32)
    with torch.no_grad():
        hf_base = model(torch.from_numpy(tokens).long()).logits.numpy()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            peft_model = PeftModel.from_pretrained(model, str(out)).eval()
        hf_lora = peft_model(torch.from_numpy(tokens).long()).logits.numpy()
    ids, weights = pad_active([[(expert, 1.0)]] * 2, 1)
    ones = jnp.ones(tokens.shape, bool)
    ours = np.asarray(lora_logits(params, bank, ids, weights, jnp.asarray(tokens), ones, cfg=cfg, spec=spec))

    scale = np.max(np.abs(hf_lora))
    assert np.max(np.abs(ours - hf_lora)) <= 1e-4 * scale
    assert np.max(np.abs(hf_base - hf_lora)) > 1e-2 * scale  # the adapter does change the output


def test_export_all_writes_one_adapter_per_expert(tmp_path):
    from safetensors.numpy import load_file

    cfg, targets = CASES["llama-qvo"]
    spec = _spec(targets)
    bank = _trained_bank(cfg, spec)
    dirs = export_all(bank, spec, cfg, tmp_path)
    assert [d.name for d in dirs] == [expert_name(spec, e) for e in range(spec.num_experts)]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(d.name for d in dirs)
    first = cfg.num_layers - spec.n_adapt
    for e, d in enumerate(dirs):
        tensors = load_file(str(d / "adapter_model.safetensors"))
        assert len(tensors) == 2 * len(targets) * spec.n_adapt
        name = f"base_model.model.model.layers.{first + 1}.self_attn.o_proj"
        np.testing.assert_array_equal(tensors[f"{name}.lora_A.weight"], np.asarray(bank["a"]["o"][e, 1]).T)
        np.testing.assert_array_equal(tensors[f"{name}.lora_B.weight"], np.asarray(bank["b"]["o"][e, 1]).T)
        assert json.loads((d / "adapter_config.json").read_text())["target_modules"] == ["o_proj", "q_proj", "v_proj"]
    with pytest.raises(ValueError, match="out of range"):
        export_peft(bank, spec, cfg, spec.num_experts, tmp_path / "bad")
