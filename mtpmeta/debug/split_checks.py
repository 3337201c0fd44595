"""The row-split half of ``mtpmeta.debug.invariants``: the checks that need to know
which context row each request of the last forward is.

A forward's request ``i`` is context row ``first + i``, where ``first`` is the paused
count of the scheduler's row split. The check knows it when the caller tells it
(``check_invariants(request_rows=(paused, total))``) or, for a commit pass, when a
split ``set_request_rows`` declared served the pass (``ForwardRecord.first_row``).
Then:

- ``prefix redirect``: no real token of request ``i`` whose block column is below the
  annotation ``request_matched_prefix_blocks[first + i]`` points at a real block (the
  shared prefix block stays unwritten, whatever ``inherited_blocks`` the call got), and
  no real token of a commit pass at or past it goes to the dummy block (a count above
  the blocks really shared loses the request's own KV). The
  annotations are read at the record's first check (``MTPMETA_DEBUG=1`` checks right
  after the call; a row move afterwards changes them).
- ``context rows`` (with ``block_table``, the context's whole ``[R, W]`` table, and
  ``request_rows``): request ``i`` lies in the active rows ``[0, total - paused)`` and
  every real token not sent to the dummy block writes ``block_table[paused + i,
  position // BS]``: the call read the active requests' rows, not a paused request's
  (whole ``R``-row arrays passed with no split read rows ``[0, P)``, upstream's
  behaviour).
"""

from __future__ import annotations

import weakref
from typing import Any, Optional, Tuple

import numpy as np

from mtpmeta.debug.view_checks import (_TOKEN_NAMES, _describe, _fail, _host,
                                       _read_fields, _record_key)
from mtpmeta.types import ForwardRecord

__all__: list = []  # private to mtpmeta.debug.invariants, whose entry calls these

SPLIT_KINDS = ("decode", "commit")  # records whose request i is a context row
# meta -> (record, _record_key, annotations copied at the record's first check)
_ANNOTATIONS_SEEN: "weakref.WeakKeyDictionary[Any, tuple]" = weakref.WeakKeyDictionary()


def check_request_rows(meta: Any, request_rows: Any) -> Optional[Tuple[int, int]]:
    """``request_rows`` as ``(paused, total)`` ints with ``0 <= paused <= total <= R``
    (None stays None); anything else is a ``ValueError`` naming it."""
    if request_rows is None:
        return None
    try:
        paused, total = request_rows
    except (TypeError, ValueError):
        raise ValueError(f"request_rows: expected (paused, total), got {request_rows!r}")
    R = meta.max_requests
    if not all(isinstance(x, (int, np.integer)) and not isinstance(x, bool)
               for x in (paused, total)) or not 0 <= paused <= total <= R:
        raise ValueError(f"request_rows: ({paused!r}, {total!r}) is not a split of ints "
                         f"with 0 <= paused <= total <= max_requests {R}")
    return int(paused), int(total)


def _fail_redirect(record: ForwardRecord, token: int, request: int, row: int,
                   column: int, annotations: np.ndarray, what: str, why: str) -> None:
    """The prefix-redirect failure for ``token`` (request ``request`` = context row
    ``row``, block column ``column``), which ``what`` against its annotation."""
    _fail("prefix redirect", f"token {token} of {_describe(record)} (request {request} "
                             f"= context row {row}, block column {column}) {what}, but "
                             f"request_matched_prefix_blocks[{row}] = "
                             f"{int(annotations[row])}: {why}")


def check_split_rows(meta: Any, record: ForwardRecord, view: Any,
                     request_rows: Optional[Tuple[int, int]], block_table: Any) -> None:
    """The module's two invariants for the last forward's real tokens."""
    T = record.token_count
    if record.kind not in SPLIT_KINDS or not T:
        return
    first = record.first_row if request_rows is None else request_rows[0]
    if first is None:
        return
    f = _read_fields(view, _TOKEN_NAMES, T)
    requests = f["token_to_request_idx"][:T]
    columns = f["token_to_position_in_request"][:T] // meta.block_size_tokens
    blocks = f["token_to_block_idx"][:T]
    real = blocks != meta.dummy_block_idx
    rows = first + requests
    R = meta.max_requests
    outside = np.flatnonzero((requests < 0) | (rows >= R))
    if outside.size:
        t = int(outside[0])
        _fail("context rows", f"token {t} of {_describe(record)} is request "
                              f"{int(requests[t])}, context row {int(rows[t])}: outside "
                              f"the {R} rows")
    annotations = _annotations(meta, record)
    bad = np.flatnonzero(real & (columns < annotations[rows]))
    if bad.size:
        t = int(bad[0])
        _fail_redirect(record, t, int(requests[t]), int(rows[t]), int(columns[t]),
                       annotations, f"writes block {int(blocks[t])}",
                       "a shared prefix block is rewritten (inherited_blocks forgotten, "
                       "too low, or taken from other rows)")
    lost = np.flatnonzero(~real & (columns >= annotations[rows])) \
        if record.kind == "commit" else np.empty(0, np.int64)
    if lost.size:
        t = int(lost[0])
        _fail_redirect(record, t, int(requests[t]), int(rows[t]), int(columns[t]),
                       annotations, "goes to the dummy block",
                       "the request's own KV is lost (an inherited count above the "
                       "blocks really shared)")
    if block_table is None or request_rows is None:
        return
    _check_context_rows(meta, record, request_rows, requests, columns, blocks, real,
                        _host(block_table).astype(np.int64))


def _check_context_rows(meta: Any, record: ForwardRecord, request_rows: Tuple[int, int],
                        requests: np.ndarray, columns: np.ndarray, blocks: np.ndarray,
                        real: np.ndarray, table: np.ndarray) -> None:
    paused, total = request_rows
    if table.ndim != 2 or table.shape[0] != meta.max_requests:
        raise ValueError(f"block_table: expected the context's whole [max_requests "
                         f"{meta.max_requests}, W] table, got shape {tuple(table.shape)}")
    beyond = np.flatnonzero(requests >= total - paused)
    if beyond.size:
        t = int(beyond[0])
        _fail("context rows", f"token {t} of {_describe(record)} is request "
                              f"{int(requests[t])}, but the split ({paused}, {total}) has "
                              f"{total - paused} active rows")
    rows = paused + requests
    inside = real & (columns >= 0) & (columns < table.shape[1])
    tokens = np.flatnonzero(inside)
    expected = table[rows[tokens], columns[tokens]]
    wrong = np.flatnonzero(blocks[tokens] != expected)
    if wrong.size:
        t = int(tokens[wrong[0]])
        owners = np.flatnonzero((table == blocks[t]).any(axis=1))
        owner = (f"; block {int(blocks[t])} is context row {int(owners[0])}'s"
                 if owners.size else "")
        _fail("context rows", f"token {t} of {_describe(record)} (request "
                              f"{int(requests[t])} = context row {int(rows[t])}, column "
                              f"{int(columns[t])}) writes block {int(blocks[t])}, but the "
                              f"context's block_table holds {int(expected[wrong[0]])} "
                              f"there{owner}: the call read other rows than the split's "
                              f"active ones")


def _annotations(meta: Any, record: ForwardRecord) -> np.ndarray:
    """``request_matched_prefix_blocks`` as int64, copied at ``record``'s first check."""
    key = _record_key(record)
    seen = _ANNOTATIONS_SEEN.get(meta)
    if seen is not None and seen[0] is record and seen[1] == key:
        return seen[2]
    annotations = _host(meta.request_matched_prefix_blocks).astype(np.int64).copy()
    _ANNOTATIONS_SEEN[meta] = (record, key, annotations)
    return annotations
