"""Device scratch of the device-route ``write_token_maps`` (``device_route.DeviceRoute``).

One ``TokenScratch`` per destination view (``ViewTarget.token_scratch``, made at the
view's first device-route token write): view writers are not stream-ordered, so two
views written on two streams never share it. It is sized by the view's token capacity
``T`` (``ViewTarget.max_tokens``), so every later call writes through views of it and
allocates nothing; the views over ``count`` tokens are built once per count.

Shapes and dtypes (all on the view's device): ``rows`` int64 ``[T]`` (each token's row
clamped into the table: an int64 index), ``columns`` int64 ``[2, T]`` (its block column,
then that column clamped into the table), ``masks`` bool ``[2, T]`` (the token goes to
``D``; a scratch condition), and, per dtype as first needed, ``[T]`` of the inherited
counts of each token's row and of the gathered blocks (when the table's dtype is not
the view's); per dtype of a caller's ``inherited_blocks``, ``[R]`` (the route's
``max_requests``) that holds the copy of it the call's record keeps (``keep``).
"""

from __future__ import annotations

from typing import Any, Dict, Tuple

import torch
from torch import Tensor

from mtpmeta.buffers.bounded_cache import BoundedCache
from mtpmeta.buffers.grad_mode import kept_tensors

__all__ = ["TokenScratch"]


class TokenScratch:
    """Fixed-address scratch for ``T`` tokens (see the module docstring)."""

    def __init__(self, tokens: int, device: torch.device) -> None:
        self.tokens = tokens
        self.device = device
        self.rows = torch.zeros(tokens, dtype=torch.int64, device=device)
        self.columns = torch.zeros((2, tokens), dtype=torch.int64, device=device)
        self.masks = torch.zeros((2, tokens), dtype=torch.bool, device=device)
        self._typed: Dict[Tuple[str, torch.dtype], Tensor] = {}
        self._kept: Dict[torch.dtype, Tensor] = {}  # [R] per dtype: keep()'s copies
        self._views = BoundedCache(4096)  # count, or (kind, dtype, count) -> views

    @classmethod
    def of(cls, target: Any) -> "TokenScratch":
        """``target.token_scratch`` (a ``ViewTarget``'s), made at its first use."""
        scratch = target.token_scratch
        if scratch is None:
            with kept_tensors():
                scratch = target.token_scratch = cls(target.max_tokens, target.device)
        return scratch

    def views(self, count: int) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
        """``(rows, columns, clamped, redirect, condition)`` over ``count`` tokens
        (built once per count)."""
        views = self._views.get(count)
        if views is None:
            views = (self.rows[:count], self.columns[0, :count], self.columns[1, :count],
                     self.masks[0, :count], self.masks[1, :count])
            self._views.put(count, views)
        return views

    def typed(self, kind: str, dtype: torch.dtype, count: int) -> Tensor:
        """``[count]`` of the ``[T]`` scratch ``kind`` ("inherited" or "blocks") in
        ``dtype`` (made at its first use; the view built once per count)."""
        key = (kind, dtype, count)
        view = self._views.get(key)
        if view is None:
            tensor = self._typed.get((kind, dtype))
            if tensor is None:
                with kept_tensors():
                    tensor = torch.zeros(self.tokens, dtype=dtype, device=self.device)
                self._typed[(kind, dtype)] = tensor
            view = tensor[:count]
            self._views.put(key, view)
        return view

    def keep(self, inherited: Tensor, capacity: int) -> Tensor:
        """A copy of ``inherited`` (``[L]``, the view's device) in a fixed ``[capacity]``
        buffer of its dtype (made at its first use; the view over ``L`` built once per
        ``L``): one ``copy_`` on the current stream, nothing allocated after the first.
        A tensor longer than ``capacity`` (or not 1-D) is cloned instead.

        >>> scratch = TokenScratch(4, torch.device("cpu"))
        >>> kept = scratch.keep(torch.tensor([2, 0, 1], dtype=torch.int32), 8)
        >>> kept.tolist(), kept.untyped_storage().nbytes()  # [3] of an [8] int32 buffer
        ([2, 0, 1], 32)
        """
        size = inherited.shape[0] if inherited.dim() == 1 else -1
        if not 0 <= size <= capacity:
            return inherited.clone()
        key = ("kept", inherited.dtype, size)
        view = self._views.get(key)
        if view is None:
            buffer = self._kept.get(inherited.dtype)
            if buffer is None or buffer.shape[0] < capacity:
                with kept_tensors():
                    buffer = self._kept[inherited.dtype] = torch.zeros(
                        capacity, dtype=inherited.dtype, device=self.device)
            view = buffer[:size]
            self._views.put(key, view)
        view.copy_(inherited)
        return view
