"""BFCL's prompting-mode (non-function-calling) interface: system prompt, messages, call syntax.

The model is told the functions as indented JSON and asked to answer only with
``[func_name1(param=value, ...), func_name2(...)]``; the answer is parsed with Python's ``ast``
(keyword arguments only: positional arguments are dropped by BFCL's decoder). The prompt and the
decoder are bfcl-eval's own (``formulate_system_prompt`` with its default format,
``default_decode_ast_prompting``), so our prompts and scores match BFCL's OSS-model pipeline.
"""

from __future__ import annotations

import copy
from typing import Any, Mapping, Sequence

from morse_jax.tasks.bfcl.bfcl_import import bfcl

Call = Mapping[str, Mapping[str, Any]]  # {"func.name": {"param": value, ...}}


class DecodeError(ValueError):
    """Model text that is not a list of Python-syntax function calls."""


def system_prompt(functions: Sequence[Mapping[str, Any]]) -> str:
    """BFCL's default prompting-mode system prompt for ``functions`` (listed as indent-4 JSON)."""
    b = bfcl()
    return b.handler_utils.formulate_system_prompt(b.handler_utils.DEFAULT_SYSTEM_PROMPT_FORMAT,
                                                   copy.deepcopy(list(functions)))


def prompt_messages(item) -> list[dict[str, str]]:
    """The chat messages BFCL sends for ``item`` (a BfclItem): its question with the system prompt
    inserted first, or prepended (plus a blank line) to the item's own system message."""
    return bfcl().handler_utils.system_prompt_pre_processing_chat_model(
        [dict(m) for m in item.question], copy.deepcopy(list(item.functions)), item.id)


def decode_calls(text: str) -> list[dict[str, dict[str, Any]]]:
    """Model text -> calls ``[{name: {param: value}}]`` with BFCL's prompting-mode decoder.

    Raises DecodeError when the text does not parse as Python calls or is not a list of
    ``{name: {params}}`` (an empty list ``[]`` is valid: no call).
    """
    b = bfcl()
    try:
        calls = b.handler_utils.default_decode_ast_prompting(text, b.enums.ReturnFormat.PYTHON, False)
    except Exception as e:  # BFCL's decoder raises SyntaxError, AssertionError, AttributeError, ...
        raise DecodeError(f"{type(e).__name__}: {e}") from e
    if not b.utils.is_function_calling_format_output(calls):
        raise DecodeError(f"not a list of function calls: {calls!r}")
    return calls


def format_calls(calls: Sequence[Call]) -> str:
    """Calls ``[{name: {param: value}}]`` -> ``"[name(param=value, ...), ...]"`` (Python literals,
    keyword arguments in the given order), the answer syntax the system prompt asks for."""
    parts = []
    for call in calls:
        if len(call) != 1:
            raise ValueError(f"format_calls: a call is one {{name: params}} pair, got {dict(call)!r}")
        (name, params), = call.items()
        parts.append(f"{name}({', '.join(f'{k}={v!r}' for k, v in params.items())})")
    return "[" + ", ".join(parts) + "]"
