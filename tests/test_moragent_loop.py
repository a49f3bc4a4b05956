"""MoRAgent's inference: per-token role ids through the sampler (a toy role adapter on a tiny random
model, against a step-by-step reference that recomputes every sequence from scratch), the role
loop's course (which role speaks when, rows of several roles in one generation call) and its
prompts' role ids."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import chat_common


from morse_jax.models import ModelConfig, init_params
from morse_jax.models import decode as D
from morse_jax.models.loading import Backbone
from morse_jax.mor.batch import NO_ROLE
from morse_jax.run import role_loop as rl
from morse_jax.sampling.requests import Completion, Request, SamplerConfig
from morse_jax.sampling.sampler import Sampler
from morse_jax.tasks.trajectories import Trajectory, Turn

CFG = ModelConfig(family="llama", vocab_size=61, hidden_size=32, intermediate_size=48, num_layers=3, num_heads=4,
                  num_kv_heads=2, head_dim=8)
N_ROLES, N_ADAPT = 3, 2


@pytest.fixture(scope="module")
def char_tokenizer():
    return chat_common.char_tokenizer()


class RoleDelta(NamedTuple):
    """A toy per-token role adapter on the "o" projection: token of role r adds x @ W[r]; NO_ROLE adds 0."""

    w: jax.Array  # [R, d, d]
    roles: jax.Array  # int32[B, T] (rows) or int32[B] (columns)

    def deltas(self, x, group, out_dims, columns):
        if group != "o":
            return {}
        onehot = jax.nn.one_hot(self.roles, self.w.shape[0], dtype=x.dtype)  # -1 -> all zeros
        if columns:  # x [d, B]
            return {"o": jnp.einsum("db,rdo,br->ob", x, self.w, onehot)}
        return {"o": jnp.einsum("btd,rdo,btr->bto", x, self.w, onehot)}


class ToyRoleAdapter:
    num_roles = N_ROLES

    def layers(self, params, role_ids):
        return tuple(RoleDelta(params[i], role_ids) for i in range(params.shape[0]))


@pytest.fixture(scope="module")
def tiny():
    params = jax.jit(init_params, static_argnums=1)(jax.random.PRNGKey(0), CFG)
    rng = np.random.default_rng(1)
    d = CFG.hidden_size
    adapter_params = jnp.asarray(0.3 * rng.normal(size=(N_ADAPT, N_ROLES, d, d)), jnp.float32)
    return Backbone(config=CFG, params=params, tokenizer=None), adapter_params


def _reference_greedy(backbone, adapter_params, prompt, prompt_roles, role, n_new):
    """Greedy continuation recomputed from scratch at every step (rows layout, per-token roles:
    the prompt's, then ``role`` for every generated token)."""
    dp = D.decode_params(backbone.params, CFG)
    seq, roles, out = list(prompt), list(prompt_roles), []
    for _ in range(n_new):
        T = len(seq)
        cache = D.init_decode_cache(CFG, 1, T)
        lora = ToyRoleAdapter().layers(adapter_params, jnp.asarray([roles], jnp.int32))
        logits, _ = D.forward_cached(dp, CFG, jnp.asarray([seq], jnp.int32), jnp.ones((1, T), bool),
                                     jnp.arange(T, dtype=jnp.int32)[None], cache, lora)
        tok = int(jnp.argmax(logits[0]))
        out.append(tok)
        seq.append(tok)
        roles.append(role)
    return out


def test_sampler_runs_every_token_under_its_role(tiny):
    backbone, ap = tiny
    sampler = Sampler(backbone, None, SamplerConfig(cpu_kernels="off", prefill_rows=8), role_adapter=ToyRoleAdapter())
    rng = np.random.default_rng(2)
    rows = []  # (prompt, prompt roles, generated role): rows of different roles, a role change mid-prompt
    for n, role in ((9, 0), (5, 2), (12, 1), (7, NO_ROLE)):
        prompt = rng.integers(3, CFG.vocab_size, n).tolist()
        proles = [NO_ROLE] * (n // 2) + [role] * (n - n // 2)
        if n == 12:
            proles = [NO_ROLE] * 3 + [0] * 4 + [NO_ROLE] * 2 + [1] * 3  # reasoner turn, glue, executor header
        rows.append((prompt, proles, role))
    reqs = [Request(prompt_ids=p, prompt_roles=pr, role=r, max_new_tokens=6, temperature=0.0) for p, pr, r in rows]
    comps = sampler.generate(ap, reqs, key=jax.random.PRNGKey(0))
    for (p, pr, r), c in zip(rows, comps):
        assert c.token_ids == _reference_greedy(backbone, ap, p, pr, r, 6)
    # a row with no role anywhere is exactly the base model
    base = Sampler(backbone, None, SamplerConfig(cpu_kernels="off", prefill_rows=8))
    plain = base.generate(None, [Request(prompt_ids=rows[3][0], max_new_tokens=6, temperature=0.0)],
                          key=jax.random.PRNGKey(0))
    no_role = sampler.generate(ap, [Request(prompt_ids=rows[3][0], max_new_tokens=6, temperature=0.0)],
                               key=jax.random.PRNGKey(0))
    assert plain[0].token_ids == no_role[0].token_ids
    np.testing.assert_allclose(plain[0].logprobs, no_role[0].logprobs, atol=1e-5)


def test_role_ids_are_checked(tiny):
    backbone, _ = tiny
    base = Sampler(backbone, None, SamplerConfig(cpu_kernels="off"))
    with pytest.raises(ValueError, match="no role adapter"):
        base.generate(None, [Request(prompt_ids=[3, 4], role=0)], key=jax.random.PRNGKey(0))
    roles = Sampler(backbone, None, SamplerConfig(cpu_kernels="off"), role_adapter=ToyRoleAdapter())
    with pytest.raises(ValueError, match=r"role ids must be in \[-1, 3\)"):
        roles.generate(None, [Request(prompt_ids=[3, 4], role=3)], key=jax.random.PRNGKey(0))
    with pytest.raises(ValueError, match="prompt_roles has 1 ids for 2"):
        roles.generate(None, [Request(prompt_ids=[3, 4], prompt_roles=[0])], key=jax.random.PRNGKey(0))


def test_next_role():
    assert rl.next_role("Call f with x=1. Next: executor.") == "executor"
    assert rl.next_role("None applies. Next: summarizer.") == "summarizer"
    assert rl.next_role("next role: Summarizer") == "summarizer"
    assert rl.next_role("I will do [f(x=1)]") == "executor"  # no marker, but a call
    assert rl.next_role("I don't know.") == "summarizer"


def test_turn_prompt_role_ids(char_tokenizer):
    traj = Trajectory(turns=(Turn("user", "do f"), Turn("reasoner", "ok. Next: executor.")), system="S")
    ids, roles = rl.turn_prompt(traj, "executor", char_tokenizer)
    assert char_tokenizer.decode(ids) == ("<|im_start|>system\nS<|im_end|>\n<|im_start|>user\ndo f<|im_end|>\n"
                                          "<|im_start|>assistant\nok. Next: executor.<|im_end|>\n"
                                          "<|im_start|>assistant\n")
    text = [char_tokenizer.convert_ids_to_tokens(i) for i in ids]
    header = len("<|im_start|>assistant\n".replace("<|im_start|>", "#"))  # one token for the special token
    assert roles[-header:] == [1] * header  # the generation header runs under the executor's group
    reasoner = [i for i, r in enumerate(roles) if r == 0]
    assert "".join(text[reasoner[0]:reasoner[-1] + 1]).startswith("<|im_start|>assistant\nok. Next: executor.")
    assert all(r == NO_ROLE for r in roles[:reasoner[0]])  # system and user: no adapter


def test_role_loop_course(char_tokenizer):
    """Scripted completions: the loop asks the roles in the right order, several roles in one call."""
    script = {  # (episode's user text, role) -> the turn's text
        ("a", "reasoner"): "use f. Next: executor.", ("a", "executor"): "[f(x=1)]",
        ("b", "reasoner"): "nothing applies. Next: summarizer.", ("b", "summarizer"): "Sorry.",
    }
    calls = []

    def generate(reqs):
        calls.append([r.role for r in reqs])
        out = []
        for r in reqs:
            text = char_tokenizer.decode(r.prompt_ids)
            user = text.split("<|im_start|>user\n")[1][0]
            reply = script[(user, rl.ROLE_NAMES[r.role])]
            out.append(Completion(token_ids=[0] * len(reply), text=reply, logprobs=np.zeros(0), finish_reason="eos",
                                  prompt_len=len(r.prompt_ids)))
        return out

    starts = [Trajectory(turns=(Turn("user", u),), system="S") for u in ("a", "b")]
    eps = rl.run_role_loop(starts, generate, char_tokenizer, rl.RoleLoopConfig(role_choice="text"))
    assert calls == [[0, 0], [1, 2]]  # round 2: an executor row and a summarizer row together
    assert rl.executor_text(eps[0]) == "[f(x=1)]" and rl.executor_text(eps[1]) == ""
    assert [t.role for t in eps[1].traj.turns] == ["user", "reasoner", "summarizer"]
    # with an environment: executor -> observation -> reasoner again, bounded by max_turns
    script[("a", "reasoner")] = "use f. Next: executor."
    calls.clear()
    eps = rl.run_role_loop(starts[:1], generate, char_tokenizer,
                           rl.RoleLoopConfig(max_turns=4, stop_after_executor=False, role_choice="text"), observe=lambda t: "ok")
    assert [t.role for t in eps[0].traj.turns] == ["user", "reasoner", "executor", "observation", "reasoner",
                                                   "executor"]
