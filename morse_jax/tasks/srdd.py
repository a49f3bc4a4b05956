"""SRDD (ChatDev software requirement descriptions): data, codebases, reward, ECI metrics.

A task is one requirement description; the planner decomposes it; each execute node writes
the *whole* multi-file Python codebase so far (ChatDev style: a file name line, then a fenced
block), so the last node's artifact is the finished program. Artifacts travel between nodes as
:func:`serialise_codebase` text and are parsed back with :func:`materialise_codebase`.

Training reward (paper Eq. 11, Appendix I), behind a hard gate::

    gate:   main.py exists, compiles, and `python main.py` with stdin closed does not crash
            within a few seconds (a time-out or an EOFError on input counts as running)
    reward: 0.5*r_exec + 0.5*r_comp + 1.0*(0.7*cons(task, code) + 0.3*cons(subtask, code))

r_exec and r_comp are binary per codebase as in ChatDev's Executability and Completeness
(the paper follows Qian et al.); cons is a lexical bag-of-words cosine here and an embedding
cosine in evaluation (ECI). Given the gate, r_exec is 1 for every rewarded artifact.
Generated code runs only through :mod:`morse_jax.tasks.sandbox`.
"""

from __future__ import annotations

import ast
import dataclasses
import io
import keyword
import math
import os
import re
import tokenize
from collections import Counter
from pathlib import Path
from typing import Mapping, Sequence

from morse_jax.tasks.base import Message, Task, VerifyResult
from morse_jax.tomas.plan import Plan, PlanNode

# ============================================================================ data

SPLITS = ("iid_train", "iid_test", "ood_train", "ood_test", "iid_train_small", "iid_test_small")
DATA_DIR_ENV = "MORSE_JAX_SRDD_DIR"
COLUMNS = ("Name", "Description", "Category")


@dataclasses.dataclass(frozen=True)
class SRDDInfo:
    """``Task.payload`` of an SRDD task: the row's name and category, and where it came from."""

    name: str
    category: str
    source: str
    record: int  # 1-based data record number in the CSV (header excluded)


def resolve_srdd_path(path_or_split: str | os.PathLike, data_dir: str | os.PathLike | None = None) -> Path:
    """A split name (see ``SPLITS``) under ``data_dir`` (or $MORSE_JAX_SRDD_DIR), or a CSV path."""
    if str(path_or_split) in SPLITS:
        base = data_dir if data_dir is not None else os.environ.get(DATA_DIR_ENV)
        if not base:
            raise ValueError(f"data_dir: needed to find SRDD split {str(path_or_split)!r} "
                             f"(or set ${DATA_DIR_ENV}); it is the directory holding {path_or_split}.csv")
        base = Path(base)
        for cand in (base / f"{path_or_split}.csv", base / "srdd" / "data" / f"{path_or_split}.csv"):
            if cand.is_file():
                return cand
        raise FileNotFoundError(f"data_dir: no {path_or_split}.csv in {base} (nor in {base}/srdd/data)")
    path = Path(path_or_split)
    if path.is_file():
        return path
    if path.suffix.lower() == ".csv":
        raise FileNotFoundError(f"path_or_split: SRDD file {path} does not exist")
    raise ValueError(f"path_or_split: {str(path_or_split)!r} is neither a split name {SPLITS} nor a CSV file")


def load_srdd(path_or_split: str | os.PathLike, data_dir: str | os.PathLike | None = None) -> list[Task]:
    """Load SRDD rows (columns Name, Description, Category) as ``Task`` objects in file order.

    ``task_id`` is the Name; a Name repeated within the file gets ``~2``, ``~3``... on its later
    occurrences (the IID train split repeats some names). Bad rows raise ``ValueError`` naming
    the file, the record and its line.
    """
    import csv  # noqa: PLC0415

    path = resolve_srdd_path(path_or_split, data_dir)
    with open(path, newline="", encoding="utf-8-sig") as fh:
        reader = csv.reader(fh)
        header = next(reader, None)
        if header is None:
            raise ValueError(f"{path}: empty file, expected header {','.join(COLUMNS)}")
        if tuple(h.strip() for h in header) != COLUMNS:
            raise ValueError(f"{path}: header is {header}, expected {list(COLUMNS)}")
        tasks: list[Task] = []
        seen: Counter = Counter()
        record = 0
        for row in reader:
            if not row:  # blank line: no data to lose
                continue
            record += 1
            where = f"{path}: record {record} (ending line {reader.line_num})"
            if len(row) != len(COLUMNS):
                raise ValueError(f"{where}: expected {len(COLUMNS)} fields, got {len(row)}")
            name, desc, cat = (f.strip() for f in row)
            for col, val in zip(COLUMNS, (name, desc, cat)):
                if not val:
                    raise ValueError(f"{where}: field {col!r} is empty")
            seen[name] += 1
            tid = name if seen[name] == 1 else f"{name}~{seen[name]}"
            tasks.append(Task(task_id=tid, description=desc, family="srdd",
                              payload=SRDDInfo(name=name, category=cat, source=str(path), record=record)))
    if not tasks:
        raise ValueError(f"{path}: no data rows")
    return tasks


