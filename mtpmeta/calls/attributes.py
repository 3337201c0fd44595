"""How ``MTPMetadata``'s public attributes and docstrings reach the objects that hold
them: properties over a field of a call group or of ``CallState``, over a persistent
buffer of the allocation, over the chunk carry's keys, and the docstring of a public
method that a group method carries out.
"""

from __future__ import annotations

from operator import attrgetter
from typing import Any, Callable, Optional

from torch import Tensor

from mtpmeta.validation.request_rows import check_annotation_offset

__all__ = ["field_property", "buffer_property", "carry_key", "public_doc"]


def field_property(holder: str, name: str, doc: str) -> property:
    """A public attribute, readable and assignable, that is field ``name`` of the
    object at attribute ``holder`` (``"_state"``, ``"_draft"``). The getter is
    ``operator.attrgetter`` (no Python frame: a scheduler may read these every step)."""
    def set(self: Any, value: Any) -> None:
        setattr(getattr(self, holder), name, value)
    return property(attrgetter(f"{holder}.{name}"), set, doc=doc)


def annotation_offset_property(doc: str) -> property:
    """``draft_annotation_offset``: an int in ``[0, max_requests]``, and while a split
    ``set_request_rows`` declared lives, its paused count (anything else is refused,
    naming it, and changes nothing). Assigning it never touches the split."""
    def set(self: Any, value: Any) -> None:
        state = self._state
        state.annotation_offset = check_annotation_offset(self.max_requests, value,
                                                          state.split)
    return property(attrgetter("_state.annotation_offset"), set, doc=doc)


def buffer_property(name: str, doc: str) -> property:
    """A read-only persistent buffer (of ``self._buffers``): None without one."""
    def get(self: Any) -> Optional[Tensor]:
        buffers = self._buffers
        return None if buffers is None else getattr(buffers, name)
    return property(get, doc=doc)


def carry_key(index: int, read: Callable[[Any], Any], convert: Optional[Callable[[Any], Any]],
              doc: str) -> property:
    """Entry ``index`` of the carry's keys (``[valid, req_id, position]`` int64), read
    through ``read`` and stored through ``convert`` (None: as given)."""
    def get(self: Any) -> Any:
        return read(self._carry.keys[index])

    def set(self: Any, value: Any) -> None:
        self._carry.keys[index] = value if convert is None else convert(value)
    return property(get, set, doc=doc)


def public_doc(source: Callable[..., Any]) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Give the decorated public method the docstring of ``source``, the group method
    that carries it out: ``help`` shows the contract, and its text lives beside the
    code that keeps it."""
    def apply(method: Callable[..., Any]) -> Callable[..., Any]:
        method.__doc__ = source.__doc__
        return method
    return apply
