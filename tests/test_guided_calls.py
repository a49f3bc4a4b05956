"""The executor's calls written under the schemas (``run.guided_calls``, ``executor="guided"``):
values are cut where a Python expression ends; the "names" thought parses back to its names; with a
scorer and a generator that prefer one answer, the decode writes exactly that answer, never leaves
out a required parameter, never repeats or invents one; the role loop uses the written turn."""

from __future__ import annotations

import numpy as np
import pytest

import chat_common

from morse_jax.run import guided_calls as gc
from morse_jax.run import role_loop as rl
from morse_jax.sampling.requests import Completion
from morse_jax.tasks.bfcl.trajectories import names_thought, parse_names_thought
from morse_jax.tasks.trajectories import Trajectory, Turn


@pytest.fixture(scope="module")
def tok():
    return chat_common.char_tokenizer()


@pytest.mark.parametrize("text, value", [
    ("5)]", "5"),
    ("5, b=2)]", "5"),
    ("'New York, NY', unit='km')]", "'New York, NY'"),
    ("[1, 2], b=3)", "[1, 2]"),
    ("{'a': (1, 2)}), g()]", "{'a': (1, 2)}"),
    ("'it\\'s', x=1)", "'it\\'s'"),
    ('"a)b"]', '"a)b"'),
    ("3.5", "3.5"),  # the budget ended right after the value
    ("  -2.0 )", "-2.0"),
])
def test_leading_value_is_the_expression_up_to_its_end(text, value):
    assert gc.leading_value(text) == value


@pytest.mark.parametrize("text", ["", ")]", "'unterminated str", "two words)", "[1, 2", "=5)"])
def test_leading_value_rejects_what_is_not_an_expression(text):
    assert gc.leading_value(text) is None


def test_names_thought_parses_back():
    offered = ["f", "g.h", "calc_area"]
    for names in ([], ["f"], ["g.h", "f"], ["calc_area", "calc_area", "f"]):
        assert parse_names_thought(names_thought(names, offered), offered) == names
    assert parse_names_thought("The area of a triangle is half base times height.", offered) is None
    assert parse_names_thought("Plan: call zzz, with the arguments the request states. Next: executor.", offered) is None
    assert parse_names_thought("Plan: 3 calls: f, f, with the arguments the request states. Next: executor.",
                               offered) is None  # the count disagrees with the names
    assert parse_names_thought("Plan: 1 calls: f, with the arguments the request states. Next: executor.",
                               offered) is None  # not the template's head for one call


def _fn(name, params, required):
    return {"name": name, "description": "d", "parameters": {
        "type": "dict", "properties": {p: {"type": "string", "description": p} for p in params}, "required": required}}


def _episode(user, functions, names):
    offered = [f["name"] for f in functions]
    return Trajectory(turns=(Turn("user", user), Turn("reasoner", names_thought(names, offered))), system="S",
                      functions=tuple(functions))


def _executor_text(tok, ids):
    return tok.decode(list(ids)).rsplit("<|im_start|>assistant\n", 1)[1]


def _model_of(tok, targets, log):
    """A scorer and a generator that both follow ``targets[user]`` (the preferred executor turn):
    the scorer gives 0 to a candidate whose executor text is a prefix of it and -1 to any other;
    the generator continues the prompt's executor text with the rest of the target (as a model
    that writes on past the value would). ``log`` records every scoring call's candidate texts
    and every request."""

    def user_of(ids):
        return tok.decode(list(ids)).split("<|im_start|>user\n")[1].split("<|im_end|>")[0]

    def score(conts):
        log.setdefault("scored", []).append([_executor_text(tok, c.ids) for c in conts])
        return [0.0 if targets[user_of(c.ids)].startswith(_executor_text(tok, c.ids)) else -1.0 for c in conts]

    def generate(reqs):
        log.setdefault("requests", []).extend(reqs)
        out = []
        for r in reqs:
            assert r.heal_tokens == 1 and r.role == rl.ROLE_NAMES.index("executor") and r.temperature == 0
            assert len(r.prompt_roles) == len(r.prompt_ids)
            written = _executor_text(tok, r.prompt_ids)
            target = targets[user_of(r.prompt_ids)]
            assert target.startswith(written), (written, target)
            rest = target[len(written):]
            out.append(Completion(token_ids=list(tok(rest)["input_ids"]), text=rest, logprobs=np.zeros(0),
                                  finish_reason="eos", prompt_len=len(r.prompt_ids)))
        return out

    return score, generate