# ============================================================================ codebases

_FENCE_OPEN = re.compile(r"^(?P<indent> {0,4})(?P<fence>`{3,}|~{3,})(?P<info>.*)$")
_FILE_TOKEN = r"(?:[\w\-]+/)*[\w\-.]*[\w\-]\.[A-Za-z][A-Za-z0-9]{0,7}"
_FILE_RE = re.compile(rf"^{_FILE_TOKEN}$")
_FILE_ANYWHERE = re.compile(rf"(?<![\w/.\-]){_FILE_TOKEN}(?![\w/\-])")
_PYTHON_LANGS = {"python", "py", "python3", "py3"}
_FIRST_LINE_NAME = re.compile(rf"^\s*#\s*(?:file(?:name)?\s*:\s*)?(?P<name>{_FILE_TOKEN})\s*$", re.I)
_DECOR = " \t*`'\"#>-_:"


def _clean_filename(raw: str) -> str | None:
    """A safe relative path or None: no absolute paths, no '..', plain characters only."""
    name = raw.strip().strip(_DECOR).replace("\\", "/")
    while name.startswith("./"):
        name = name[2:]
    if not _FILE_RE.match(name) or len(name) > 120:
        return None
    if any(part in ("", ".", "..") for part in name.split("/")):
        return None
    return name


def _name_from_info(info: str) -> tuple[str, str | None]:
    """(language, filename) from a fence info string: ``python main.py``, ``python:main.py``,
    ``main.py``, ``py title="main.py"``."""
    toks = [t for t in re.split(r"[\s:]+|(?:title|file|filename|path)=", info.strip()) if t]
    toks = [t.strip("\"'{}") for t in toks]
    lang, name = "", None
    for i, t in enumerate(toks):
        clean = _clean_filename(t)
        if clean is not None and name is None:
            name = clean
        elif i == 0:
            lang = t.lower()
    return lang, name


def _name_from_line(line: str) -> str | None:
    """A filename announced on the line before a fence (``main.py``, ``**main.py**``,
    ``### File: `game/board.py` ``, ``utils.py:``, ``Here is utils.py:``)."""
    s = line.strip()
    if not s or len(s) > 160:
        return None
    s = re.sub(r"^(?:#+|\d+[.)]|[-*+])\s*", "", s)  # heading / list marker
    bare = re.sub(r"^(?:file(?:name)?|path)\s*:\s*", "", s.strip(_DECOR), flags=re.I).strip(_DECOR)
    if _clean_filename(bare) is not None:
        return _clean_filename(bare)
    quoted = re.findall(rf"[`*]+({_FILE_TOKEN})[`*]+", s)
    if len(quoted) == 1:
        return _clean_filename(quoted[0])
    found = _FILE_ANYWHERE.findall(s)
    if s.endswith(":") and len(found) == 1 and found[0].endswith(".py"):
        return _clean_filename(found[0])
    return None


def _looks_like_code(text: str) -> bool:
    """Parses as Python and is more than a bare word or literal ("Done", "42" parse too)."""
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError):
        return False
    return any(not isinstance(st, ast.Expr) or isinstance(st.value, (ast.Call, ast.Await))
               for st in tree.body)


def _is_python(lang: str, content: str) -> bool:
    if lang in _PYTHON_LANGS:
        return True
    return not lang and _looks_like_code(content)  # unlabelled: only if it is Python code


