"""``Prefixes``: the cached prefix and row-range views of one tensor that a placement
copies into or from (``stages``' fixed stages, ``device_draft_plan``'s planned
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

from mtpmeta.mirror.copy_plan import word_view

__all__ = ["Prefixes", "PrefixGroup"]


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


class PrefixGroup:
    """The pairs ``(destination, source)`` (each a ``Prefixes``) that one placement
    copies over the same length ``k``: per ``k``, their ``[:k]`` views as two lists in
    pair order, built once (``counter[0]`` counts the builds), so a placement joins a
    few cached lists instead of looking up every pair's prefix. ``k == 0``: two empty
    lists (nothing to copy)."""

    __slots__ = ("pairs", "cache", "counter")

    def __init__(self, pairs: List[Tuple[Prefixes, Prefixes]], counter: List[int]) -> None:
        self.pairs = pairs
        self.cache: Dict[int, Tuple[List[Tensor], List[Tensor]]] = {0: ([], [])}
        self.counter = counter

    @classmethod
    def classes(cls, roles: list, members: Tuple[Tuple[int, ...], ...],
                counter: List[int]) -> Tuple[list, List["PrefixGroup"]]:
        """``(roles, a group per class)``: class ``i`` pairs the ``Prefixes`` of the
        roles ``members[i]`` (each role a ``(destination, source, ...)`` tuple). The
        classes must hold each role once (a role left out would never be copied)."""
        if sorted(i for indices in members for i in indices) != list(range(len(roles))):
            raise ValueError(f"classes {members}: each of the {len(roles)} roles must be "
                             "in exactly one")
        return roles, [cls([roles[i][:2] for i in indices], counter)
                       for indices in members]

    def build(self, count: int) -> Tuple[List[Tensor], List[Tensor]]:
        value = ([dst.prefix(count) for dst, _ in self.pairs],
                 [src.prefix(count) for _, src in self.pairs])
        self.cache[count] = value
        self.counter[0] += 1
        return value

    def fill(self, upto: int) -> None:
        """Build every ``k <= upto`` not built yet."""
        for k in range(1, upto + 1):
            if k not in self.cache:
                self.build(k)
