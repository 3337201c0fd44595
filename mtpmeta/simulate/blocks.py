"""KV block bookkeeping of the engine: a ref-counted block pool and a prefix cache.

This is the engine's side of prefix sharing; the library only learns the result, as
``request_matched_prefix_blocks[row]`` (how many leading blocks of that row were
inherited) and as the block ids in the block table.

MTP detail (roll-by-one): the MTP KV at position ``p`` is computed from the main hidden
at ``p`` AND the token at ``p + 1``. So a full block ``b`` (positions ``b*BS ..
(b+1)*BS - 1``) is shareable only between prompts that agree on ``(b+1)*BS + 1``
tokens, one more than the block holds. The cache key is that token prefix.
"""

from __future__ import annotations

from collections import deque
from typing import Deque, Dict, List, Sequence, Tuple

import numpy as np

__all__ = ["BlockPool", "PrefixCache"]


class BlockPool:
    """``num_blocks`` real blocks, handed out first-freed-first-reused, each with a
    reference count (1 for its allocating request, +1 per request that inherits it)."""

    def __init__(self, num_blocks: int) -> None:
        self.free: Deque[int] = deque(range(num_blocks))
        self.refcount = np.zeros(num_blocks, dtype=np.int64)

    def allocate(self) -> int:
        if not self.free:
            raise RuntimeError("BlockPool: out of blocks (SimConfig sizes the pool so "
                               "this cannot happen)")
        block = self.free.popleft()
        self.refcount[block] = 1
        return block

    def share(self, block: int) -> None:
        """One more request holds ``block`` (it inherited it from the prefix cache)."""
        if self.refcount[block] < 1:
            raise RuntimeError(f"BlockPool: sharing free block {block}")
        self.refcount[block] += 1

    def release(self, block: int) -> bool:
        """Drop one reference; True when that freed the block."""
        if self.refcount[block] < 1:
            raise RuntimeError(f"BlockPool: releasing free block {block}")
        self.refcount[block] -= 1
        if self.refcount[block] == 0:
            self.free.append(block)
            return True
        return False


class PrefixCache:
    """Token prefix -> block id of every full, committed block of a live request.

    ``register`` is called once a request's MTP KV is committed through the end of a
    block; ``match`` returns the blocks a new prompt can inherit; ``forget`` drops a
    freed block. Example with ``BS = 4``: a producer that committed 8 positions of
    tokens ``[5, 1, 4, 7, 2, 2, 0, 3, 6]`` registered ``(5, 1, 4, 7, 2) -> 10`` and
    ``(5, 1, 4, 7, 2, 2, 0, 3, 6) -> 11``; a prompt ``[5, 1, 4, 7, 2, 6]`` matches
    ``[10]`` (its 9-token key is not there).
    """

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._blocks: Dict[Tuple[int, ...], int] = {}
        self._keys: Dict[int, Tuple[int, ...]] = {}

    def key(self, tokens: Sequence[int], column: int) -> Tuple[int, ...]:
        """The prefix a block at ``column`` depends on: ``(column + 1) * BS + 1`` tokens."""
        return tuple(tokens[:(column + 1) * self.block_size + 1])

    def register(self, tokens: Sequence[int], column: int, block: int) -> bool:
        """Offer ``block`` (column ``column`` of a request with ``tokens``); True when
        it was new to the cache (an equal prefix may already map to another block)."""
        key = self.key(tokens, column)
        if key in self._blocks or block in self._keys:
            return False
        self._blocks[key] = block
        self._keys[block] = key
        return True

    def match(self, prompt: Sequence[int], max_blocks: int) -> List[int]:
        """Leading blocks ``prompt`` may inherit: at most ``max_blocks``, and always
        leaving at least one prompt token to prefill (the key is one token longer)."""
        blocks: List[int] = []
        for column in range(max_blocks):
            if len(prompt) < (column + 1) * self.block_size + 1:
                break
            block = self._blocks.get(self.key(prompt, column))
            if block is None:
                break
            blocks.append(block)
        return blocks

    def forget(self, block: int) -> None:
        key = self._keys.pop(block, None)
        if key is not None:
            del self._blocks[key]