def parse_codebase(completion: str) -> tuple[dict[str, str], list[str]]:
    """Like :func:`materialise_codebase` but also returns notes on what was ignored or guessed."""
    if not isinstance(completion, str):
        raise TypeError(f"completion must be str, got {type(completion).__name__}")
    lines = re.split(r"\r?\n", completion)  # not splitlines(): code may hold \f or \x1c
    files: dict[str, str] = {}
    unnamed: list[tuple[int, str]] = []  # (block index, content) of unnamed Python blocks
    notes: list[str] = []
    prev_text: str | None = None
    i, k, n_blocks = 0, 0, 0
    while i < len(lines):
        m = _FENCE_OPEN.match(lines[i])
        if not m or (m["fence"][0] == "`" and "`" in m["info"]):
            if lines[i].strip():
                prev_text = lines[i]
            i += 1
            continue
        fence, indent, info = m["fence"], len(m["indent"]), m["info"]
        close = re.compile(rf"^ {{0,4}}{re.escape(fence[0])}{{{len(fence)},}}\s*$")
        body, i = [], i + 1
        while i < len(lines) and not close.match(lines[i]):
            ln = lines[i]
            body.append(ln[min(indent, len(ln) - len(ln.lstrip(" "))):])
            i += 1
        if i >= len(lines):
            notes.append(f"block {k + 1}: no closing fence (taken to the end of the text)")
        i += 1
        k += 1
        n_blocks += 1
        content = "\n".join(body) + "\n" if body else ""
        lang, name = _name_from_info(info)
        if name is None and prev_text is not None:
            name = _name_from_line(prev_text)
        if name is None:
            first = next((b for b in body if b.strip()), "")
            fm = _FIRST_LINE_NAME.match(first)
            name = _clean_filename(fm["name"]) if fm else None
        prev_text = None
        if name is not None:
            if name in files:
                notes.append(f"block {k}: {name} given twice, the later block wins")
            files[name] = content
        elif _is_python(lang, content):
            unnamed.append((k, content))
        else:
            notes.append(f"block {k}: unnamed {lang or 'plain'} block ignored")
    if n_blocks == 0 and _looks_like_code(completion):
        return {"main.py": completion if completion.endswith("\n") else completion + "\n"}, [
            "no code fences: the whole text parsed as Python and became main.py"]
    if unnamed:
        if "main.py" in files:
            chosen = None
        elif len(unnamed) == 1:
            chosen = unnamed[0][0]
        else:  # prefer the block with the entry-point guard, else the longest
            guarded = [b for b in unnamed if "__name__" in b[1] and "__main__" in b[1]]
            chosen = (guarded[-1] if guarded else max(unnamed, key=lambda b: len(b[1])))[0]
            notes.append(f"{len(unnamed)} unnamed Python blocks: block {chosen} became main.py")
        for idx, content in unnamed:
            if idx == chosen:
                files["main.py"] = content
            else:
                notes.append(f"block {idx}: unnamed Python block ignored")
    return files, notes


def materialise_codebase(completion: str) -> dict[str, str]:
    """Files {relative path: source} from the fenced code blocks of a model completion.

    A block's file name comes from (first match wins) its fence info string (```` ```python
    main.py ````), the non-empty text line right before the fence (ChatDev ``FILENAME`` line,
    ``**main.py**``, ``### main.py``), or a first-line comment (``# main.py``). Unnamed Python
    blocks: a single one becomes ``main.py`` (when no named main.py exists); among several, the
    one with the ``__main__`` guard (else the longest). Unsafe paths are treated as unnamed.
    """
    return parse_codebase(completion)[0]


def _lang_of(name: str) -> str:
    return {"py": "python", "md": "markdown", "txt": "text", "json": "json", "csv": "csv",
            "toml": "toml", "yaml": "yaml", "yml": "yaml", "ini": "ini", "cfg": "ini",
            "sh": "bash"}.get(name.rsplit(".", 1)[-1].lower(), "")


def serialise_codebase(files: Mapping[str, str]) -> str:
    """The canonical text form of a codebase (main.py first, then sorted): for each file its
    name on one line and a fenced block. ``materialise_codebase`` inverts it (sources are
    normalised to end with exactly one newline)."""
    out = []
    for name in sorted(files, key=lambda f: (f != "main.py", f)):
        if _clean_filename(name) != name:
            raise ValueError(f"files: {name!r} is not a safe relative file name")
        src = files[name].rstrip("\n")
        runs = [len(r) for r in re.findall(r"^ *(`{3,})", src, flags=re.M)]
        fence = "`" * max(3, max(runs, default=0) + 1)
        out.append(f"{name}\n{fence}{_lang_of(name)}\n{src}\n{fence}\n")
    return "\n".join(out)


# ============================================================================ static analysis


