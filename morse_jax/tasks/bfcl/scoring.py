"""Score a model's answer to a BFCL item the way BFCL does.

* AST categories: decode with BFCL's prompting-mode decoder; a decode failure or a non-call output is
  wrong ("ast_decoder:..." error types, as in BFCL's runner); otherwise bfcl-eval's own
  ``ast_checker`` decides (function name, required / unexpected parameters, types, allowed values;
  "parallel" categories match calls in any order, "multiple" expects exactly one call).
* irrelevance / live_irrelevance: correct iff the answer contains no call (decoding fails, or yields
  an empty output: ``[]``, ``[{}]`` or anything not in call format).
* live_relevance: correct iff the answer contains a call (any call; its content is not checked).
"""

from __future__ import annotations

import copy
import dataclasses

from morse_jax.tasks.bfcl.bfcl_import import bfcl
from morse_jax.tasks.bfcl.data import AST_CATEGORIES, IRRELEVANCE, RELEVANCE, BfclItem
from morse_jax.tasks.bfcl.prompting import DecodeError, decode_calls

MODEL_NAME = "morse_jax"  # the checker only uses it to look up dot handling (kept, see bfcl_import)


@dataclasses.dataclass(frozen=True)
class ScoreResult:
    """Verdict on one answer.

    Attributes:
      id, category: the item's.
      correct: BFCL's verdict.
      error: why it is wrong ("" when correct).
      error_type: BFCL's error type, e.g. "simple_function_checker:wrong_func_name" ("" when correct).
      has_call: the answer decoded to at least one call.
    """

    id: str
    category: str
    correct: bool
    error: str = ""
    error_type: str = ""
    has_call: bool = False


def _has_call(text: str) -> bool:
    b = bfcl()
    try:
        calls = b.handler_utils.default_decode_ast_prompting(text, b.enums.ReturnFormat.PYTHON, False)
    except Exception:  # BFCL: a decode failure means "no call"
        return False
    return not b.utils.is_empty_output(calls)


def score(item: BfclItem, text: str) -> ScoreResult:
    """BFCL's verdict on the model text ``text`` answering ``item``."""
    if item.category in IRRELEVANCE or item.category in RELEVANCE:
        has_call = _has_call(text)
        if item.category in IRRELEVANCE:
            ok = not has_call
            err = ("", "") if ok else ("a call was made where none applies", "irrelevance_error:decoder_success")
        else:
            ok = has_call
            err = ("", "") if ok else ("no call was made", "relevance_error:decoder_failed")
        return ScoreResult(item.id, item.category, ok, *err, has_call=has_call)
    if item.category not in AST_CATEGORIES:
        raise ValueError(f"bfcl.score: unknown category {item.category!r}")
    try:
        calls = decode_calls(text)
    except DecodeError as e:
        kind = "decoder_wrong_output_format" if str(e).startswith("not a list") else "decoder_failed"
        return ScoreResult(item.id, item.category, False, f"could not decode the answer: {e}", f"ast_decoder:{kind}")
    b = bfcl()
    verdict = b.ast_checker.ast_checker(copy.deepcopy(list(item.checker_functions)), calls,
                                        copy.deepcopy(list(item.ground_truth)),
                                        b.enums.Language.PYTHON, item.category, MODEL_NAME)
    error = verdict.get("error", "")
    if isinstance(error, (list, tuple)):
        error = " ".join(str(e) for e in error)
    ok = bool(verdict["valid"])
    return ScoreResult(item.id, item.category, ok, "" if ok else str(error),
                       "" if ok else str(verdict.get("error_type", "")), has_call=bool(calls))
