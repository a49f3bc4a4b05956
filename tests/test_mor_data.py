"""The multi-role data format: loader validation, chat-template rendering (role ids, loss mask) and
the rule-based converter from function-calling records."""

from __future__ import annotations

import json

import numpy as np
import pytest

import chat_common
from chat_common import CHATML

from morse_jax.sft import data
from morse_jax.tasks import trajectories
from morse_jax.tasks.bfcl import trajectories as fc_trajectories
from morse_jax.tasks import bfcl
from morse_jax.tasks.bfcl import synthetic



@pytest.fixture(scope="module")
def char_tokenizer():
    return chat_common.char_tokenizer()


GOOD = {"functions": [{"name": "f", "description": "d", "parameters": {"type": "dict", "properties": {}}}],
        "system": "S", "id": "x1",
        "turns": [{"role": "user", "content": "do f"}, {"role": "reasoner", "content": "call f. Next: executor."},
                  {"role": "executor", "content": "[f()]"}, {"role": "observation", "content": "ok"},
                  {"role": "reasoner", "content": "done. Next: summarizer."},
                  {"role": "summarizer", "content": "Did f."}]}


def _write(tmp_path, records):
    p = tmp_path / "d.jsonl"
    p.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return p


def test_load_round_trip(tmp_path):
    p = _write(tmp_path, [GOOD, "", GOOD])
    trajs, skipped = trajectories.load_jsonl(p)
    assert skipped == 0 and len(trajs) == 2
    assert trajectories.to_json(trajs[0]) == GOOD
    q = tmp_path / "w.jsonl"
    trajectories.write_jsonl(q, trajs)
    assert trajectories.load_jsonl(q)[0] == trajs


def _with(**changes):
    rec = json.loads(json.dumps(GOOD))
    for path, value in changes.items():
        *head, last = path.split("__")
        obj = rec
        for k in head:
            obj = obj[int(k)] if k.isdigit() else obj[k]
        if value is KeyError:
            del obj[int(last) if last.isdigit() else last]
        else:
            obj[int(last) if last.isdigit() else last] = value
    return rec


BAD = [
    ("[1, 2]", "record"),
    ("{not json", "record: invalid JSON"),
    (_with(conversations=[]), "conversations: unknown key"),
    (_with(turns=KeyError), "turns: expected a non-empty list"),
    (_with(turns=[]), "turns: expected a non-empty list"),
    (_with(turns__2__role="tool"), "turns[2].role: expected one of"),
    (_with(turns__2__content=7), "turns[2].content: expected a string"),
    (_with(turns__3__name="x"), "turns[3].name: unknown key"),
    (_with(turns__1__content="  "), "turns[1].content: empty reasoner turn"),
    (_with(turns__0__role="reasoner"), "turns[0].role: a trajectory starts with the user"),
    (_with(turns=[{"role": "user", "content": "hi"}]), "turns: no reasoner / executor / summarizer turn"),
    (_with(functions={"name": "f"}), "functions: expected a list"),
    (_with(functions__0__name=""), "functions[0].name: expected a non-empty string"),
    (_with(functions__0__parameters=[]), "functions[0].parameters: expected an object"),
    (_with(system=None), "system: expected a string"),
]


@pytest.mark.parametrize("record,message", BAD, ids=[m.split(":")[0] for _, m in BAD])
def test_bad_record_names_file_line_and_field(tmp_path, record, message):
    p = _write(tmp_path, [GOOD, "", record, GOOD])
    with pytest.raises(trajectories.DataFormatError) as e:
        trajectories.load_jsonl(p)
    text = str(e.value)
    assert text.startswith(f"{p}:3: {message}") and "\n" not in text
    trajs, skipped = trajectories.load_jsonl(p, skip_invalid=True)  # skipped only when asked, and counted
    assert (len(trajs), skipped) == (2, 1)


def _expected_tokens(msgs, roles):
    """ChatML by hand, one token per character: (tokens, role ids, loss mask)."""
    toks, rid, loss = [], [], []
    for m, role in zip(msgs, roles):
        r = trajectories.ROLE_NAMES.index(role) if role in trajectories.ROLE_NAMES else -1
        header = ["<|im_start|>"] + list(m["role"] + "\n")
        body = list(m["content"]) + ["<|im_end|>"]
        toks += header + body + ["\n"]
        rid += [r] * (len(header) + len(body)) + [-1]
        loss += [False] * len(header) + [r >= 0] * len(body) + [False]
    return toks, np.array(rid), np.array(loss)


def test_render_role_ids_and_loss_mask(char_tokenizer):
    traj = trajectories.parse_record(GOOD)
    out = data.render(traj, char_tokenizer)
    msgs = data.chat_messages(traj)
    assert [m["role"] for m in msgs] == ["system", "user", "assistant", "assistant", "user", "assistant",
                                         "assistant"]
    assert msgs[0]["content"].startswith("S\n\n") and '"name": "f"' in msgs[0]["content"]
    assert msgs[4]["content"] == "Observation:\nok"
    toks, rid, loss = _expected_tokens(msgs, [None] + [t.role for t in traj.turns])
    assert char_tokenizer.convert_ids_to_tokens(out.tokens.tolist()) == toks
    np.testing.assert_array_equal(out.role_ids, rid)
    np.testing.assert_array_equal(out.loss_mask, loss)
    assert out.tokens.dtype == np.int32 and out.role_ids.dtype == np.int32 and out.loss_mask.dtype == bool
    # the targets of each role are exactly its turns' contents, each closed by the end-of-turn token
    for i, role in enumerate(trajectories.ROLE_NAMES):
        got = char_tokenizer.decode(out.tokens[out.loss_mask & (out.role_ids == i)].tolist())
        want = "".join(t.content + "<|im_end|>" for t in traj.turns if t.role == role)
        assert got == want