def strip_comments_docstrings(source: str) -> str:
    """Source without ``#`` comments, docstrings and other bare string statements.

    Uses the tokenizer + AST; for code that does not parse, a line-based fallback drops full-line
    comments and triple-quoted blocks. Blank lines left behind are removed.
    """
    try:
        tree = ast.parse(source)
        bare = {(n.lineno, n.col_offset) for n in ast.walk(tree)
                if isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant)
                and isinstance(n.value.value, str)}
        starts = [0]
        for ln in source.splitlines(keepends=True):
            starts.append(starts[-1] + len(ln))
        cuts = []
        for tok in tokenize.generate_tokens(io.StringIO(source).readline):
            if tok.type == tokenize.COMMENT or (tok.type == tokenize.STRING and tok.start in bare):
                cuts.append((starts[tok.start[0] - 1] + tok.start[1], starts[tok.end[0] - 1] + tok.end[1]))
        pieces, pos = [], 0
        for a, b in cuts:
            pieces.append(source[pos:a])
            pos = b
        pieces.append(source[pos:])
        text = "".join(pieces)
    except (SyntaxError, ValueError, tokenize.TokenError, IndentationError):
        text = re.sub(r"'''.*?'''|\"\"\".*?\"\"\"", "", source, flags=re.S)
        text = "\n".join(ln for ln in text.splitlines() if not ln.lstrip().startswith("#"))
    return "\n".join(ln.rstrip() for ln in text.splitlines() if ln.strip()) + "\n"


def codebase_text(files: Mapping[str, str], *, stripped: bool = True) -> str:
    """All Python sources of a codebase, sorted by path, joined (comment/docstring-stripped)."""
    parts = [files[f] for f in sorted(files) if f.endswith(".py")]
    return "\n".join(strip_comments_docstrings(p) if stripped else p for p in parts)


_STOP = frozenset(
    "a an the and or but if then else of to in on at by for with from as is are was were be been "
    "being it its this that these those there their they them he she we you your our his her i me "
    "my not no so do does did done can could will would should may might must shall has have had "
    "into onto about over under than too very also each any all some such which who whom what when "
    "where why how just only own same other more most both few while during before after above "
    "below up down out off again further once here use used using user users allow allows "
    "self cls args kwargs init str int float bool dict tuple len range print elif isinstance".split()
) | frozenset(k.lower() for k in keyword.kwlist)
_WORD = re.compile(r"[A-Za-z][A-Za-z0-9]*")
_IDENT_PART = re.compile(r"[A-Z]+(?=[A-Z][a-z])|[A-Z]?[a-z]+|[A-Z]+")


def _norm(word: str) -> str:
    # A crude plural fold so "players" in a description meets "player" in code.
    if len(word) > 4 and word.endswith("ies"):
        return word[:-3] + "y"
    if len(word) > 3 and word.endswith("s") and not word.endswith(("ss", "us", "is")):
        return word[:-1]
    return word


def bag_of_words(text: str) -> Counter:
    """Lower-cased word counts; identifiers split on snake_case and camelCase, digits dropped,
    English stop words, Python keywords and a few ubiquitous code words removed."""
    out: Counter = Counter()
    for w in _WORD.findall(text):
        for part in _IDENT_PART.findall(w):
            p = part.lower()
            if len(p) > 1 and p not in _STOP:
                out[_norm(p)] += 1
    return out


def lexical_cosine(a: str, b: str) -> float:
    """Cosine of the bag-of-words count vectors of two texts (0 if either is empty)."""
    ca, cb = bag_of_words(a), bag_of_words(b)
    dot = sum(v * cb[t] for t, v in ca.items() if t in cb)
    na, nb = math.sqrt(sum(v * v for v in ca.values())), math.sqrt(sum(v * v for v in cb.values()))
    return dot / (na * nb) if na and nb else 0.0


_COMMENT_MARK = re.compile(r"\b(?:TODO|FIXME|TBD|XXX)\b|(?i:\btodo\s*:|your code here|"
                           r"implement (?:this|me|here|later)|add (?:your )?(?:code|logic|implementation) here|"
                           r"not (?:yet )?implemented)")
_STRING_MARK = re.compile(r"(?i)not (?:yet )?implemented")
_LINE_RULE_EXEMPT = ("password", "passenger", "passed", "passes")


def _decorator_names(fn: ast.AST) -> set[str]:
    names = set()
    for d in getattr(fn, "decorator_list", []):
        d = d.func if isinstance(d, ast.Call) else d
        names.add(d.attr if isinstance(d, ast.Attribute) else getattr(d, "id", ""))
    return names


def _is_stub_stmt(s: ast.stmt) -> bool:
    if isinstance(s, ast.Pass):
        return True
    if isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant) and s.value.value is Ellipsis:
        return True
    return isinstance(s, ast.Raise) and _is_not_impl(s)


def _is_not_impl(s: ast.Raise) -> bool:
    exc = s.exc.func if isinstance(s.exc, ast.Call) else s.exc
    return isinstance(exc, ast.Name) and exc.id == "NotImplementedError"


