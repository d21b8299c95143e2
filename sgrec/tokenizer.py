"""The one tokenizer wrapper: encoding, decoding and per-token texts."""

from __future__ import annotations

import os

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


class Tokenizer:
    def __init__(self, path: str):
        from transformers import AutoTokenizer

        self.hf = AutoTokenizer.from_pretrained(path)
        self.vocab_size = len(self.hf)
        self.eos_token_id = self.hf.eos_token_id
        self.special_ids = set(self.hf.all_special_ids)
        self._vocab: dict[str, int] | None = None  # token text -> id (token_id), read once

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.hf.encode(text, add_special_tokens=add_special_tokens)

    def decode(self, ids: list[int], skip_special_tokens: bool = True, spaces_between_special_tokens: bool = True) -> str:
        return self.hf.decode(
            ids, skip_special_tokens=skip_special_tokens, spaces_between_special_tokens=spaces_between_special_tokens
        )

    def token_id(self, token: str) -> int | None:
        """The id of a vocabulary token given as its text (`<|sid_begin|>`), else of a text that
        encodes to exactly one token; None for anything else."""
        if self._vocab is None:
            self._vocab = self.hf.get_vocab()
        tid = self._vocab.get(token)
        if tid is None:
            ids = self.encode(token, add_special_tokens=False)
            tid = ids[0] if len(ids) == 1 else None
        return tid

    def token_texts(self, ids: list[int]) -> list[str]:
        return [self.hf.decode([i]) for i in ids]

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        return self.hf.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=False)
