"""``BoundedCache``: the one memo of derived objects (views, plans, shapes), never data.

A ``dict`` subclass, so a hit is ``dict.get`` in C: the hot paths look a key up on
every call and pay nothing for the bound. Misses go through ``put`` (or
``get_or_build``), which evicts the oldest entry once ``capacity`` is reached, so a
workload of ever-new shapes cannot grow it without limit.

>>> cache = BoundedCache(2)
>>> cache.put("a", 1); cache.put("b", 2); cache.put("c", 3)
>>> sorted(cache), cache.get("a"), cache.get_or_build("d", lambda: 4)
(['b', 'c'], None, 4)
"""

from __future__ import annotations

from typing import Any, Callable, Hashable

__all__ = ["BoundedCache"]


class BoundedCache(dict):
    """At most ``capacity`` entries, oldest evicted first; ``None`` is not a value."""

    __slots__ = ("capacity",)

    def __init__(self, capacity: int) -> None:
        super().__init__()
        self.capacity = capacity

    def put(self, key: Hashable, value: Any) -> None:
        if len(self) >= self.capacity and key not in self:
            del self[next(iter(self))]
        self[key] = value

    def prefix(self, name: Hashable, tensor: Any, stop: int) -> Any:
        """``tensor[:stop]``, built once per ``(name, stop)`` (``get_or_build`` without
        the closure: the mirror path takes several prefixes per step)."""
        key = (name, stop)
        value = self.get(key)
        if value is None:
            value = tensor[0:stop]
            self.put(key, value)
        return value

    def get_or_build(self, key: Hashable, build: Callable[[], Any]) -> Any:
        value = self.get(key)
        if value is None:
            value = build()
            self.put(key, value)
        return value