def find_placeholders(files: Mapping[str, str]) -> list[str]:
    """Placeholder sites in the Python files, as ``file:line: what``.

    Counted: functions whose body (after any docstring) is only ``pass`` / ``...`` /
    ``raise NotImplementedError`` or empty; any other ``raise NotImplementedError`` or bare
    ``...``; ``pass`` as the whole body of an if/else/for/while/with/try block; TODO/FIXME-style
    comments and "not implemented" strings. Not counted: abstract/overload methods, ``except:
    pass``, ``class E(Exception): pass``. Files that do not parse fall back to a line scan.
    """
    found: list[str] = []
    for fname in sorted(f for f in files if f.endswith(".py")):
        src = files[fname]
        try:
            tree = ast.parse(src)
            toks = list(tokenize.generate_tokens(io.StringIO(src).readline))
        except (SyntaxError, ValueError, tokenize.TokenError):
            for no, ln in enumerate(src.splitlines(), 1):
                s = ln.strip()
                if s in ("pass", "...") or "NotImplementedError" in s or _COMMENT_MARK.search(s):
                    found.append(f"{fname}:{no}: placeholder line {s[:60]!r}")
            continue
        exempt: set[int] = set()  # ids of nodes inside abstract/overload functions
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                if _decorator_names(node) & {"abstractmethod", "overload", "abstractproperty"}:
                    exempt.update(id(x) for x in ast.walk(node))
                    continue
                body = node.body
                if body and isinstance(body[0], ast.Expr) and isinstance(getattr(body[0], "value", None),
                                                                         ast.Constant) \
                        and isinstance(body[0].value.value, str):
                    body = body[1:]
                if all(_is_stub_stmt(s) for s in body):
                    found.append(f"{fname}:{node.lineno}: function {node.name}() is a stub")
                    exempt.update(id(x) for x in ast.walk(node))
        for node in ast.walk(tree):
            if id(node) in exempt:
                continue
            if isinstance(node, ast.Raise) and node.exc is not None and _is_not_impl(node):
                found.append(f"{fname}:{node.lineno}: raise NotImplementedError")
            elif isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) \
                    and node.value.value is Ellipsis:
                found.append(f"{fname}:{node.lineno}: '...' placeholder")
            elif isinstance(node, (ast.If, ast.For, ast.AsyncFor, ast.While, ast.With, ast.AsyncWith,
                                   ast.Try)):
                for block in (node.body, getattr(node, "orelse", [])):
                    if len(block) == 1 and isinstance(block[0], ast.Pass):
                        found.append(f"{fname}:{block[0].lineno}: block whose body is only 'pass'")
        for tok in toks:
            if (tok.type == tokenize.COMMENT and _COMMENT_MARK.search(tok.string)) or \
                    (tok.type == tokenize.STRING and _STRING_MARK.search(tok.string)):
                found.append(f"{fname}:{tok.start[0]}: {tok.string.strip()[:60]!r}")
    return found


def completeness(files: Mapping[str, str], *, mode: str = "ast") -> float:
    """r_comp in {0, 1}: 1 when the codebase has Python code and no placeholders.

    ``mode="ast"``: :func:`find_placeholders`. ``mode="line_rule"``: the ChatDev/MoRSE
    evaluators' rule, any line containing the word "pass" or "todo" (case-insensitive; lines
    mentioning password/passenger/passed/passes exempt) -> 0. It also fires on ``except: pass``.
    """
    if not any(f.endswith(".py") and files[f].strip() for f in files):
        return 0.0
    if mode == "ast":
        return 0.0 if find_placeholders(files) else 1.0
    if mode == "line_rule":
        for ln in codebase_text(files, stripped=False).lower().splitlines():
            if not any(x in ln for x in _LINE_RULE_EXEMPT) and re.search(r"\b(?:pass|todo)\b", ln):
                return 0.0
        return 1.0
    raise ValueError(f"mode must be 'ast' or 'line_rule', got {mode!r}")


# ============================================================================ running


@dataclasses.dataclass(frozen=True)
class RunOutcome:
    """Classified smoke run of ``python main.py`` (stdin closed).

    ``ran``: exited 0, hit the time limit, or stopped on EOFError while reading input.
    ``reason``: "exit0" | "timeout" | "eof" | "no_main" | "invalid" | "syntax" | "crash" | "killed".
    """

    ran: bool
    reason: str
    detail: str = ""


def _tail(text: str, n_lines: int = 15, n_chars: int = 1500) -> str:
    return "\n".join(text.strip().splitlines()[-n_lines:])[-n_chars:]


