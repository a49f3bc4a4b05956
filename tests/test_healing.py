"""Token healing: the allowed-first-token computation (tiny tokenizers) and the sampler's healed
generation on the embedded SmolLM2 (marker ``gguf``)."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from morse_jax.sampling.sampler import Request, Sampler, SamplerConfig
from morse_jax.sampling.healing import TokenHealer


class ListTokenizer:
    """id i decodes to ``vocab[i]``; ``special`` ids decode to '' unless asked for."""

    def __init__(self, vocab, special=()):
        self.vocab, self.all_special_ids = list(vocab), list(special)

    def __len__(self):
        return len(self.vocab)

    def decode(self, ids, skip_special_tokens=True):
        return "".join("" if skip_special_tokens and i in self.all_special_ids else self.vocab[i] for i in ids)


class SentencePieceLike(ListTokenizer):
    """Like SentencePiece: a word-initial space is dropped when the text starts with it."""

    def decode(self, ids, skip_special_tokens=True):
        text = super().decode(ids, skip_special_tokens)
        return text[1:] if text.startswith(" ") else text


VOCAB = ["a", "b", "\n", "\n   ", "\n\n", "x\n", ":", ":\n", "<eos>", " foo", "f", "```"]


def test_allowed_tokens_start_with_the_dropped_text():
    h = TokenHealer(ListTokenizer(VOCAB, special=[8]), vocab_size=14)  # 2 padded ids beyond the tokenizer
    want = np.zeros(14, bool)
    want[[2, 3, 4]] = True  # "\n", "\n   ", "\n\n" -- not "x\n" (newline not first), not ":\n"
    np.testing.assert_array_equal(h.allowed("\n"), want)
    n, text, mask = h.heal([0, 6, 2], 1)  # "a" ":" "\n" -> drop "\n"
    assert (n, text) == (1, "\n") and mask is h.allowed("\n")  # cached per text
    n, text, mask = h.heal([0, 6, 2], 2)  # drop ":" "\n" -> only ":\n" re-writes ":\n"
    assert (n, text) == (2, ":\n") and np.flatnonzero(mask).tolist() == [7]
    assert h.heal([0, 1, 8], 1) == (0, "", None)  # a special token is never re-written
    assert h.heal([2], 1) == (0, "", None)  # nothing would be left of the prompt


def test_token_texts_are_read_in_context():
    """SentencePiece drops a leading space when " foo" is decoded alone; after a word it is there."""
    h = TokenHealer(SentencePieceLike(VOCAB, special=[8]), vocab_size=12)
    assert h.token_texts()[9] == " foo"
    assert np.flatnonzero(h.allowed(" f")).tolist() == [9]
    assert h.dropped_text([0, 9], 1) == " foo"


def test_no_token_re_writes_the_text_means_no_healing():
    class Odd(ListTokenizer):  # "q" reads as "Q" after "b" only: no token's text starts with "Q"
        def decode(self, ids, skip_special_tokens=True):
            return super().decode(ids, skip_special_tokens).replace("bq", "bQ")

    h = TokenHealer(Odd(["a", "b", "q"]), vocab_size=3)
    assert h.heal([0, 2], 1)[:2] == (1, "q")
    assert h.dropped_text([1, 2], 1) == "Q" and h.heal([1, 2], 1) == (0, "", None)


def test_request_rejects_healing_the_whole_prompt():
    with pytest.raises(ValueError, match=r"heal_tokens"):
        Request([1, 2], heal_tokens=2).validate()


# ------------------------------------------------------------------------------ embedded model

HEAL_CFG = SamplerConfig(batch_buckets=(4,), prompt_buckets=(128,), new_token_buckets=(16,), max_batch=4,
                         prefill_rows=128)


@pytest.mark.gguf
@pytest.mark.slow  # ~30 s of compiles on a quiet 2-core machine; the fast twin is in test_sampler.py
def test_prefix_ending_in_a_newline_heals_to_the_unforced_continuation(smollm2_backbone):
    """Prefix "...:\\n" healed gives the tokens, text and log-probs the model writes after "...:" --
    where its first token is newline + indentation, which the bare "\\n" prompt token forbids."""
    from morse_jax.models.chat import encode_chat

    bb = smollm2_backbone
    tok = bb.tokenizer
    user = [{"role": "user", "content": "Write a Python function add(a, b) that returns the sum of a and b."}]
    header = "```python\ndef add(a, b):"
    with_nl = encode_chat(tok, [*user, {"role": "assistant", "content": header + "\n"}])
    without = encode_chat(tok, [*user, {"role": "assistant", "content": header}])
    assert with_nl[:-1] == without and tok.decode(with_nl[-1:]) == "\n"  # the prefix ends on a bare "\n" token
    sampler = Sampler(bb, None, HEAL_CFG)
    healed, plain, forced = sampler.generate(None, [
        Request(with_nl, temperature=0.0, max_new_tokens=12, heal_tokens=1),
        Request(without, temperature=0.0, max_new_tokens=12),
        Request(with_nl, temperature=0.0, max_new_tokens=12),
    ], key=jax.random.PRNGKey(0))
    assert tok.decode(plain.token_ids[:1]).startswith("\n")  # unforced, the model writes "\n" + indentation
    assert healed.token_ids == plain.token_ids and healed.prompt_len == len(without)
    assert healed.healed_text == "\n" and healed.text == plain.text[1:]  # text continues the whole prompt
    np.testing.assert_allclose(healed.logprobs, plain.logprobs, atol=1e-4)  # unconstrained log-probs
    assert "return" in healed.text
    assert forced.token_ids[:1] != plain.token_ids[:1]  # the unhealed prompt derails the first token
