"""Prefix caching the way vLLM does it: hashes over full blocks of token ids, chained.

A block's hash covers its parent's hash and its own tokens, so equal hashes mean equal prefixes.
Only full blocks are cached; when a whole prompt is cached, its last token is still computed
(vLLM needs at least one token to run for the first output), so the hit stops one block short.
Eviction is least-recently-used over blocks, bounded by `capacity_blocks`.
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from dataclasses import dataclass

DEFAULT_BLOCK_SIZE = 16  # vLLM's default KV-cache block size


def block_hashes(token_ids: list[int], block_size: int = DEFAULT_BLOCK_SIZE) -> list[bytes]:
    """One chained hash per full block of `token_ids` (a trailing partial block has none)."""
    hashes: list[bytes] = []
    parent = b"memtel-lab-root"
    full = len(token_ids) - len(token_ids) % block_size
    for start in range(0, full, block_size):
        block = token_ids[start : start + block_size]
        digest = hashlib.blake2b(parent, digest_size=16)
        digest.update(",".join(map(str, block)).encode("ascii"))
        parent = digest.digest()
        hashes.append(parent)
    return hashes


@dataclass(frozen=True)
class PrefixHit:
    cached_tokens: int  # tokens that need no prefill
    hashes: list[bytes]  # every full block of the prompt, to commit after the prefill


class PrefixCache:
    def __init__(self, capacity_blocks: int, block_size: int = DEFAULT_BLOCK_SIZE) -> None:
        if capacity_blocks < 0 or block_size < 1:
            raise ValueError(f"capacity_blocks must be >= 0 and block_size >= 1, got {capacity_blocks}, {block_size}")
        self.block_size = block_size
        self.capacity_blocks = capacity_blocks
        self._blocks: OrderedDict[bytes, None] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._blocks)

    def lookup(self, token_ids: list[int]) -> PrefixHit:
        hashes = block_hashes(token_ids, self.block_size)
        # At most the blocks before the last token: that token is always computed.
        usable = (len(token_ids) - 1) // self.block_size if token_ids else 0
        hit_blocks = 0
        with self._lock:
            for digest in hashes[:usable]:
                if digest not in self._blocks:
                    break
                self._blocks.move_to_end(digest)
                hit_blocks += 1
        return PrefixHit(cached_tokens=hit_blocks * self.block_size, hashes=hashes)

    def commit(self, hashes: list[bytes]) -> None:
        """Remember the blocks of a prefilled prompt, evicting the least recently used beyond capacity."""
        with self._lock:
            for digest in hashes:
                self._blocks[digest] = None
                self._blocks.move_to_end(digest)
            while len(self._blocks) > self.capacity_blocks:
                self._blocks.popitem(last=False)

    def reset(self) -> None:
        with self._lock:
            self._blocks.clear()