def _last_exception(stderr: str) -> str:
    for ln in reversed(stderr.strip().splitlines()):
        if ln and not ln.startswith((" ", "\t", "[sandbox:")):
            return ln.strip()
    return ""


def _precheck(files: Mapping[str, str]) -> RunOutcome | None:
    if "main.py" not in files:
        return RunOutcome(False, "no_main", "no main.py entry point in the codebase"
                          + (f" (files: {', '.join(sorted(files))})" if files else " (no code found)"))
    bad = [f for f in files if _clean_filename(f) != f]
    if bad:
        return RunOutcome(False, "invalid", f"unsafe file names {bad}")
    try:  # compiling never runs the code; deep nesting can exhaust the parser, hence the extras
        compile(files["main.py"], "main.py", "exec", dont_inherit=True)
    except (SyntaxError, ValueError, RecursionError, MemoryError) as e:
        return RunOutcome(False, "syntax", f"main.py does not compile: {e}")
    return None


def classify_run(result) -> RunOutcome:
    """Map the ``SandboxResult`` of ``python main.py`` to a :class:`RunOutcome`."""
    if result.timed_out:
        return RunOutcome(True, "timeout", "still running at the time limit (counts as running)")
    if result.returncode == 0:
        return RunOutcome(True, "exit0", "")
    last = _last_exception(result.stderr or "")
    if last.startswith("EOFError"):
        return RunOutcome(True, "eof", "stopped waiting for input (stdin closed; counts as running)")
    if getattr(result, "signal", None):
        return RunOutcome(False, "killed", f"killed by signal {result.signal} "
                                           f"(memory or process limit?)\n{_tail(result.stderr or '')}")
    return RunOutcome(False, "crash", f"`python main.py` failed (exit status {result.returncode}):\n"
                                      f"{_tail(result.stderr or '') or '(no output on stderr)'}")


def _run_kwargs(files: Mapping[str, str], timeout_s: float, memory_mb: int) -> dict:
    # code=None: the sandbox runs `python -s main.py` from the codebase directory, stdin /dev/null.
    return dict(code=None, files=dict(files), timeout_s=timeout_s, memory_mb=memory_mb, stdin=None)


def smoke_run(files: Mapping[str, str], *, timeout_s: float = 3.0, memory_mb: int = 2048) -> RunOutcome:
    """Run ``python main.py`` of a codebase in the sandbox, stdin closed, for ``timeout_s``."""
    pre = _precheck(files)
    if pre is not None:
        return pre
    from morse_jax.tasks import sandbox  # noqa: PLC0415

    return classify_run(sandbox.run_python(**_run_kwargs(files, timeout_s, memory_mb)))


def smoke_run_many(codebases: Sequence[Mapping[str, str]], *, timeout_s: float = 3.0,
                   memory_mb: int = 2048, max_workers: int = 2) -> list[RunOutcome]:
    """:func:`smoke_run` over many codebases, ``max_workers`` sandboxes at a time."""
    outcomes: list[RunOutcome | None] = [_precheck(f) for f in codebases]
    todo = [i for i, o in enumerate(outcomes) if o is None]
    if todo:
        from morse_jax.tasks import sandbox  # noqa: PLC0415

        results = sandbox.run_many([_run_kwargs(codebases[i], timeout_s, memory_mb) for i in todo],
                                   max_workers=max_workers)
        for i, r in zip(todo, results):
            outcomes[i] = classify_run(r)
    return outcomes  # type: ignore[return-value]


# ============================================================================ reward


@dataclasses.dataclass(frozen=True)
class SRDDRewardConfig:
    """Training-reward settings (paper Appendix I defaults).

    ``use_gate=False`` reproduces the authors' code, where a crashing program still earns the
    completeness and consistency terms (its VerifyResult then always has ``gate=True``).
    """

    w_exec: float = 0.5
    w_comp: float = 0.5
    w_cons: float = 1.0
    cons_task_share: float = 0.7  # the node's subtask gets 1 - this
    smoke_timeout_s: float = 3.0
    memory_mb: int = 2048
    use_gate: bool = True
    completeness_mode: str = "ast"

    def __post_init__(self):
        for f in ("w_exec", "w_comp", "w_cons", "smoke_timeout_s"):
            v = getattr(self, f)
            if not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
                raise ValueError(f"SRDDRewardConfig.{f} must be a finite number >= 0, got {v!r}")
        if not 0.0 <= self.cons_task_share <= 1.0:
            raise ValueError(f"SRDDRewardConfig.cons_task_share must be in [0, 1], got {self.cons_task_share!r}")
        if self.smoke_timeout_s <= 0:
            raise ValueError("SRDDRewardConfig.smoke_timeout_s must be > 0")
        if not isinstance(self.memory_mb, int) or self.memory_mb < 64:
            raise ValueError(f"SRDDRewardConfig.memory_mb must be an int >= 64, got {self.memory_mb!r}")
        if self.completeness_mode not in ("ast", "line_rule"):
            raise ValueError("SRDDRewardConfig.completeness_mode must be 'ast' or 'line_rule', "
                             f"got {self.completeness_mode!r}")


