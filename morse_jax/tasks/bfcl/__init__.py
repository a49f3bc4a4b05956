"""BFCL (Berkeley Function Calling Leaderboard) v4, offline, scored with bfcl-eval's own checker.

    from morse_jax.tasks import bfcl
    items = bfcl.load("simple_python")
    messages = bfcl.prompt_messages(items[0])      # BFCL's prompting-mode system prompt + question
    result = bfcl.score(items[0], model_text)      # .correct, .error, .error_type

Covered: the single-turn Python categories (``CATEGORIES``). Not covered: Java / JavaScript
(need tree-sitter), multi-turn, memory, web search, and the Exec column of older BFCL versions
(v4 ships no executable functions).
"""

from morse_jax.tasks.bfcl.data import (AST_CATEGORIES, CATEGORIES, IRRELEVANCE, LIVE_AST, NON_LIVE_AST, RELEVANCE,
                                       BfclItem, function_names, load)
from morse_jax.tasks.bfcl.prompting import DecodeError, decode_calls, format_calls, prompt_messages, system_prompt
from morse_jax.tasks.bfcl.report import summarize, table2_markdown
from morse_jax.tasks.bfcl.scoring import ScoreResult, score

__all__ = ["AST_CATEGORIES", "CATEGORIES", "IRRELEVANCE", "LIVE_AST", "NON_LIVE_AST", "RELEVANCE", "BfclItem",
           "DecodeError", "ScoreResult", "decode_calls", "format_calls", "function_names", "load", "prompt_messages",
           "score", "summarize", "system_prompt", "table2_markdown"]
