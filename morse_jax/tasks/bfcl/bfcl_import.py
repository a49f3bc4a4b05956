"""Import bfcl-eval's AST checker, prompt builder and decoder offline, with no side effects.

``bfcl-eval`` (PyPI, Apache-2.0; installed with ``--no-deps``) ships BFCL v4's data and its AST
checker, but importing the checker as-is pulls in ``bfcl_eval.constants.model_config``, which imports
53 API/OSS model handlers (anthropic, openai, boto3, ...), and the prompt utilities import Java /
JavaScript tree-sitter parsers at module level. We only score Python-format answers, so before the
first import we register small stand-ins under ``sys.modules`` (nothing in site-packages changes):

* ``bfcl_eval.constants.model_config``: the checker uses it only in ``convert_func_name``
  (``MODEL_CONFIG_MAPPING[name].underscore_to_dot``); every name maps to "keep dots", which is what
  BFCL does for prompting-mode (non-FC) models.
* ``bfcl_eval.model_handler.parser.java_parser`` / ``js_parser`` -- only when the tree-sitter
  parsers are not importable; their parse functions raise (Java/JS categories are not covered).

``bfcl_eval.constants.eval_config`` creates ``result/``, ``score/`` and ``.file_locks/`` under
``BFCL_PROJECT_ROOT`` when imported (default: next to site-packages). Unless the user set that
variable, it is pointed at a cache directory for the import only, so nothing appears in the working
directory. The remaining needs are ``filelock`` and ``tenacity`` (small, pure Python).
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
import threading
import types
from pathlib import Path

_LOCK = threading.Lock()
_MODULES: types.SimpleNamespace | None = None


def cache_dir() -> Path:
    """Where bfcl-eval may write (its result/score/lock folders): ``$XDG_CACHE_HOME/morse_jax/bfcl``."""
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "morse_jax" / "bfcl"


class _KeepDots:
    """Model config of a prompting-mode model: function names keep their dots."""

    underscore_to_dot = False
    is_fc_model = False


class _AnyModelConfig(dict):
    def __missing__(self, key):
        return _KeepDots()


def _stub(name: str, **attrs) -> None:
    if name in sys.modules:
        return
    mod = types.ModuleType(name)
    mod.__dict__.update(attrs)
    mod.__morse_jax_stub__ = True
    sys.modules[name] = mod


def _unsupported(language: str):
    def parse(*args, **kwargs):
        raise NotImplementedError(f"bfcl: {language} answers need the tree_sitter parsers (not installed)")

    return parse


def _tree_sitter_parsers_available() -> bool:
    try:
        import tree_sitter  # noqa: F401
        import tree_sitter_java  # noqa: F401
        import tree_sitter_javascript  # noqa: F401
    except ImportError:
        return False
    return True


def bfcl() -> types.SimpleNamespace:
    """bfcl-eval's modules, imported once: ``ast_checker``, ``handler_utils``
    (``bfcl_eval.model_handler.utils``), ``utils`` (``bfcl_eval.utils``), ``enums``.

    Raises ImportError with the install command when bfcl-eval is missing.
    """
    global _MODULES
    with _LOCK:
        if _MODULES is not None:
            return _MODULES
        if importlib.util.find_spec("bfcl_eval") is None:
            raise ImportError("bfcl: the package bfcl-eval is not installed "
                              "(pip install --no-deps bfcl-eval filelock tenacity)")
        _stub("bfcl_eval.constants.model_config", MODEL_CONFIG_MAPPING=_AnyModelConfig())
        if not _tree_sitter_parsers_available():
            _stub("bfcl_eval.model_handler.parser.java_parser", parse_java_function_call=_unsupported("Java"))
            _stub("bfcl_eval.model_handler.parser.js_parser", parse_javascript_function_call=_unsupported("JavaScript"))
        previous = os.environ.get("BFCL_PROJECT_ROOT")
        if previous is None:
            root = cache_dir()
            root.mkdir(parents=True, exist_ok=True)
            os.environ["BFCL_PROJECT_ROOT"] = str(root)
        try:
            ns = types.SimpleNamespace(
                ast_checker=importlib.import_module("bfcl_eval.eval_checker.ast_eval.ast_checker"),
                handler_utils=importlib.import_module("bfcl_eval.model_handler.utils"),
                utils=importlib.import_module("bfcl_eval.utils"),
                enums=importlib.import_module("bfcl_eval.constants.enums"),
            )
        finally:
            if previous is None:
                os.environ.pop("BFCL_PROJECT_ROOT", None)
        _MODULES = ns
        return ns