def score_codebase(task_text: str, subtask_text: str, files: Mapping[str, str], outcome: RunOutcome,
                   cfg: SRDDRewardConfig = SRDDRewardConfig()) -> VerifyResult:
    """The training reward of a codebase whose smoke run gave ``outcome`` (pure, no execution).

    Components: exec = r_exec, comp = r_comp, cons = 0.7*cons(task) + 0.3*cons(subtask)
    (lexical). All three are reported even when the gate fails.
    """
    code = codebase_text(files, stripped=True)
    r_exec = 1.0 if outcome.ran else 0.0
    r_comp = completeness(files, mode=cfg.completeness_mode)
    r_cons = (cfg.cons_task_share * lexical_cosine(task_text, code)
              + (1.0 - cfg.cons_task_share) * lexical_cosine(subtask_text, code))
    comps = {"exec": r_exec, "comp": r_comp, "cons": r_cons}
    notes = []
    if r_comp == 0.0 and cfg.completeness_mode == "ast":
        notes.append("placeholders: " + "; ".join(find_placeholders(files)[:5]))
    if cfg.use_gate and not outcome.ran:
        return VerifyResult(gate=False, reward=0.0, diagnostic=outcome.detail, components=comps)
    reward = cfg.w_exec * r_exec + cfg.w_comp * r_comp + cfg.w_cons * r_cons
    diag = "; ".join(([outcome.detail] if not outcome.ran else []) + notes)
    return VerifyResult(gate=True, reward=float(reward), diagnostic=diag, components=comps)


def srdd_reward(task_text: str, subtask_text: str, files: Mapping[str, str],
                cfg: SRDDRewardConfig = SRDDRewardConfig()) -> VerifyResult:
    """Gate + training reward of one codebase (runs main.py in the sandbox)."""
    outcome = smoke_run(files, timeout_s=cfg.smoke_timeout_s, memory_mb=cfg.memory_mb)
    return score_codebase(task_text, subtask_text, files, outcome, cfg)


# ============================================================================ evaluation (ECI)


@dataclasses.dataclass(frozen=True)
class SRDDScores:
    """Per-codebase evaluation components, each in [0, 1]: r_exec, r_comp, r_cons."""

    exec: float
    comp: float
    cons: float

    def __post_init__(self):
        for f in ("exec", "comp", "cons"):
            v = getattr(self, f)
            if not isinstance(v, (int, float)) or not 0.0 <= v <= 1.0:
                raise ValueError(f"SRDDScores.{f} must be in [0, 1], got {v!r}")


def eci_summary(scores: Sequence[SRDDScores]) -> dict[str, float]:
    """Suite metrics (paper Eq. 14): Exec = mean r_exec; ECI mean = mean of (r_exec + r_comp +
    r_cons)/3; ECI product = mean of r_exec*r_comp*r_cons. Averages are over codebases."""
    if not scores:
        raise ValueError("scores: ECI needs at least one codebase")
    n = len(scores)
    return {
        "n": float(n),
        "exec": sum(s.exec for s in scores) / n,
        "eci_mean": sum((s.exec + s.comp + s.cons) / 3.0 for s in scores) / n,
        "eci_product": sum(s.exec * s.comp * s.cons for s in scores) / n,
    }


def embedding_consistency(embedder, descriptions: Sequence[str], codebases: Sequence[Mapping[str, str]],
                          batch_size: int = 32) -> list[float]:
    """Embedding cosine of each description with its stripped code, clipped to [0, 1] (ECI is
    [0, 1]-valued; a codebase with no Python code scores 0)."""
    codes = [codebase_text(f, stripped=True) for f in codebases]
    sims = embedder.cosine(list(descriptions), codes, batch_size=batch_size)
    return [min(1.0, max(0.0, float(s))) if c.strip() else 0.0 for s, c in zip(sims, codes)]


