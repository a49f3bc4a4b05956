"""Token healing: never make the model continue a prompt at a token boundary it would not produce.

A prompt that ends inside what the tokenizer would write as one token silences or derails a
model. SciCode's answer prefix ends with the function header and a newline; SmolLM2's tokenizer
writes that newline *with* the next line's indentation as one token ("\\n   "), so after a bare
"\\n" token the model has never seen a body line start, and it closes the code fence instead.

Healing (as guidance and transformers' ``token_healing`` do): drop the prompt's last token(s) and
let the first generated token re-write their text, constrained to tokens whose text *starts with*
the dropped text ("\\n" -> "\\n   ", "\\n\\n", ...). The constraint is a per-row allowed-token
mask over the vocabulary, applied once to the prefill's logits (no per-step work in the decode
loop); it is computed here on the host from the tokenizer's vocabulary and cached per text.

Token texts are measured in context (``decode([anchor, t]) - decode([anchor])``) so tokenizers
that drop a word-initial space when a token is decoded alone (SentencePiece) are read correctly.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

CONTEXT = 8  # prompt tokens decoded with the dropped ones to read their text in context


class TokenHealer:
    """Dropped-text and allowed-first-token computations for one tokenizer (cached).

    Args:
      tokenizer: has ``decode(ids, skip_special_tokens=...)`` (and optionally ``batch_decode``,
        ``all_special_ids``, ``__len__``).
      vocab_size: the model's vocabulary size V (may exceed the tokenizer's: padded embeddings;
        ids beyond the tokenizer are never allowed).
    """

    def __init__(self, tokenizer: Any, vocab_size: int):
        self.tokenizer, self.vocab_size = tokenizer, int(vocab_size)
        self._texts: list[str | None] | None = None
        self._allowed: dict[str, np.ndarray] = {}

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=False)

    def _batch_decode(self, rows: list[list[int]]) -> list[str]:
        fn = getattr(self.tokenizer, "batch_decode", None)
        if callable(fn):
            return list(fn(rows, skip_special_tokens=False))
        return [self._decode(r) for r in rows]

    def token_texts(self) -> list[str | None]:
        """Text each token id adds after a plain word (None: special, or not readable in context)."""
        if self._texts is None:
            n = min(self.vocab_size, len(self.tokenizer)) if hasattr(self.tokenizer, "__len__") else self.vocab_size
            plain = self._batch_decode([[t] for t in range(n)])
            anchor = next((t for t, s in enumerate(plain) if s == "a"), None)
            texts: list[str | None] = list(plain)
            if anchor is not None:
                head = plain[anchor]
                for t, s in enumerate(self._batch_decode([[anchor, t] for t in range(n)])):
                    texts[t] = s[len(head):] if s.startswith(head) else None
            for t in getattr(self.tokenizer, "all_special_ids", ()) or ():
                if 0 <= int(t) < n:
                    texts[int(t)] = None
            self._texts = texts
        return self._texts

    def dropped_text(self, prompt_ids: Sequence[int], n: int) -> str:
        """Text of the prompt's last ``n`` tokens as they read after the ones before ('' = cannot heal)."""
        if n < 1 or n >= len(prompt_ids):
            return ""
        special = set(int(t) for t in getattr(self.tokenizer, "all_special_ids", ()) or ())
        tail = [int(t) for t in prompt_ids[-n:]]
        if special & set(tail):
            return ""  # never rewrite a special token (an end of turn, a role marker)
        window = [int(t) for t in prompt_ids[-(n + CONTEXT):]]
        full, head = self._decode(window), self._decode(window[:-n])
        return full[len(head):] if full.startswith(head) else ""

    def allowed(self, text: str) -> np.ndarray:
        """bool[V]: tokens whose text starts with ``text`` (they re-write it and may extend it)."""
        if text not in self._allowed:
            mask = np.zeros(self.vocab_size, bool)
            for t, s in enumerate(self.token_texts()):
                if s is not None and s.startswith(text):
                    mask[t] = True
            self._allowed[text] = mask
        return self._allowed[text]

    def heal(self, prompt_ids: Sequence[int], n: int) -> tuple[int, str, np.ndarray | None]:
        """(tokens dropped, their text, allowed first tokens bool[V]); (0, '', None) when healing
        does not apply (nothing readable to drop, or no token re-writes it)."""
        text = self.dropped_text(prompt_ids, n)
        if not text:
            return 0, "", None
        mask = self.allowed(text)
        if not mask.any():
            return 0, "", None
        return n, text, mask


def first_token_mask(heals: Sequence[tuple[str, np.ndarray] | None], shape: tuple[int, int]) -> np.ndarray:
    """bool[B, V] allowed first tokens of a micro-batch: a healed row's mask, all True elsewhere.

    heals[i]: (dropped text, allowed bool[V]) from :meth:`TokenHealer.heal`, or None (rows past
    ``len(heals)``, the batch's padding, are unconstrained).
    """
    mask = np.ones(shape, bool)
    for i, h in enumerate(heals):
        if h is not None:
            mask[i] = h[1]
    return mask