def test_the_preferred_answer_is_written_exactly(tok):
    f = _fn("f", ["a", "b", "c"], ["b"])
    g = _fn("g.h", [], [])
    k = _fn("k", ["x", "y"], ["x", "y"])
    targets = {"1": "[f(b='x, y', c=[1, 2]), g.h()]",       # optional c passed, a left out; a call with no params
               "2": "[f(c=3, b=4, a={'p': (1, 2)})]",        # any order of parameters
               "3": "[k(y=1.5, x='u'), k(x='v', y=-2)]",     # every parameter required: only the order is chosen
               "4": "[f(b=None)]"}
    eps = [_episode("1", [f, g], ["f", "g.h"]), _episode("2", [f, g], ["f"]), _episode("3", [k], ["k", "k"]),
           _episode("4", [f], ["f"])]
    log = {}
    score, generate = _model_of(tok, targets, log)
    out = gc.write_calls(eps, generate=generate, score=score, tokenizer=tok)
    assert [t for t, _ in out] == list(targets.values())
    assert all(n > 0 for _, n in out)
    # grammatical text is kept as written: nothing scored, one continuation per episode from its
    # first call's "name(" (a later call's opening is kept when it is the thought's next name)
    assert "scored" not in log
    assert sorted(_executor_text(tok, r.prompt_ids) for r in log["requests"]) == ["[f(", "[f(", "[f(", "[k("]


def test_positional_and_invented_arguments_become_the_schema_parameters(tok):
    """A model that writes positional arguments or an unknown name is asked the parameter name
    (closed set), then writes on."""
    f = _fn("f", ["number", "base"], ["number"])
    scored = []

    def score(conts):  # prefers "number" and closing
        texts = [_executor_text(tok, c.ids) for c in conts]
        scored.append(texts)
        return [0.0 if t.endswith(("number=", ")]")) else -1.0 for t in texts]

    def generate(reqs):
        out = []
        for r in reqs:
            written = _executor_text(tok, r.prompt_ids)
            rest = {"[f(": "5, 10)]", "[f(number=": "5, bse=10)]"}[written]
            out.append(Completion(token_ids=[0] * len(rest), text=rest, logprobs=np.zeros(0), finish_reason="eos",
                                  prompt_len=len(r.prompt_ids)))
        return out

    (text, n), = gc.write_calls([_episode("1", [f], ["f"])], generate=generate, score=score, tokenizer=tok)
    # "5" where a parameter name is due: scored (no close: number is required) -> number; its
    # value "5" is kept; "bse" is no parameter: scored among base and the close -> close
    assert scored == [["[f(number=", "[f(base="], ["[f(number=5, base=", "[f(number=5)]"]]
    assert (text, n) == ("[f(number=5)]", len("5, 10)]") + len("5, bse=10)]"))


def test_candidates_are_the_unwritten_parameters_and_close_once_required_are_written(tok):
    """A model that would close every call at once: the required parameters are written anyway,
    a written parameter is not offered again, and an all-optional call closes when it prefers."""
    f = _fn("f", ["a", "b"], ["b"])
    g = _fn("g", ["a", "b", "c"], [])
    scored = []

    def score(conts):  # 0 for closing the call, -1 for any parameter
        texts = [_executor_text(tok, c.ids) for c in conts]
        scored.append(texts)
        return [-1.0 if t.endswith("=") else 0.0 for t in texts]

    def generate(reqs):
        return [Completion(token_ids=[1, 2], text="7)]", logprobs=np.zeros(0), finish_reason="eos",
                           prompt_len=len(r.prompt_ids)) for r in reqs]

    out = gc.write_calls([_episode("1", [f, g], ["f", "g"])], generate=generate, score=score, tokenizer=tok)
    assert out == [("[f(a=7, b=7), g()]", 8)]  # 4 continuations of 2 tokens
    # f: a or b first (no close: b is required); after a=7 only b is left (forced, not scored);
    # after b=7 only the close (forced); g: any parameter or the close, scored as the text that
    # follows it in a training turn (")]" after the last call)
    assert scored == [["[f(a=", "[f(b="], ["[f(a=7, b=7), g(a=", "[f(a=7, b=7), g(b=", "[f(a=7, b=7), g(c=",
                                           "[f(a=7, b=7), g()]"]]
    # a close before another call is scored with that call's opening
    scored.clear()
    out = gc.write_calls([_episode("1", [g], ["g", "g"])], generate=generate, score=score, tokenizer=tok)
    assert out == [("[g(), g()]", 4)] and scored[0][-1] == "[g(), g(" and scored[1][-1] == "[g(), g()]"