def evaluate_codebases(descriptions: Sequence[str], codebases: Sequence[Mapping[str, str]], embedder, *,
                       timeout_s: float = 3.0, memory_mb: int = 2048, max_workers: int = 2,
                       completeness_mode: str = "ast") -> list[SRDDScores]:
    """ECI components of each final codebase: r_exec from a sandboxed run (time-out and EOF count
    as running), r_comp (placeholders), r_cons (embedding cosine with ``embedder``, e.g.
    :class:`morse_jax.tasks.embedding.SentenceEmbedder`)."""
    if len(descriptions) != len(codebases):
        raise ValueError(f"descriptions and codebases differ in length: {len(descriptions)} vs {len(codebases)}")
    outcomes = smoke_run_many(codebases, timeout_s=timeout_s, memory_mb=memory_mb, max_workers=max_workers)
    cons = embedding_consistency(embedder, descriptions, codebases)
    return [SRDDScores(exec=1.0 if o.ran else 0.0, comp=completeness(f, mode=completeness_mode), cons=c)
            for o, f, c in zip(outcomes, codebases, cons)]


# ============================================================================ task family

SYSTEM_PROMPT = (
    "You are a senior Python engineer in a software team. You write complete, working code: "
    "no placeholders, no `pass` stubs, no TODOs, no NotImplementedError."
)

FORMAT_RULES = """Answer with the COMPLETE codebase: every file, each in full (files you did not change too).
Write each file as its file name on its own line followed by a fenced code block, like this:

main.py
```python
...
```

Rules:
- main.py is the entry point; the program starts with `python main.py`.
- Use only the Python standard library. The program runs in a terminal with no display and no
  network, so build a text (console) interface even if the task mentions a graphical one.
- Read user input with input(); the program must not crash when input ends (EOF)."""


def _check_task(task: Task, node: PlanNode) -> None:
    if not isinstance(task.description, str) or not task.description.strip():
        raise ValueError(f"task.description is empty (task {task.task_id!r})")
    if not isinstance(node, PlanNode):
        raise TypeError(f"node must be a PlanNode, got {type(node).__name__}")


def _subtask_text(node: PlanNode) -> str:
    return f"{node.title}. {node.description}" if node.title else node.description


@dataclasses.dataclass(frozen=True)
class SRDDFamily:
    """:class:`morse_jax.tasks.base.TaskFamily` for SRDD: planner-made DAGs, multi-file codebases."""

    reward: SRDDRewardConfig = SRDDRewardConfig()
    system_prompt: str = SYSTEM_PROMPT
    format_rules: str = FORMAT_RULES
    name: str = "srdd"

    def fixed_plan(self, task: Task) -> Plan | None:
        return None  # SRDD tasks are decomposed by the planner

    def execute_messages(self, task: Task, node: PlanNode, context: str,
                         diagnostic: str | None) -> list[Message]:
        _check_task(task, node)
        parts = [f"Software requirement:\n{task.description.strip()}",
                 f"Your subtask: {_subtask_text(node).strip()}"]
        if context and context.strip():
            parts.append("Current codebase (from the subtasks done so far):\n\n" + context.strip())
        else:
            parts.append("There is no code yet; start the codebase.")
        if diagnostic:
            parts.append(f"Your previous answer failed verification:\n{diagnostic.strip()}\nFix this.")
        parts.append(self.format_rules)
        return [{"role": "system", "content": self.system_prompt},
                {"role": "user", "content": "\n\n".join(parts)}]

    def merge_messages(self, task: Task, node: PlanNode, parent_artifacts: Sequence[str]) -> list[Message]:
        _check_task(task, node)
        if len(parent_artifacts) < 2:
            raise ValueError(f"parent_artifacts: a merge needs at least 2, got {len(parent_artifacts)}")
        blocks = [f"### Codebase {i + 1}\n\n{a.strip() or '(empty)'}" for i, a in enumerate(parent_artifacts)]
        user = "\n\n".join([
            f"Software requirement:\n{task.description.strip()}",
            f"Teammates wrote the codebases below for different earlier subtasks. Merge them into ONE "
            f"consistent codebase that keeps all their functionality, ready for the next subtask: "
            f"{_subtask_text(node).strip()}",
            *blocks,
            self.format_rules,
        ])
        return [{"role": "system", "content": self.system_prompt}, {"role": "user", "content": user}]

    def extract_artifact(self, task: Task, node: PlanNode, completion: str) -> str:
        """The codebase in canonical text form ('' when the completion holds no code)."""
        files = materialise_codebase(completion)
        return serialise_codebase(files) if files else ""

    def verify(self, task: Task, node: PlanNode, artifact: str) -> VerifyResult:
        _check_task(task, node)
        return srdd_reward(task.description, _subtask_text(node), materialise_codebase(artifact), self.reward)
