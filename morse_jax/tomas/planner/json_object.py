"""Planner: the JSON value in untrusted model output (:func:`extract_json_object`).

Split out of :mod:`morse_jax.tomas.planner.loop` (one concept per module), which re-exports the
public names defined here. Never raises anything but :class:`PlanParseError` on bad text.

Parsing choices (documented because they decide what a malformed plan becomes):

* JSON is taken from the first fenced block (```json ... ```) that holds a parseable JSON
  value, else from the whole text. Candidates are top-level balanced ``{...}``/``[...]``
  spans (string-aware, so braces inside strings do not count); the first that parses wins,
  optionally preferring one that carries a plan key. A trailing comma before ``}``/``]`` is
  removed if that is what stops a span from parsing.
* A top-level list of objects is read as the node list (``{"nodes": [...]}``). Lists of
  anything else are skipped (``[1]`` in prose is a citation, not a plan).
"""

from __future__ import annotations

import json
import re
from typing import Any, Sequence

_TRAILING_RE = re.compile(r"\s*[}\]]")
_FENCE_RE = re.compile(r"```[ \t]*([A-Za-z0-9_-]*)[ \t]*\r?\n?(.*?)```", re.DOTALL)


class PlanParseError(ValueError):
    """The model output contains no usable JSON value."""


def _balanced_spans(text: str) -> tuple[list[tuple[int, int]], int | None]:
    """Top-level balanced ``{}``/``[]`` spans, string-aware inside a span.

    Returns (spans as (start, end_exclusive), start of an opener never closed or None).
    Quotes in prose outside any span are ignored; a mismatched closer abandons the span.
    """
    spans, stack, in_str, esc = [], [], False, False
    pairs = {"}": "{", "]": "["}
    for i, c in enumerate(text):
        if in_str:
            if esc:
                esc = False
            elif c == "\\":
                esc = True
            elif c == '"':
                in_str = False
        elif c == '"' and stack:
            in_str = True
        elif c in "{[":
            stack.append((c, i))
        elif c in "}]" and stack:
            if stack[-1][0] != pairs[c]:
                stack = []  # not JSON; look for a fresh span after this point
                continue
            _, start = stack.pop()
            if not stack:
                spans.append((start, i + 1))
    return spans, (stack[0][1] if stack else None)


def _strip_trailing_commas(s: str) -> str:
    """Remove commas directly before a closing bracket, outside strings."""
    out, in_str, esc = [], False, False
    for i, c in enumerate(s):
        if in_str:
            esc, in_str = (False, in_str) if esc else (c == "\\", c != '"')
        elif c == '"':
            in_str = True
        elif c == "," and _TRAILING_RE.match(s, i + 1):
            continue
        out.append(c)
    return "".join(out)


def _loads(s: str) -> tuple[Any, str | None]:
    """(value, None) or (None, error); trailing-comma fallback; never raises."""
    try:
        return json.loads(s), None
    except (ValueError, RecursionError) as e:
        err = str(e)[:160]
    try:
        return json.loads(_strip_trailing_commas(s)), None
    except (ValueError, RecursionError):
        return None, err


def _as_object(value: Any) -> dict | None:
    if isinstance(value, dict):
        return value
    if isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
        return {"nodes": value}
    return None


def _extract(text: str, prefer_keys: Sequence[str]) -> tuple[dict | None, str]:
    spans, unclosed = _balanced_spans(text)
    found, first_err = [], ""
    for a, b in spans:
        value, err = _loads(text[a:b])
        obj = _as_object(value) if err is None else None
        if obj is not None:
            if not prefer_keys or any(k in obj for k in prefer_keys):
                return obj, ""
            found.append(obj)
        elif err and not first_err:
            first_err = f"the JSON at characters {a}..{b} does not parse ({err})"
    if found:
        return found[0], ""
    if first_err:
        return None, first_err
    if unclosed is not None:
        return None, f"the JSON looks truncated: the bracket at character {unclosed} is never closed"
    return None, "no JSON object found in the output"


def extract_json_object(text: str, *, prefer_keys: Sequence[str] = ()) -> dict:
    """The first JSON object in model output (see the module docstring for the rules).

    Args:
      text: raw model output; may hold prose, code fences, several JSON values.
      prefer_keys: if given, the first object having one of these keys beats earlier objects
        (so an echoed example or a stray ``{"x": 1}`` does not shadow the answer).
    Returns: the object; a top-level list of objects comes back as ``{"nodes": list}``.
    Raises: PlanParseError saying why nothing usable was found.
    """
    if not isinstance(text, str):
        raise PlanParseError(f"model output must be a string, got {type(text).__name__}")
    for m in _FENCE_RE.finditer(text):
        obj, _ = _extract(m.group(2), prefer_keys)
        # a fenced object without a preferred key may be an example; the full scan decides
        if obj is not None and (not prefer_keys or any(k in obj for k in prefer_keys)):
            return obj
    obj, why = _extract(text, prefer_keys)
    if obj is None:
        snippet = " ".join(text.split())[:120]
        raise PlanParseError(f"{why}; output starts: {snippet!r}")
    return obj
