"""The BFCL task family: BFCL's own data, prompt, decoder and AST checker, offline.

References come from BFCL's definitions (its answer format: each parameter maps to a list of allowed
values, ``""`` = may be omitted; its relevance rules; its leaderboard aggregation), never from our code.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from morse_jax.tasks import bfcl

REPO = Path(__file__).resolve().parents[1]


def _pick(allowed):
    """First allowed value; None when the first is "" (omit the parameter) or none is listed."""
    return None if not allowed or allowed[0] == "" else allowed[0]


def _answer_dict(d):
    # A dict parameter's possible answer lists allowed values per key (one level, BFCL's dict_checker).
    return {k: _pick(v) for k, v in d.items() if _pick(v) is not None}


def _value(v):
    if isinstance(v, dict):
        return _answer_dict(v)
    if isinstance(v, list) and v and all(isinstance(e, dict) for e in v):
        return [_answer_dict(e) for e in v]
    return v


def possible_answer_text(ground_truth) -> str:
    """The first allowed value of each argument, in BFCL's answer syntax, written independently of
    ``bfcl.format_calls``."""
    calls = []
    for call in ground_truth:
        (name, params), = call.items()
        args = [f"{k}={_value(_pick(v))!r}" for k, v in params.items() if _pick(v) is not None]
        calls.append(f"{name}({', '.join(args)})")
    return "[" + ", ".join(calls) + "]"


EXPECTED_COUNTS = {"simple_python": 400, "multiple": 200, "parallel": 200, "parallel_multiple": 200,
                   "live_simple": 258, "live_multiple": 1053, "live_parallel": 16, "live_parallel_multiple": 24,
                   "irrelevance": 240, "live_irrelevance": 884, "live_relevance": 16}


@pytest.mark.parametrize("category", bfcl.CATEGORIES)
def test_load_items(category):
    items = bfcl.load(category)
    assert len(items) == EXPECTED_COUNTS[category]  # BFCL v4's sizes
    assert len({it.id for it in items}) == len(items)
    for it in items:
        assert it.id.startswith(category + "_") and it.category == category
        assert it.question and all({"role", "content"} <= set(m) for m in it.question)
        assert it.question[-1]["role"] == "user" or category == "live_irrelevance"
        assert it.functions or category == "live_irrelevance"  # a few offer no function at all
        assert all("name" in f and "parameters" in f for f in it.functions)
        assert (it.ground_truth is None) == (category not in bfcl.AST_CATEGORIES)
        assert bfcl.prompt_messages(it)[0]["role"] == "system"
    assert len(bfcl.load(category, limit=3)) == 3


@pytest.mark.parametrize("category", bfcl.AST_CATEGORIES)
def test_possible_answers_are_scored_correct(category):
    items = bfcl.load(category)
    results = [bfcl.score(it, possible_answer_text(it.ground_truth)) for it in items]
    wrong = [(r.id, r.error_type) for r in results if not r.correct]
    # The residue is BFCL data quirks (an answer lists "" for a parameter the schema requires).
    assert 1 - len(wrong) / len(items) >= 0.99, wrong
    assert all(r.error == "" and r.error_type == "" for r in results if r.correct)


@pytest.fixture(scope="module")
def simple0():
    item = bfcl.load("simple_python", limit=1)[0]
    assert item.ground_truth == ({"calculate_triangle_area": {"base": [10], "height": [5], "unit": ["units", ""]}},)
    return item


def test_wrong_answers_are_scored_incorrect(simple0):
    assert bfcl.score(simple0, "[calculate_triangle_area(base=10, height=5)]").correct  # unit may be omitted
    cases = {
        "wrong function name": "[calculate_circle_area(base=10, height=5)]",
        "missing required argument": "[calculate_triangle_area(base=10)]",
        "wrong type": "[calculate_triangle_area(base='10', height=5)]",
        "wrong value": "[calculate_triangle_area(base=11, height=5)]",
        "unknown argument": "[calculate_triangle_area(base=10, height=5, colour='red')]",
        "two calls where one is expected": "[calculate_triangle_area(base=10, height=5), "
                                           "calculate_triangle_area(base=10, height=5)]",
        "positional argument (dropped by BFCL's decoder)": "[calculate_triangle_area(10, height=5)]",
        "prose": "The area is 25 square units.",
        "no call": "[]",
    }
    for what, text in cases.items():
        r = bfcl.score(simple0, text)
        assert not r.correct and r.error and r.error_type, what


def test_relevance_rules():
    irr = bfcl.load("irrelevance", limit=1)[0]
    rel = bfcl.load("live_relevance", limit=1)[0]
    call = f"[{irr.functions[0]['name']}(x=1)]"
    for text, has_call in [("None of the functions apply.", False), ("[]", False), (call, True)]:
        assert bfcl.score(irr, text).correct == (not has_call)
        assert bfcl.score(irr, text).has_call == has_call
    # live_relevance: any call is correct, whatever its arguments.
    assert bfcl.score(rel, f"[{rel.functions[0]['name']}(anything='x')]").correct
    assert not bfcl.score(rel, "I cannot help with that.").correct


def test_prompt_is_bfcl_prompting_mode(simple0):
    msgs = bfcl.prompt_messages(simple0)
    assert [m["role"] for m in msgs] == ["system", "user"]
    sys_text = msgs[0]["content"]
    assert sys_text == bfcl.system_prompt(simple0.functions)
    assert "[func_name1(params_name1=params_value1" in sys_text
    assert json.dumps(list(simple0.functions), indent=4) in sys_text  # functions as indent-4 JSON
    assert "Python 3 syntax" in simple0.functions[0]["description"]  # BFCL's language hint is shown
    assert "Python 3 syntax" not in simple0.checker_functions[0]["description"]
    # An item with its own system message: BFCL prepends its prompt plus a blank line.
    item = next(it for it in bfcl.load("live_simple") if it.question[0]["role"] == "system")
    msgs = bfcl.prompt_messages(item)
    assert msgs[0]["content"] == bfcl.system_prompt(item.functions) + "\n\n" + item.question[0]["content"]
    assert len(msgs) == len(item.question)


def test_format_and_decode_round_trip():
    calls = [{"a.b": {"x": 1, "y": -2.5, "s": "it's", "flag": True, "xs": [1, 2], "d": {"k": "v"}}}, {"c": {}}]
    text = bfcl.format_calls(calls)
    assert text == "[a.b(x=1, y=-2.5, s=\"it's\", flag=True, xs=[1, 2], d={'k': 'v'}), c()]"
    assert bfcl.decode_calls(text) == calls
    assert bfcl.decode_calls("```\nc()\n```") == [{"c": {}}]  # BFCL strips fences and adds brackets
    with pytest.raises(bfcl.DecodeError):
        bfcl.decode_calls("not a call")


def test_table2_report():
    R = bfcl.ScoreResult
    results = ([R(f"s{i}", "simple_python", i < 3) for i in range(4)]  # 75 %
               + [R(f"m{i}", "multiple", i < 1) for i in range(2)]  # 50 %
               + [R(f"ls{i}", "live_simple", i < 1) for i in range(1)]  # 1/1
               + [R(f"lm{i}", "live_multiple", i < 1) for i in range(3)]  # 1/3 -> live AST 2/4 = 50 %
               + [R("r0", "live_relevance", True)]  # 100 %
               + [R(f"i{i}", "irrelevance", i < 1) for i in range(4)]  # 25 %
               + [R(f"li{i}", "live_irrelevance", True) for i in range(2)])  # 100 % -> 62.5 %
    s = bfcl.summarize(results)
    assert s["non_live_ast"] == pytest.approx(62.5)  # unweighted mean of 75 and 50
    assert s["live_ast"] == pytest.approx(50.0)  # count-weighted 2 / 4
    assert s["relevance"] == pytest.approx(100.0)
    assert s["irrelevance"] == pytest.approx(62.5)
    assert s["average"] == pytest.approx((62.5 + 50 + 100 + 62.5) / 4)
    assert s["counts"]["live_multiple"] == [1, 3]
    md = bfcl.table2_markdown({"base": results, "mor": results[:4]})
    lines = md.splitlines()
    assert lines[0] == "| variant | Non-live AST | Live AST | Relevance | Irrelevance | AVG |"
    assert lines[2] == "| base | 62.5 | 50.0 | 100.0 | 62.5 | 68.8 |"
    assert lines[3] == "| mor | 75.0 |  |  |  | 75.0 |"
    assert "simple_python" in lines[5] and "75.0 (4)" in lines[7]


# Run in a fresh interpreter where the API clients BFCL's model handlers import cannot be imported
# (whatever this venv holds) and with a working directory that must stay empty.
_BLOCK_API_CLIENTS = """
import importlib.abc, sys
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {"anthropic", "openai", "boto3", "cohere", "mistralai", "google", "httpx",
                                  "requests", "writerai", "qwen_agent", "overrides", "tree_sitter"}:
            raise ImportError("blocked: " + name)
sys.meta_path.insert(0, Block())
"""


def test_import_needs_no_api_client_and_creates_no_folder_in_working_directory(tmp_path):
    cwd, cache = tmp_path / "cwd", tmp_path / "cache"
    cwd.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "BFCL_PROJECT_ROOT"}
    env.update(XDG_CACHE_HOME=str(cache), PYTHONPATH=str(REPO))
    code = _BLOCK_API_CLIENTS + (
        "import os\nfrom morse_jax.tasks import bfcl\n"
        "it = bfcl.load('simple_python', limit=1)[0]\n"
        "assert bfcl.score(it, '[calculate_triangle_area(base=10, height=5)]').correct\n"
        "assert not bfcl.score(it, '[calculate_triangle_area(base=10)]').correct\n"
        "assert bfcl.prompt_messages(it)[0]['role'] == 'system'\n"
        "assert 'BFCL_PROJECT_ROOT' not in os.environ\n")
    subprocess.run([sys.executable, "-c", code], cwd=cwd, env=env, check=True, timeout=120)
    assert list(cwd.iterdir()) == []
    assert (cache / "morse_jax" / "bfcl").is_dir()  # bfcl-eval's folders went to the cache instead
