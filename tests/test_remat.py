"""Layer rematerialisation of the update (``train.remat``): same loss and gradients, less memory.

``"layer"`` runs each adapted layer under ``jax.checkpoint``: the backward pass recomputes the
layer's attention instead of keeping every layer's ``[B, H, T, T]`` scores and probabilities. The
values must not change (only what is kept between the passes does), XLA's temporary memory for
the compiled LoRA-gradient program must drop by at least the attention tensors of all but one
adapted layer, and ``parallel.memory_plan`` must model both programs.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from morse_jax.config.validate import ConfigError, validate_config
from morse_jax.config.defaults import get_config
from morse_jax.config.paper import paper_config
from morse_jax.models import ModelConfig, init_params
from morse_jax.models.transformer import forward, split_segments, unstack_segments
from morse_jax.mole.experts import ExpertBankSpec, execute_set, gather_lora
from morse_jax.parallel.memory import memory_plan
from morse_jax.rl.examples import RouteExample, SequenceExample
from morse_jax.rl.update import Trainer, TrainConfig, init_trainable, lora_gradients


def _cfg(n_adapt: int, heads: int = 4, vocab: int = 64) -> ModelConfig:
    return ModelConfig(family="llama", vocab_size=vocab, hidden_size=32, intermediate_size=64,
                       num_layers=n_adapt + 1, num_heads=heads, num_kv_heads=2, head_dim=8)


def _examples(cfg: ModelConfig, spec: ExpertBankSpec, rng, rows: int, prompt: int, completion: int,
              per_prompt: int = 1):
    """``rows`` candidates, ``per_prompt`` of them sharing each prompt and active set, with the
    sampler's prefix states (the residual stream entering the first adapted layer), as a training
    run hands them to the update."""
    out = []
    for i in range(rows):
        g = i // per_prompt
        p_rng = np.random.default_rng(g)
        p_ids = p_rng.integers(1, cfg.vocab_size, prompt).tolist()
        c = completion if i == 0 else int(rng.integers(1, completion + 1))
        ids, ws = zip(*execute_set(spec, [g % 4, (g + 1) % 4]))
        states = rng.standard_normal((prompt + c, cfg.hidden_size)).astype(np.float32)
        out.append(SequenceExample(p_ids, rng.integers(1, cfg.vocab_size, c).tolist(),
                                   (-1.0 - rng.random(c)).astype(np.float32), ids, ws, float(rng.normal()),
                                   prefix_states=states))
    return out


def _trainable(cfg, spec, tcfg):
    t = init_trainable(jax.random.key(1), cfg, spec, tcfg)
    # non-zero B, so the experts change the forward pass and every A gets a gradient
    t["bank"]["b"] = jax.tree.map(lambda x: 0.1 * jax.random.normal(jax.random.key(2), x.shape), t["bank"]["b"])
    return t


def _max_rel(a, b) -> float:
    return max(float(jnp.max(jnp.abs(x - y)) / (jnp.max(jnp.abs(y)) + 1e-30))
               for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


@pytest.mark.slow
@pytest.mark.parametrize("share_prompts", [False, True])
def test_layer_remat_keeps_loss_and_gradients(share_prompts):
    """One optimiser step (LoRA micro-batches + router + AdamW) on a batch built by the Trainer,
    with and without remat: same loss, same LoRA gradient, same updated bank and router."""
    spec = ExpertBankSpec(n_adapt=2)
    cfg = _cfg(spec.n_adapt)
    params = init_params(jax.random.key(0), cfg)
    params["lm_head"] = params["lm_head"] * 10.0  # logits that depend on the hidden state
    rng = np.random.default_rng(0)
    seqs = _examples(cfg, spec, rng, rows=4, prompt=9, completion=7, per_prompt=2 if share_prompts else 1)
    routes = [RouteExample(rng.integers(1, cfg.vocab_size, 6).tolist(), (0, 1), -1.5, 1.0)]
    out = {}
    for remat in ("none", "layer"):
        tcfg = TrainConfig(lora_lr=0.05, router_lr=0.05, micro_batch=2, router_dim=8, share_prompts=share_prompts,
                           remat=remat)
        trainer = Trainer(cfg, params, spec, tcfg)
        if remat == "none":  # behaviour log-probs near the current policy's, so few tokens are clipped
            lps = trainer.logprobs(_trainable(cfg, spec, tcfg)["bank"], seqs)
            seqs = [dataclasses.replace(e, behaviour_logprobs=lp + 0.05 * rng.standard_normal(lp.shape)
                                        .astype(np.float32)) for e, lp in zip(seqs, lps)]
        batch = trainer.batch(seqs, routes, num_groups=2)
        assert hasattr(batch.sequences[0], "prompt_tokens") == share_prompts  # the layout asked for
        assert batch.sequences[0].states is not None  # the update starts at the first adapted layer
        trainable = _trainable(cfg, spec, tcfg)
        grad, metrics = jax.jit(functools.partial(lora_gradients, model_cfg=cfg, spec=spec, cfg=tcfg,
                                                  start_layer=trainer.start_layer))(trainable, trainer.frozen,
                                                                                    batch.sequences[0])
        new, _, step_metrics = trainer.update(trainable, trainer.init_opt_state(trainable), seqs, routes,
                                              num_groups=2)
        out[remat] = (grad, float(metrics["lora_loss"]), new, step_metrics)
    (g0, l0, _, m0), (g1, l1, _, m1) = out["none"], out["layer"]
    assert float(optax_norm(g0)) > 0
    np.testing.assert_allclose(l1, l0, rtol=1e-6, atol=1e-8)
    assert _max_rel(g1, g0) < 1e-5
    # (not the updated params: Adam divides by sqrt(v), so gradient entries at rounding level
    # become lr-sized steps whichever way they round)
    np.testing.assert_allclose(m1["lora_loss"], m0["lora_loss"], rtol=1e-6, atol=1e-8)
    np.testing.assert_allclose(m1["grad_norm_lora"], m0["grad_norm_lora"], rtol=1e-5)
    np.testing.assert_allclose(m1["grad_norm_router"], m0["grad_norm_router"], rtol=1e-5)


def optax_norm(tree):
    return jnp.sqrt(sum(jnp.sum(jnp.square(x)) for x in jax.tree.leaves(tree)))


@pytest.mark.parametrize("unrolled", [False, True])
def test_layer_remat_keeps_forward_gradients(unrolled):
    """``forward``'s scanned (stacked) and unrolled (per-layer dicts) segments: same value and
    LoRA gradient with the adapted layers rematerialised."""
    spec = ExpertBankSpec(n_adapt=2)
    cfg = _cfg(spec.n_adapt)
    params = split_segments(init_params(jax.random.key(0), cfg), spec.n_adapt)
    if unrolled:
        params = unstack_segments(params)
    tcfg = TrainConfig(router_dim=8)
    bank = _trainable(cfg, spec, tcfg)["bank"]
    tokens = jax.random.randint(jax.random.key(3), (2, 12), 0, cfg.vocab_size)
    ids = jnp.array([[0, 2, 3, 0], [1, 4, 5, 0]], jnp.int32)
    weights = jnp.array([[1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 1.0, 0.0]])

    def loss(bank, remat):
        lora = gather_lora(bank, spec, ids, weights)
        logits, _ = forward(params, cfg, tokens, lora=lora, remat=remat)
        return jnp.sum(jax.nn.log_softmax(logits)[..., 0] * jnp.arange(12.0))

    v0, g0 = jax.value_and_grad(loss)(bank, "none")
    v1, g1 = jax.value_and_grad(loss)(bank, "layer")
    np.testing.assert_allclose(float(v1), float(v0), rtol=1e-6)
    assert float(optax_norm(g0)) > 0
    assert _max_rel(g1, g0) < 1e-5


def test_remat_values_are_checked():
    with pytest.raises(ValueError, match="train.remat"):
        TrainConfig(remat="full")
    cfg = _cfg(2)
    with pytest.raises(ValueError, match="remat"):
        forward(init_params(jax.random.key(0), cfg), cfg, jnp.zeros((1, 4), jnp.int32), remat="layers")
    c = get_config()
    c.train.remat = "all"
    with pytest.raises(ConfigError, match="config.train.remat"):
        validate_config(c, check_paths=False)
    with pytest.raises(ValueError, match="remat"):
        memory_plan(cfg, ExpertBankSpec(n_adapt=2), remat="x")


def test_paper_configs_remat_and_cpu_configs_do_not():
    assert get_config().train.remat == "none"
    for backbone in ("qwen3_4b", "llama31_8b", "gemma4_31b"):
        assert paper_config(backbone, "scicode").train.remat == "layer"


# ----------------------------------------------------------------------- memory: XLA and the plan

T, HEADS, N_ADAPT, ROWS = 512, 4, 4, 2  # T^2 attention dominates the program's memory


@pytest.fixture(scope="module")
def temp_bytes():
    """XLA's temporary bytes of the compiled LoRA-gradient program for one flat micro-batch of
    ROWS x T tokens (prompt T/2 + completion T/2, from prefix states), per remat setting."""
    spec = ExpertBankSpec(n_adapt=N_ADAPT)
    cfg = _cfg(N_ADAPT, heads=HEADS, vocab=256)
    params = init_params(jax.random.key(0), cfg)
    seqs = _examples(cfg, spec, np.random.default_rng(0), rows=ROWS, prompt=T // 2, completion=T // 2)
    out = {}
    for remat in ("none", "layer"):
        tcfg = TrainConfig(micro_batch=ROWS, length_buckets=(T,), completion_buckets=None, share_prompts=False,
                           router_dim=8, remat=remat)
        trainer = Trainer(cfg, params, spec, tcfg)
        micro = trainer.batch(seqs, [], num_groups=1).sequences[0]
        assert micro.tokens.shape == (ROWS, T)
        fn = jax.jit(functools.partial(lora_gradients, model_cfg=cfg, spec=spec, cfg=tcfg,
                                       start_layer=trainer.start_layer))
        analysis = fn.lower(_trainable(cfg, spec, tcfg), trainer.frozen, micro).compile().memory_analysis()
        if analysis is None:
            pytest.skip("memory_analysis() is None on this backend")
        out[remat] = analysis.temp_size_in_bytes
    return cfg, spec, out


def test_layer_remat_frees_the_attention_of_all_but_one_layer(temp_bytes):
    _, _, temp = temp_bytes
    scores = ROWS * HEADS * T * T * 4  # one layer's float32 [B, H, T, T]
    # "none" keeps at least scores and probabilities of every adapted layer; "layer" one layer's
    # at a time: the gap is at least one such tensor per adapted layer beyond the first
    assert temp["none"] - temp["layer"] >= (N_ADAPT - 1) * scores, temp


@pytest.mark.parametrize("remat", ["none", "layer"])
def test_memory_plan_models_the_compiled_update(temp_bytes, remat):
    """The plan's update activations against XLA's temporary bytes (CPU, float32): within
    -20 % / +40 % (the plan counts every residual at full size and one layer's float32 cotangents
    whole; XLA reuses and fuses buffers, most for the recomputed layer under "layer")."""
    cfg, spec, temp = temp_bytes
    plan = memory_plan(cfg, spec, batch=ROWS, cache_len=T, seq_len=T, dtype="float32", remat=remat)
    ratio = plan.components["update activations"] / temp[remat]
    assert 0.8 <= ratio <= 1.4, (remat, ratio)
