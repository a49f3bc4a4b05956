"""Import transformers without its "PyTorch was not found" banner.

morse_jax uses transformers only for configs and tokenizers, which need no PyTorch; a user
without torch (the quickstart venv) should not be told at start-up that "models won't be
available". transformers prints that advice once, at import, unless
``TRANSFORMERS_NO_ADVISORY_WARNINGS`` is set, so the first import happens here with the
variable set for that import only (the user's own setting is left as it was).
"""

from __future__ import annotations

import os
import sys


def import_transformers():
    """Return the ``transformers`` module, imported without the no-PyTorch advisory."""
    if "transformers" in sys.modules:
        return sys.modules["transformers"]
    key = "TRANSFORMERS_NO_ADVISORY_WARNINGS"
    before = os.environ.get(key)
    os.environ[key] = "1"
    try:
        import transformers  # noqa: PLC0415

        return transformers
    finally:
        if before is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = before