def test_render_rejects_templates_that_rewrite_content(char_tokenizer):
    import copy

    tok = copy.deepcopy(char_tokenizer)
    tok.chat_template = CHATML.replace("message['content']", "message['content'] | upper")
    with pytest.raises(ValueError, match="changed the content"):
        data.render(trajectories.parse_record(GOOD), tok)
    tok.chat_template = "{{ messages | length }}{% for m in messages %}{{ m['content'] }}{% endfor %}"
    with pytest.raises(ValueError, match="concatenation"):
        data.render(trajectories.parse_record(GOOD), tok)


def test_converter_from_function_calling_records(char_tokenizer):
    records = synthetic.generate(60, seed=1)
    for rec in records:
        traj = fc_trajectories.from_function_calling(rec)
        assert trajectories.parse_record(trajectories.to_json(traj)) == traj  # valid in the format
        roles = [t.role for t in traj.turns]
        assert traj.turns[0] == trajectories.Turn("user", rec["query"]) and roles[-1] == "summarizer"
        assert list(traj.functions) == rec["functions"]
        if rec["calls"]:
            assert roles == ["user", "reasoner", "executor", "observation", "reasoner", "summarizer"]
            executor = traj.turns[2].content
            assert bfcl.decode_calls(executor) == rec["calls"]  # the executor makes exactly the calls
            assert traj.turns[1].content.endswith("Next: executor.")
            assert traj.turns[4].content.endswith("Next: summarizer.")
        else:
            assert roles == ["user", "reasoner", "summarizer"]
            assert traj.turns[1].content.endswith("Next: summarizer.")
            with pytest.raises(bfcl.DecodeError):
                bfcl.decode_calls(traj.turns[2].content)
        rendered = data.render(traj, char_tokenizer)
        assert rendered.loss_mask.any()
    with pytest.raises(trajectories.DataFormatError, match="calls"):
        fc_trajectories.from_function_calling({"query": "q", "functions": [{"name": "f"}], "calls": [{"g": {}}]})
    with pytest.raises(trajectories.DataFormatError, match="query"):
        fc_trajectories.from_function_calling({"functions": [], "calls": []})


def test_converter_thought_styles():
    """names: the first thought opens with "Plan:", names each reference call's function in order
    and no argument value; plan: it names every call with its arguments. Both hand over to the
    role the record needs, and the executor turn is the same."""
    records = synthetic.generate(60, seed=3)
    assert any(r["calls"] for r in records) and any(not r["calls"] for r in records)
    for rec in records:
        names = fc_trajectories.from_function_calling(rec, thought="names")
        plan = fc_trajectories.from_function_calling(rec, thought="plan")
        assert names.turns[0] == plan.turns[0] and names.turns[2:] == plan.turns[2:]
        first, spelled = names.turns[1].content, plan.turns[1].content
        assert first.startswith("Plan: ")
        if rec["calls"]:
            called = [n for c in rec["calls"] for n in c]
            pos = [first.index(n) for n in called]
            assert pos == sorted(pos) and first.endswith("Next: executor.")
            for c in rec["calls"]:
                for name, args in c.items():
                    assert f"{name} with " in spelled
                    for v in args.values():
                        if isinstance(v, str) and len(v) > 3:
                            assert repr(v) in spelled and repr(v) not in first
        else:
            assert first.startswith("Plan: no call.") and first.endswith("Next: summarizer.")
    with pytest.raises(ValueError, match="thought"):
        fc_trajectories.from_function_calling(records[0], thought="prose")


@pytest.mark.gguf
@pytest.mark.slow
def test_render_with_smollm2_tokenizer(smollm2_path):
    """The embedded SmolLM2 tokenizer (BPE, its own ChatML template): tokens equal the chat encoding
    of the messages, and each role's targets decode to its turns' contents + <|im_end|>."""
    from morse_jax.models.chat import encode_chat
    from morse_jax.models.loading import load_tokenizer

    tok = load_tokenizer(smollm2_path)
    traj = fc_trajectories.from_function_calling(synthetic.generate(3, seed=2)[2])
    out = data.render(traj, tok)
    text = tok.apply_chat_template(data.chat_messages(traj), tokenize=False)
    assert out.tokens.tolist() == tok(text, add_special_tokens=False)["input_ids"]
    # up to the first reasoner turn: encode_chat's generation prompt; its header carries the role
    msgs = data.chat_messages(traj)
    k = next(i for i, m in enumerate(msgs) if m["role"] == "assistant")
    prompt = encode_chat(tok, msgs[:k], add_generation_prompt=True)
    assert out.tokens[:len(prompt)].tolist() == prompt
    start = max(i for i, t in enumerate(prompt) if t == tok.convert_tokens_to_ids("<|im_start|>"))
    assert (out.role_ids[start:len(prompt)] == 0).all() and out.role_ids[start - 1] == -1
    assert not out.loss_mask[:len(prompt)].any()
    for i, role in enumerate(trajectories.ROLE_NAMES):
        got = tok.decode(out.tokens[out.loss_mask & (out.role_ids == i)].tolist())
        assert got == "".join(t.content + "<|im_end|>" for t in traj.turns if t.role == role)
    assert (out.role_ids[~out.loss_mask] >= 0).any()  # role-turn headers carry the role, untrained
