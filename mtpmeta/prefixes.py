"""``Prefixes``: the cached prefix and row-range views of one tensor that a placement
copies into or from (``shadow_stage``'s fixed stages, ``device_loop``'s planned
depths). A view costs about 8k instructions to build (a torch slice) and nothing to
look up again, so each ``[:k]`` is built once per tensor, on first use or ahead of it
(``fill``).

>>> import torch
>>> counter = [0]
>>> p = Prefixes(torch.arange(4, dtype=torch.int64), True, counter)
>>> p.prefix(1).tolist(), p.prefix(1) is p.prefix(1), counter
([0, 0], True, [1])
"""

from __future__ import annotations

from typing import Dict, List, Tuple

from torch import Tensor

from .placement import word_view

__all__ = ["Prefixes"]


class Prefixes:
    """Prefixes ``[:k]`` (leading rows of a 2-D tensor) and row ranges of one tensor,
    as int32 words when its pair copies words, each built once (``counter[0]`` counts
    the builds)."""

    __slots__ = ("tensor", "scale", "cache", "ranges", "counter")

    def __init__(self, tensor: Tensor, words: bool, counter: List[int]) -> None:
        viewed = word_view(tensor) if words else tensor
        self.tensor = viewed
        # Words per element of a 1-D tensor (an int64 field read as words: 2).
        self.scale = viewed.shape[0] // tensor.shape[0] \
            if tensor.dim() == 1 and tensor.shape[0] else 1
        self.cache: Dict[int, Tensor] = {}  # k -> [:k]; k <= the tensor's length + 1
        self.ranges: Dict[Tuple[int, int], Tensor] = {}  # (start, stop) -> rows
        self.counter = counter

    def build(self, count: int) -> Tensor:
        value = self.tensor[:count * self.scale]
        self.cache[count] = value
        self.counter[0] += 1
        return value

    def prefix(self, count: int) -> Tensor:
        """``[:count]`` (times ``scale`` words), built once."""
        value = self.cache.get(count)
        return value if value is not None else self.build(count)

    def fill(self, upto: int) -> None:
        """Build every prefix ``[:k]`` not built yet, ``1 <= k <= upto``."""
        for k in range(1, upto + 1):
            if k not in self.cache:
                self.build(k)

    def rows(self, start: int, stop: int) -> Tensor:
        value = self.ranges.get((start, stop))
        if value is None:
            value = self.tensor[start:stop]
            self.ranges[(start, stop)] = value
            self.counter[0] += 1
        return value
