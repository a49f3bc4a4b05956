"""SRDD static analysis of codebases: stripped code text, lexical consistency, completeness.

Split out of :mod:`morse_jax.tasks.srdd.family`, which re-exports every public name defined here.
Pure functions over ``{path: source}``; nothing here runs the code.

* :func:`lexical_cosine` is the training reward's cons term (bag-of-words cosine); evaluation
  uses an embedding cosine instead (:func:`~morse_jax.tasks.srdd.scoring.embedding_consistency`).
* :func:`completeness` is r_comp: no placeholders (AST scan) or the ChatDev/MoRSE line rule.
"""

from __future__ import annotations

import ast
import io
import keyword
import math
import re
import tokenize
from collections import Counter
from typing import Mapping

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
