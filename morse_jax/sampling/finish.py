"""Host-side end of generation: stop strings between decode chunks, and completions from the
decode loop's final arrays.

Stop *tokens* and budgets end rows inside the jitted loop (``state.record_tokens``); stop
*strings* need the tokenizer, so the host checks them between chunks and marks rows done.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from morse_jax.sampling.requests import Completion, Request
from morse_jax.sampling.state import REASON_EOS, REASON_LENGTH

_FINISH = {REASON_EOS: "eos", REASON_LENGTH: "length"}


def find_stop(tokenizer, ids: list[int], stop_strings: Sequence[str]) -> int | None:
    """Smallest k such that decode(ids[:k]) contains a stop string, or None."""
    text = tokenizer.decode(ids, skip_special_tokens=True)
    if not any(s in text for s in stop_strings):
        return None
    lo, hi = 1, len(ids)  # containment is monotone in the prefix length
    while lo < hi:
        mid = (lo + hi) // 2
        if any(s in tokenizer.decode(ids[:mid], skip_special_tokens=True) for s in stop_strings):
            hi = mid
        else:
            lo = mid + 1
    return lo


def cut_text(text: str, stop_strings: Sequence[str]) -> str:
    """``text`` cut before the first occurrence of any stop string."""
    cuts = [text.find(s) for s in stop_strings if s in text]
    return text[:min(cuts)] if cuts else text


def mark_stop_strings(tokenizer, reqs: Sequence[Request], tokens: np.ndarray, n_gen: np.ndarray,
                      stop_at: np.ndarray) -> list[int]:
    """Rows whose text now contains one of their stop strings (not marked before).

    tokens int32[B, N], n_gen int32[B]: the loop's arrays so far. stop_at int[B] (-1 = none) is
    updated in place with the token count (exclusive) at which each newly stopped row's string
    completed. Returns the newly stopped rows.
    """
    newly = []
    for i, r in enumerate(reqs):
        if stop_at[i] < 0 and r.stop_strings:
            cut = find_stop(tokenizer, tokens[i, :n_gen[i]].tolist(), r.stop_strings)
            if cut is not None:
                stop_at[i] = cut
                newly.append(i)
    return newly


def healed_logprob(logits_row: np.ndarray, token: int) -> float:
    """log softmax(logits_row)[token] in float64 (a healed first token's unconstrained log-prob)."""
    row = logits_row.astype(np.float64)
    mx = row.max()
    return float(row[token] - (mx + np.log(np.exp(row - mx).sum())))


def completions(reqs: Sequence[Request], tokenizer, *, tokens: np.ndarray, logps: np.ndarray, n_gen: np.ndarray,
                reason: np.ndarray, stop_at: np.ndarray, heals: Sequence[tuple[str, np.ndarray] | None],
                first_logits: np.ndarray | None, prompt_end: int, prompt_states: Any = None,
                gen_states: Any = None) -> list[Completion]:
    """One Completion per request from the loop's final host arrays.

    tokens / logps [B, N], n_gen / reason / stop_at [B] (see ``SamplingState`` and
    :func:`mark_stop_strings`). heals[i]: (dropped text, allowed mask) of a healed row, whose
    first token's log-prob is replaced by its unconstrained one from ``first_logits`` float32[B, V]
    (the prefill's logits before the constraint). prompt_states [B, P, d] / gen_states [B, N, d]:
    captured residuals (None: not captured); a row's prompt ends at slot ``prompt_end``.
    """
    out = []
    for i, r in enumerate(reqs):
        k = int(n_gen[i]) if stop_at[i] < 0 else int(stop_at[i])
        ids_i = tokens[i, :k].tolist()
        text = tokenizer.decode(ids_i, skip_special_tokens=True) if tokenizer is not None else ""
        if stop_at[i] >= 0:
            finish = "stop"
            text = cut_text(text, r.stop_strings)
        else:
            finish = _FINISH.get(int(reason[i]), "length")
        lp = logps[i, :k].copy()
        healed = ""
        if heals[i] is not None:
            healed = heals[i][0]
            text = text[len(healed):] if text.startswith(healed) else text
            if k:  # the model's own log-prob of the healed token, not the constrained one
                lp[0] = healed_logprob(first_logits[i], ids_i[0])
        states = None
        if prompt_states is not None:
            states = np.concatenate([prompt_states[i, prompt_end - len(r.prompt_ids):prompt_end], gen_states[i, :k]])
        out.append(Completion(ids_i, text, lp, finish, len(r.prompt_ids), states, healed))
    return out
