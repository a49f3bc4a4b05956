"""Chat-template rendering and decoding helpers around a transformers tokenizer."""

from __future__ import annotations

from typing import Any, Mapping, Sequence


def encode_chat(tokenizer: Any, messages: Sequence[Mapping[str, str]], *, add_generation_prompt: bool = True,
                enable_thinking: bool | None = None) -> list[int]:
    """Token ids of ``messages`` rendered with the tokenizer's chat template.

    A final ``assistant`` message is a prefix of the answer: the template renders it unclosed
    (``continue_final_message``) so generation continues it.

    ``enable_thinking`` is passed to templates that accept it (Qwen3); None leaves the default.
    Raises ValueError when the tokenizer has no chat template.
    """
    if tokenizer is None:
        raise ValueError("encode_chat: the backbone has no tokenizer (load one or pass token ids)")
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("encode_chat: the tokenizer has no chat template")
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping) or "role" not in m or "content" not in m:
            raise ValueError(f"encode_chat: messages[{i}] must be a mapping with 'role' and 'content'")
    kwargs = {} if enable_thinking is None else {"enable_thinking": enable_thinking}
    if messages and messages[-1]["role"] == "assistant":
        kwargs.update(continue_final_message=True)
        add_generation_prompt = False
    text = tokenizer.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=add_generation_prompt,
                                         **kwargs)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def stop_token_ids(tokenizer: Any, config_eos: Sequence[int] = ()) -> tuple[int, ...]:
    """End-of-turn ids: the config's eos ids plus the tokenizer's eos and common end-of-turn tokens."""
    ids = set(int(i) for i in config_eos)
    if tokenizer is not None:
        if tokenizer.eos_token_id is not None:
            ids.add(int(tokenizer.eos_token_id))
        vocab = tokenizer.get_vocab()
        for tok in ("<|im_end|>", "<|eot_id|>", "<end_of_turn>", "<|endoftext|>"):
            if tok in vocab:
                ids.add(int(vocab[tok]))
    return tuple(sorted(ids))
