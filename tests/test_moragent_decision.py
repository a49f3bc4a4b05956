"""The reasoner's hand-over read as a closed-set choice (``run.role_loop``, role_choice="likelihood"):
the decision scores are the model's log-likelihood of each closed reasoner turn (reference: the
whole rendered episode's log-probability from full logits, by definition), the loop keeps the
likelier decision whatever the text wrote, and the thought is the text before its marker."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest

import chat_common
from role_common import CFG, MOR, acting_mor_params, episode_logprob

from morse_jax.models import init_params
from morse_jax.models.loading import Backbone
from morse_jax.models.transformer import split_segments
from morse_jax.run import role_loop as rl
from morse_jax.run.continuation_scorer import ContinuationScorer
from morse_jax.sampling.requests import Completion
from morse_jax.tasks.trajectories import Trajectory, Turn


@pytest.fixture(scope="module")
def tok():
    return chat_common.char_tokenizer()


def test_thought_and_decision_turn():
    assert rl.thought_of("use f with x=1. Next: executor.") == "use f with x=1."
    assert rl.thought_of("a. next role: Summarizer b. Next: executor.") == "a. next role: Summarizer b."
    assert rl.thought_of("The area is 50 square units.") == "The area is 50 square units."
    assert rl.decision_turn("use f.", "summarizer") == "use f. Next: summarizer."
    assert rl.decision_turn("", "executor") == "Next: executor."


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_scores_are_the_likelihood_of_each_decision_and_the_likelier_wins(tok, seed):
    params = init_params(jax.random.PRNGKey(0), CFG)
    backbone = Backbone(config=CFG, params=params, tokenizer=tok)
    frozen = split_segments(params, MOR.n_adapt)
    trainable = acting_mor_params(seed)
    start = Trajectory(turns=(Turn("user", "do f"),), system="S", functions=({"name": "f"},))
    thought = "f fits."
    conts = rl.decision_continuations(start, thought, tok)
    scores = ContinuationScorer(backbone, MOR)(trainable, conts)
    full = [episode_logprob(frozen, trainable, start, tok, reasoner_text=rl.decision_turn(thought, role))
            for role in rl.DECISIONS]
    # the shared prefix has the same probability under both: score differences are likelihood differences
    np.testing.assert_allclose(scores[0] - scores[1], full[0] - full[1], atol=2e-4)
    assert all(s < 0 for s in scores)
    picks = rl.choose_decisions([start], [thought + " Next: summarizer."], lambda c: ContinuationScorer(
        backbone, MOR)(trainable, c), tok)
    want = rl.DECISIONS[int(np.argmax(full))]
    assert picks == [(want, rl.decision_turn(thought, want))]


def test_scores_run_under_the_reasoner_group(tok):
    """Scoring under another role's ids gives other numbers: the decision is the reasoner's."""
    params = init_params(jax.random.PRNGKey(0), CFG)
    scorer = ContinuationScorer(Backbone(config=CFG, params=params, tokenizer=tok), MOR)
    start = Trajectory(turns=(Turn("user", "do f"),), system="S")
    conts = rl.decision_continuations(start, "f fits", tok)
    as_executor = [dataclasses.replace(c, roles=tuple(1 if r == 0 else r for r in c.roles)) for c in conts]
    trainable = acting_mor_params(1)
    assert not np.allclose(scorer(trainable, conts), scorer(trainable, as_executor))


def test_loop_keeps_the_likelier_decision_not_the_written_one(tok):
    """Scripted turns and a scripted scorer: episode "a" writes "Next: executor." but the model
    prefers the summarizer; episode "b" answers in prose (no marker) and the model prefers the
    executor. Each goes where its scores say, and the kept reasoner turn says so."""
    script = {("a", "reasoner"): "use f. Next: executor.", ("a", "summarizer"): "Sorry.", ("a", "executor"): "[g()]",
              ("b", "reasoner"): "The area is 50.", ("b", "executor"): "[f(x=1)]",
              ("b", "summarizer"): "It is 50."}
    prefer = {"a": "summarizer", "b": "executor"}
    seen = []

    def user_of(ids):
        return tok.decode(list(ids)).split("<|im_start|>user\n")[1][0]

    def generate(reqs):
        return [Completion(token_ids=[0], text=script[(user_of(r.prompt_ids), rl.ROLE_NAMES[r.role])],
                           logprobs=np.zeros(0), finish_reason="eos", prompt_len=len(r.prompt_ids)) for r in reqs]

    def score(conts):
        seen.append(len(conts))
        out = []
        for c in conts:
            text = tok.decode(list(c.ids))
            chosen = text[text.rindex("Next: ") + 6:].split(".")[0]
            out.append(0.0 if chosen == prefer[user_of(c.ids)] else -1.0)
        return out

    starts = [Trajectory(turns=(Turn("user", u),), system="S") for u in ("a", "b")]
    eps = rl.run_role_loop(starts, generate, tok, rl.RoleLoopConfig(), score=score)
    assert seen == [4]  # one scoring call: both decisions of both episodes
    assert [(t.role, t.content) for t in eps[0].traj.turns[1:]] == [("reasoner", "use f. Next: summarizer."),
                                                                  ("summarizer", "Sorry.")]
    assert [(t.role, t.content) for t in eps[1].traj.turns[1:]] == [("reasoner", "The area is 50. Next: executor."),
                                                                  ("executor", "[f(x=1)]")]
    assert rl.executor_text(eps[0]) == "" and rl.executor_text(eps[1]) == "[f(x=1)]"
    # the text reading follows the written marker instead
    eps = rl.run_role_loop(starts, generate, tok, rl.RoleLoopConfig(role_choice="text"))
    assert rl.executor_text(eps[0]) == "[g()]" and rl.executor_text(eps[1]) == ""
    with pytest.raises(ValueError, match="needs a score function"):
        rl.run_role_loop(starts, generate, tok, rl.RoleLoopConfig())
