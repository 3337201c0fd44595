"""Requests and the row table of a dynamic batch.

Rows follow upstream's dynamic-context layout: ``[0, paused)`` paused requests,
``[paused, total)`` active ones, ``[total, R)`` free. Every row operation is applied
to three things at once, with the same semantics: the library's annotations
(``move_request_rows`` / ``swap_request_rows`` / ``reset_request_rows``), the engine's
own block table ``[R, W]``, and the engine's row -> request list. ``verify`` then
checks that the library's ``request_matched_prefix_blocks`` still agree row by row.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, List, Optional, Sequence

import numpy as np
import torch

from mtpmeta.simulate.mismatch import Mismatch

__all__ = ["Request", "RowTable"]


@dataclass(eq=False)
class Request:
    """One request, as the engine tracks it (positions are token positions).

    ``tokens``: prompt followed by the generated tokens committed so far (length ``N``).
    ``prefilled``: prompt tokens the main model has processed (the next chunk's offset).
    ``blocks``: block id per table column, inherited ones first (``matched`` of them).
    ``mtp_committed``: leading MTP positions whose KV holds committed values (the
    inherited blocks count from the start). ``drafts``: the last draft loop's tokens,
    verified by the next step. ``holds_carry``: a chunk of it ended with a carry.
    """

    rid: int
    prompt: List[int]
    max_new: int
    matched: int = 0
    blocks: List[int] = field(default_factory=list)
    tokens: List[int] = field(default_factory=list)
    prefilled: int = 0
    mtp_committed: int = 0
    drafts: List[int] = field(default_factory=list)
    holds_carry: bool = False

    @property
    def decoding(self) -> bool:
        return self.prefilled == len(self.prompt)

    @property
    def generated(self) -> int:
        return len(self.tokens) - len(self.prompt)

    def __repr__(self) -> str:
        return f"request {self.rid}"


def _rows(indices: Sequence[int], kind: int) -> Any:
    """The same row list as a list, a numpy array or a tensor (all accepted)."""
    if kind == 0:
        return list(indices)
    if kind == 1:
        return np.asarray(indices, dtype=np.int64)
    return torch.tensor(list(indices), dtype=torch.int64)


class RowTable:
    """The batch's rows; see the module docstring. ``table`` is host int32 ``[R, W]``,
    ``-1`` where a request has no block (never read: a read of ``-1`` is a bug)."""

    def __init__(self, max_requests: int, block_columns: int, mtp: Any) -> None:
        self.mtp = mtp
        self.requests: List[Optional[Request]] = [None] * max_requests
        self.table = torch.full((max_requests, block_columns), -1, dtype=torch.int32)
        self._table = self.table.numpy()
        self.paused = 0
        self.total = 0
        self.calls = {"move": 0, "swap": 0, "reset": 0}
        self._kind = 0

    @property
    def active_rows(self) -> range:
        return range(self.paused, self.total)

    @property
    def active_count(self) -> int:
        return self.total - self.paused

    def row_of(self, request: Request) -> int:
        return self.requests.index(request)

    def live(self) -> List[Request]:
        return [r for r in self.requests[:self.total] if r is not None]

    def _next_kind(self) -> int:
        self._kind = (self._kind + 1) % 3
        return self._kind

    # ---------------------------------------------------------- row operations
    def place(self, request: Request) -> int:
        """A new request takes the first free row (``total``); its annotation is the
        number of blocks it inherited, written straight into the host tensor as
        upstream's prefix matcher does."""
        row = self.total
        self.requests[row] = request
        self._table[row] = -1
        self._table[row, :len(request.blocks)] = request.blocks
        self.mtp.request_matched_prefix_blocks[row] = request.matched
        self.total += 1
        return row

    def add_block(self, request: Request, block: int) -> None:
        self._table[self.row_of(request), len(request.blocks)] = block
        request.blocks.append(block)

    def move(self, src: Sequence[int], dst: Sequence[int]) -> None:
        """``x[dst] = x[src]``, sources read first (ranges may overlap)."""
        if not len(src):
            return
        kind = self._next_kind()
        self.mtp.move_request_rows(_rows(src, kind), _rows(dst, kind))
        self._table[list(dst)] = self._table[list(src)]
        old = list(self.requests)
        for s, d in zip(src, dst):
            self.requests[d] = old[s]
        self.calls["move"] += 1

    def swap(self, src: Sequence[int], dst: Sequence[int]) -> None:
        """Swap rows pairwise (the pairs are disjoint)."""
        if not len(src):
            return
        kind = self._next_kind()
        self.mtp.swap_request_rows(_rows(src, kind), _rows(dst, kind))
        old_table = self._table.copy()
        self._table[list(dst)] = old_table[list(src)]
        self._table[list(src)] = old_table[list(dst)]
        old = list(self.requests)
        for s, d in zip(src, dst):
            self.requests[d], self.requests[s] = old[s], old[d]
        self.calls["swap"] += 1

    def reset(self, rows: Sequence[int]) -> None:
        """Free ``rows``: annotation 0, no blocks, no request. A contiguous run is
        passed as a slice (``reset_request_rows`` takes those too)."""
        rows = list(rows)
        if not rows:
            return
        if rows == list(range(rows[0], rows[-1] + 1)) and self._next_kind() == 0:
            self.mtp.reset_request_rows(slice(rows[0], rows[-1] + 1))
        else:
            self.mtp.reset_request_rows(_rows(rows, self._next_kind()))
        self._table[rows] = -1
        for row in rows:
            self.requests[row] = None
        self.calls["reset"] += 1

    # ------------------------------------------------------------------ checks
    def verify(self, when: str) -> None:
        """The library's annotations and the engine's table agree with each request."""
        annotations = self.mtp.request_matched_prefix_blocks.tolist()
        for row, request in enumerate(self.requests):
            expected = 0 if request is None else request.matched
            if annotations[row] != expected:
                raise Mismatch("annotations", f"after {when}, request_matched_prefix_"
                               f"blocks[{row}] does not follow the row's request",
                               request=f"{request} (row {row})", expected=expected,
                               got=annotations[row])
            blocks = [] if request is None else request.blocks
            own = self._table[row, :len(blocks)].tolist()
            if own != blocks or (self._table[row, len(blocks):] != -1).any():
                raise RuntimeError(f"engine bug: block table row {row} {own} does not "
                                   f"hold {request}'s blocks {blocks}")
