"""The reasoner's first thought read as a closed-set choice over the "names" template
(``run.closed_thought``, ``first_thought="closed"``): with a scorer that prefers one thought, the
step-by-step choice writes exactly that thought (number of calls, then each name); the scores are
the model's log-likelihood of each partial turn (reference: full logits, by definition); and the
role loop uses the chosen turn instead of generating one."""

from __future__ import annotations

import jax
import numpy as np
import pytest

import chat_common
from role_common import CFG, MOR, acting_mor_params, episode_logprob

from morse_jax.config.defaults import get_config
from morse_jax.config.validate import ConfigError, validate_config
from morse_jax.models import init_params
from morse_jax.models.loading import Backbone
from morse_jax.models.transformer import split_segments
from morse_jax.run import closed_thought as ct
from morse_jax.run import role_loop as rl
from morse_jax.run.continuation_scorer import ContinuationScorer
from morse_jax.sampling.requests import Completion
from morse_jax.tasks.bfcl.trajectories import names_thought
from morse_jax.tasks.trajectories import Trajectory, Turn


@pytest.fixture(scope="module")
def tok():
    return chat_common.char_tokenizer()


def _start(user, names):
    return Trajectory(turns=(Turn("user", user),), system="S", functions=tuple({"name": n} for n in names))


def _reasoner_text(tok, ids):
    return tok.decode(list(ids)).rsplit("<|im_start|>assistant\n", 1)[1]


def _prefers(tok, targets, calls):
    """A scorer that gives 0 to a continuation whose reasoner text is a prefix of its episode's target
    thought and -1 to any other; records every call's continuations in ``calls``."""

    def score(conts):
        calls.append(conts)
        out = []
        for c in conts:
            user = tok.decode(list(c.ids)).split("<|im_start|>user\n")[1][0]
            out.append(0.0 if targets[user].startswith(_reasoner_text(tok, c.ids)) else -1.0)
        return out

    return score


def test_the_preferred_thought_is_written_exactly(tok):
    offered = {"a": ["f", "g", "gh"], "b": ["f", "g"], "c": ["only"], "d": ["f", "g"], "e": ["f", "g", "h"]}
    targets = {"a": names_thought(["gh"], offered["a"]),          # "g" is a prefix of "gh": closed by ","
               "b": names_thought(["g", "g", "f"], offered["b"]),  # repeated names, any order
               "c": names_thought(["only", "only"], offered["c"]),  # one function: only the count is scored
               "d": names_thought([], offered["d"]),               # no call
               "e": names_thought(["h", "f", "g", "f"], offered["e"])}  # MAX_CALLS calls
    calls = []
    starts = [_start(u, offered[u]) for u in targets]
    picks = ct.choose_first_thoughts(starts, _prefers(tok, targets, calls), tok)
    assert [p.text for p in picks] == list(targets.values())
    assert [p.role for p in picks] == ["executor", "executor", "executor", "summarizer", "executor"]
    # the recorded head scores are the scorer's: 0 for the target's count, -1 for the others
    assert picks[1].scores == (-1.0, -1.0, -1.0, 0.0, -1.0)
    # rounds: heads of all five, then one name per round for the episodes with several functions
    assert [len(c) for c in calls] == [5 * (ct.MAX_CALLS + 1), 3 + 2 + 3, 2 + 3, 2 + 3, 3]
    for conts in calls:  # one episode's candidates share their start and differ right there
        for c in conts:
            assert 0 < c.start < len(c.ids)
            assert all(r == rl.ROLE_NAMES.index("reasoner") for r in c.roles[c.start:])


def test_no_function_offered_means_no_call_without_scoring(tok):
    calls = []
    picks = ct.choose_first_thoughts([_start("a", [])], _prefers(tok, {}, calls), tok)
    assert picks == [rl.ChosenTurn("summarizer", names_thought([], []))] and calls == []


def test_no_call_bias_moves_only_the_count(tok):
    """A bias on the "no call" head flips the choice exactly when it exceeds the margin."""
    targets = {"a": names_thought(["g"], ["f", "g"])}  # preferred by a margin of 1 over no call
    start = [_start("a", ["f", "g"])]
    assert ct.choose_first_thoughts(start, _prefers(tok, targets, []), tok, no_call_bias=0.99)[0].text == targets["a"]
    flipped = ct.choose_first_thoughts(start, _prefers(tok, targets, []), tok, no_call_bias=1.01)[0]
    assert (flipped.role, flipped.text) == ("summarizer", names_thought([], ["f", "g"]))
    assert flipped.scores == (-1.0, 0.0, -1.0, -1.0, -1.0)  # recorded without the bias


