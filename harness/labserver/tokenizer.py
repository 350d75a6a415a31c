"""The lab model's tokenizer: one whitespace-separated word is one token.

Token ids come from a stable hash of the word (CRC-32), so they are the same in every process and
every run without a vocabulary file; that is all the prefix cache needs (equal words, equal ids).
A small reverse table remembers the words it has seen so ids can be turned back into text.
"""

from __future__ import annotations

import zlib

VOCAB_SIZE = 1 << 20  # ids in [0, VOCAB_SIZE); collisions only make two words share an id


class WhitespaceTokenizer:
    def __init__(self, remember: int = 100_000) -> None:
        self._words: dict[int, str] = {}
        self._remember = remember

    @staticmethod
    def split(text: str) -> list[str]:
        return text.split()

    def encode(self, text: str) -> list[int]:
        ids = []
        for word in text.split():
            token_id = zlib.crc32(word.encode("utf-8")) % VOCAB_SIZE
            if len(self._words) < self._remember:
                self._words.setdefault(token_id, word)
            ids.append(token_id)
        return ids

    def decode(self, ids: list[int]) -> str:
        return " ".join(self._words.get(i, f"<{i}>") for i in ids)