def test_an_unusable_value_ends_the_call_without_it(tok):
    f = _fn("f", ["a", "b"], ["a", "b"])

    def generate(reqs):
        return [Completion(token_ids=[1], text="'never closed", logprobs=np.zeros(0), finish_reason="length",
                           prompt_len=len(r.prompt_ids)) for r in reqs]

    eps = [_episode("1", [f], ["f", "f"])]
    (text, n), = gc.write_calls(eps, generate=generate, score=lambda c: [0.0] * len(c), tokenizer=tok)
    assert text == "[f(), f()]" and n == 4  # per call: a continuation at "f(", then one at "a="


def test_thoughts_that_name_no_call_are_left_to_the_caller(tok):
    f = _fn("f", ["a"], ["a"])
    prose = Trajectory(turns=(Turn("user", "1"), Turn("reasoner", "I will call f. Next: executor.")), system="S",
                       functions=(f,))
    none = _episode("2", [f], [])
    calls = []
    out = gc.write_calls([prose, none], generate=lambda r: calls.append(r) or [], score=lambda c: calls.append(c) or [],
                         tokenizer=tok)
    assert out == [None, None] and calls == []


@pytest.mark.parametrize("category", ["simple_python", "multiple", "parallel", "parallel_multiple"])
def test_the_writer_output_is_what_bfcl_decodes(category, tok):
    """Written calls are BFCL's syntax: each item's possible answer (first allowed values, in the
    ground truth's parameter order; BFCL lets a few schema-required ones be omitted), written through the decode by a model that prefers it, is
    that answer's exact text and BFCL's own checker scores it correct."""
    from test_bfcl import _value

    from morse_jax.tasks import bfcl

    def allowed(values, required):  # the first allowed value; a required parameter is never omitted
        return next((v for v in values if v != ""), None) if required else (None if values[0] == "" else values[0])

    items = bfcl.load(category)[::20]
    for it in items:
        calls = []
        for call in it.ground_truth:
            (name, params), = call.items()
            req = set(next(f for f in it.functions if f["name"] == name)["parameters"].get("required", ()))
            args = [f"{k}={_value(allowed(v, k in req))!r}" for k, v in params.items() if allowed(v, k in req) is not None]
            calls.append(f"{name}({', '.join(args)})")
        target = "[" + ", ".join(calls) + "]"
        if not target.isascii():  # the character tokenizer reads printable ASCII only
            continue
        names = [next(iter(c)) for c in it.ground_truth]
        ep = Trajectory(turns=(Turn("user", "1"), Turn("reasoner", names_thought(names, [f["name"] for f in it.functions]))),
                        system="S", functions=tuple(it.functions))
        score, generate = _model_of(tok, {"1": target}, {})
        (text, _), = gc.write_calls([ep], generate=generate, score=score, tokenizer=tok)
        assert text == target, it.id
        assert bfcl.score(it, text).correct, it.id


def test_role_loop_uses_the_written_executor_turn(tok):
    generated, asked = [], []

    def generate(reqs):
        generated.extend(rl.ROLE_NAMES[r.role] for r in reqs)
        return [Completion(token_ids=[0, 0], text="[free(x=1)]", logprobs=np.zeros(0), finish_reason="eos",
                           prompt_len=len(r.prompt_ids)) for r in reqs]

    def write(trajs):
        asked.extend(t.turns[0].content for t in trajs)
        return [("[f(x=2)]", 5) if t.turns[0].content == "a" else None for t in trajs]

    def choose(trajs):
        return [rl.ChosenTurn("executor", "Plan: call f, with the arguments the request states. Next: executor.")] * len(trajs)

    f = _fn("f", ["x"], ["x"])
    starts = [Trajectory(turns=(Turn("user", u),), system="S", functions=(f,)) for u in "ab"]
    cfg = rl.RoleLoopConfig(first_thought="closed", executor="guided")
    eps = rl.run_role_loop(starts, generate, tok, cfg, score=lambda c: [0.0] * len(c), choose_first=choose,
                           write_executor=write)
    assert asked == ["a", "b"] and generated == ["executor"]  # b's turn was left to the generator
    assert [rl.executor_text(e) for e in eps] == ["[f(x=2)]", "[free(x=1)]"]
    assert [e.tokens for e in eps] == [5, 2]
    with pytest.raises(ValueError, match="needs a write_executor function"):
        rl.run_role_loop(starts, generate, tok, cfg, score=lambda c: [0.0] * len(c), choose_first=choose)
    with pytest.raises(ValueError, match="executor must be one of"):
        rl.RoleLoopConfig(executor="free")

