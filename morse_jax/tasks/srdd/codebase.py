"""SRDD codebases: multi-file programs parsed from model completions, and their text form.

Split out of :mod:`morse_jax.tasks.srdd.family`, which re-exports every public name defined here.

An execute node writes the *whole* codebase so far, ChatDev style: a file name line, then a
fenced block. :func:`materialise_codebase` (lenient: models vary the format) turns a completion
into ``{relative path: source}``; :func:`serialise_codebase` writes the canonical text that
artifacts travel in between nodes, which :func:`materialise_codebase` reads back unchanged.
File names are checked (:func:`clean_filename`): no absolute paths, no ``..``.
"""

from __future__ import annotations

import ast
import re
from typing import Mapping

_FENCE_OPEN = re.compile(r"^(?P<indent> {0,4})(?P<fence>`{3,}|~{3,})(?P<info>.*)$")
_FILE_TOKEN = r"(?:[\w\-]+/)*[\w\-.]*[\w\-]\.[A-Za-z][A-Za-z0-9]{0,7}"
_FILE_RE = re.compile(rf"^{_FILE_TOKEN}$")
_FILE_ANYWHERE = re.compile(rf"(?<![\w/.\-]){_FILE_TOKEN}(?![\w/\-])")
_PYTHON_LANGS = {"python", "py", "python3", "py3"}
_FIRST_LINE_NAME = re.compile(rf"^\s*#\s*(?:file(?:name)?\s*:\s*)?(?P<name>{_FILE_TOKEN})\s*$", re.I)
_DECOR = " \t*`'\"#>-_:"


def clean_filename(raw: str) -> str | None:
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
        clean = clean_filename(t)
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
    if clean_filename(bare) is not None:
        return clean_filename(bare)
    quoted = re.findall(rf"[`*]+({_FILE_TOKEN})[`*]+", s)
    if len(quoted) == 1:
        return clean_filename(quoted[0])
    found = _FILE_ANYWHERE.findall(s)
    if s.endswith(":") and len(found) == 1 and found[0].endswith(".py"):
        return clean_filename(found[0])
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
            name = clean_filename(fm["name"]) if fm else None
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
        if clean_filename(name) != name:
            raise ValueError(f"files: {name!r} is not a safe relative file name")
        src = files[name].rstrip("\n")
        runs = [len(r) for r in re.findall(r"^ *(`{3,})", src, flags=re.M)]
        fence = "`" * max(3, max(runs, default=0) + 1)
        out.append(f"{name}\n{fence}{_lang_of(name)}\n{src}\n{fence}\n")
    return "\n".join(out)