def test_choices_follow_the_model_likelihood(tok):
    params = init_params(jax.random.PRNGKey(0), CFG)
    backbone = Backbone(config=CFG, params=params, tokenizer=tok)
    frozen = split_segments(params, MOR.n_adapt)
    trainable = acting_mor_params(3)
    scorer = ContinuationScorer(backbone, MOR)
    start = _start("do it", ["f", "g"])

    def score(conts):
        return scorer(trainable, conts)

    heads = [ct.names_head(k) for k in range(ct.MAX_CALLS + 1)]
    got = score(ct.candidate_continuations(start, heads, tok))
    full = [episode_logprob(frozen, trainable, start, tok, reasoner_text=h, end_of_turn=False) for h in heads]
    np.testing.assert_allclose(np.subtract(got, got[0]), np.subtract(full, full[0]), atol=3e-4)
    k = int(np.argmax(full))
    names = []
    for _ in range(k):  # each name: the likelier of the two, given the names before it
        prefix = ct.names_head(k) + " " + "".join(n + ", " for n in names)
        names.append(["f", "g"][int(np.argmax([episode_logprob(frozen, trainable, start, tok, reasoner_text=prefix + n + ",",
                                                                   end_of_turn=False)
                                               for n in ("f", "g")]))])
    chosen = ct.choose_first_thoughts([start], score, tok)[0]
    assert (chosen.role, chosen.text) == ("executor" if k else "summarizer", names_thought(names, ["f", "g"]))


def test_role_loop_uses_the_chosen_first_turn(tok):
    """With first_thought="closed" the first reasoner turn is chose_first's, never generated; the
    episode goes where it hands over."""
    generated = []

    def generate(reqs):
        generated.extend(rl.ROLE_NAMES[r.role] for r in reqs)
        return [Completion(token_ids=[0], text="[f(x=1)]" if rl.ROLE_NAMES[r.role] == "executor" else "Sorry.",
                           logprobs=np.zeros(0), finish_reason="eos", prompt_len=len(r.prompt_ids)) for r in reqs]

    def choose(trajs):
        return [rl.ChosenTurn("executor", "Plan: call f. Next: executor."),
                rl.ChosenTurn("summarizer", "Plan: no call. Next: summarizer.", (0.5,))]

    starts = [_start("a", ["f"]), _start("b", ["f"])]
    cfg = rl.RoleLoopConfig(first_thought="closed")
    eps = rl.run_role_loop(starts, generate, tok, cfg, score=lambda c: [0.0] * len(c), choose_first=choose)
    assert sorted(generated) == ["executor", "summarizer"]
    assert [(t.role, t.content) for t in eps[0].traj.turns[1:]] == [("reasoner", "Plan: call f. Next: executor."),
                                                                  ("executor", "[f(x=1)]")]
    assert rl.executor_text(eps[1]) == "" and eps[1].first_scores == (0.5,)
    with pytest.raises(ValueError, match="needs a choose_first function"):
        rl.run_role_loop(starts, generate, tok, cfg, score=lambda c: [0.0] * len(c))
    with pytest.raises(ValueError, match="first_thought must be one of"):
        rl.RoleLoopConfig(first_thought="free")


@pytest.mark.parametrize("field, value", [("first_thought", "closed"), ("executor", "guided")])
def test_config_checks_the_thought_style(field, value):
    """Both readings of the "names" template (the closed first thought, the guided executor) need a
    reasoner trained on it, and take only their known values."""
    c = get_config()
    c.system, c.variant, c.mode = "moragent", "mor", "train"
    c.moragent[field] = value
    validate_config(c, check_paths=False)
    c.moragent.thought = "plan"
    with pytest.raises(ConfigError, match=field):
        validate_config(c, check_paths=False)
    c.moragent.thought, c.moragent[field] = "names", "sometimes"
    with pytest.raises(ConfigError, match=field):
        validate_config(c, check_paths=False)
