"""Debug checks of ``MTPMetadata``'s invariants (``meta.check_invariants(view)``).

A debug tool, not a hot-path one: every check is plain numpy over blocking host copies
of the persistent buffers and of the destination view, so on CUDA it syncs. Each
check raises ``InvariantError`` explicitly (it still fires under ``python -O``) with a
message that starts with the invariant's name and names the offending row, token or
slot, e.g. ``"padded token rows: token 5 (pad rows [3, 6) of the last decode forward)
has token_to_block_idx 12, expected dummy_block_idx 999"``.

The invariants, in the order they are checked:

- ``forward mode``: a disabled object is NONE and holds no buffers; an unallocated one
  holds no buffers; DRAFT has active views (prefixes of the buffers, ``n`` long);
  COMMIT was entered by ``setup_commit_pass``: the last view-writing call is that pass
  or a writer call made during it (kind commit/tokens/mha), never a draft depth.
- ``annotations``: ``request_matched_prefix_blocks`` lie in ``[0, W]``.
- ``draft offsets``: while DRAFT, ``offsets[:n]`` lie in ``[0, W * BS]``. The upper
  end is inclusive: a loop that drafts into a request's last slot leaves that offset one
  past it after its final ``advance_decode_step`` (``setup_decode_step`` refuses to
  write from there).
- ``padded token rows`` (last forward of kind decode/commit/tokens): token rows
  ``[T, padded)`` point at ``dummy_block_idx`` with local offset 0.
- ``padded request slots`` (kinds decode/commit/mha): slots ``[n, padded)`` have zero
  query and KV lengths, both ``cu_*`` arrays flat at ``cu[n]``, all -1 block rows.
- ``cu arrays`` (same kinds): ``cu[0] == 0``, non-decreasing over ``[0, padded]``; after
  a commit pass ``mha_cu_query_seq_lengths[padded]`` is the padded token count.
- ``block ids`` (kinds decode/commit/tokens): no real token holds a negative block
  (unallocated, or an id wrapped into a narrower dtype); a draft token's block in the
  draft loop's ``block_table`` fits the view's ``token_to_block_idx`` dtype (else the
  view holds a wrapped id); a device-route ``write_token_maps`` (record
  ``block_table``) and ``begin_decode`` (``meta._draft.unchecked_table``), whose ids the
  host did not check, hold exactly the ids they were given: compared once, at the
  first check after the call.
- ``inherited blocks`` (a last forward with ``inherited``): no real token whose block
  column is below its row's inherited count points at a real block. A draft depth
  (kind decode) has no redirect at all, so there the rule catches a broken scheduler:
  draft row ``i`` belongs to annotation row ``meta.draft_annotation_offset + i`` (the
  active slice; the offset is the paused-row count when paused rows come first, 0 by
  default), and its token must not land in one of that row's inherited blocks.
- ``committed KV`` (kinds commit/decode; while ``draft_annotation_offset`` is
  non-zero): a depth of the draft loop whose
  ``begin_decode`` came right after a commit pass (no view-writing call between) does
  not write a KV slot (block, local offset; the dummy block aside) that the same
  request wrote in that pass (draft row ``i`` is commit-pass request ``i``): the loop
  writes past what the pass committed. The pass's slots are read at its first
  check, so this needs a check after the commit pass (``MTPMETA_DEBUG=1`` makes one).

- ``prefix redirect`` and ``context rows`` (commit passes and draft depths whose row
  split is known: a split-served commit pass, or ``request_rows=(paused, total)``,
  with ``block_table`` for the second): ``split_checks.py``.

The first three (and the device-table part of ``block ids``) check the object and
are here; the view checks, from ``padded token rows`` on, are ``view_checks.py``, the
split's two ``split_checks.py``.

``install_debug_checks(cls)`` wraps the public methods so each call is followed by a
check; ``mtpmeta.metadata`` calls it at import when ``MTPMETA_DEBUG=1``.
"""

from __future__ import annotations

import functools
import inspect
import threading
import types
from typing import Any, Optional

import numpy as np

from mtpmeta.buffers.persistent import BUFFER_NAMES
from mtpmeta.errors import InvariantError
from mtpmeta.gpu_view import ViewTarget
from mtpmeta.debug.split_checks import check_request_rows, check_split_rows
from mtpmeta.debug.view_checks import _check_request_slots, _check_token_rows, _fail, _host
from mtpmeta.types import MTPForwardMode

__all__ = ["check_invariants", "install_debug_checks", "InvariantError"]

TOKEN_KINDS = ("decode", "commit", "tokens")  # records that wrote token rows
REQUEST_KINDS = ("decode", "commit", "mha")  # records that wrote request slots
# Records a COMMIT forward can end on: its pass, or writer calls made during it (the
# writers run in any mode; setup_decode_step needs DRAFT, so "decode" never follows).
COMMIT_KINDS = ("commit", "tokens", "mha")


# ---------------------------------------------------------------------- object state
def _check_forward_mode(meta: Any) -> bool:
    """The mode/buffer checks; returns whether the object holds buffers."""
    mode = meta.forward_mode
    held = [name for name in BUFFER_NAMES if getattr(meta, name) is not None]
    if not meta.enabled:
        if mode is not MTPForwardMode.NONE:
            _fail("forward mode", f"a disabled object must stay NONE, found {mode.name}")
        if held or meta.mirror is not None:
            _fail("forward mode", f"a disabled object must hold no buffers, holds "
                                  f"{held or ['a backend']}")
        return False
    if meta.mirror is None:  # enabled, not allocated (or deallocated)
        if held:
            _fail("forward mode", f"an unallocated object must hold no buffers, holds "
                                  f"{held}")
    elif len(held) != len(BUFFER_NAMES):
        missing = sorted(set(BUFFER_NAMES) - set(held))
        _fail("forward mode", f"an allocated object must hold every buffer, missing "
                              f"{missing}")
    if mode is MTPForwardMode.DRAFT:
        _check_active_views(meta)
    elif mode is MTPForwardMode.COMMIT:
        record = meta.last_forward
        kind = None if record is None else record.kind
        if kind not in COMMIT_KINDS:
            _fail("forward mode", f"COMMIT is entered by setup_commit_pass (writer calls "
                                  f"may follow it), but the last view-writing call was "
                                  f"{kind!r}")
    return bool(held)


def _check_active_views(meta: Any) -> None:
    offsets, table = meta.active_offsets, meta.active_block_table
    if offsets is None or table is None:
        _fail("forward mode", "DRAFT needs the active views (active_offsets, "
                              "active_block_table) that begin_decode sets; they are None")
    n, padded = meta.active_request_count, meta.padded_count
    if offsets.shape[0] != n or table.shape[0] != n:
        _fail("forward mode", f"DRAFT active views hold {offsets.shape[0]} offsets and "
                              f"{table.shape[0]} table rows, active_request_count is {n}")
    if not n <= padded <= meta.max_requests:
        _fail("forward mode", f"DRAFT padded_count {padded} outside [active_request_count "
                              f"{n}, max_requests {meta.max_requests}]")
    if meta.offsets is not None and n and (
            offsets.data_ptr() != meta.offsets.data_ptr()
            or table.data_ptr() != meta.block_table.data_ptr()):
        _fail("forward mode", "DRAFT active views are not prefixes of the persistent "
                              "offsets/block_table buffers")


def _check_annotations(meta: Any) -> None:
    annotations = _host(meta.request_matched_prefix_blocks)
    W = meta.max_kv_block_count
    bad = np.flatnonzero((annotations < 0) | (annotations > W))
    if bad.size:
        row = int(bad[0])
        _fail("annotations", f"request_matched_prefix_blocks[{row}] = "
                             f"{int(annotations[row])} outside [0, max_kv_block_count {W}]")


def _check_draft_offsets(meta: Any) -> None:
    if meta.forward_mode is not MTPForwardMode.DRAFT:
        return
    n = meta.active_request_count
    offsets = _host(meta.offsets)[:n].astype(np.int64)
    limit = meta.max_kv_block_count * meta.block_size_tokens
    bad = np.flatnonzero((offsets < 0) | (offsets > limit))
    if bad.size:
        i = int(bad[0])
        _fail("draft offsets", f"offsets[{i}] = {int(offsets[i])} (request {i} of {n}) "
                               f"outside [0, max_kv_block_count * block_size_tokens = "
                               f"{limit}]")


def _check_device_table_copy(meta: Any) -> None:
    """A ``begin_decode`` given a device block table (not value-checked on the host):
    at the first check after it, ``block_table[:n]`` must equal what it was given; an
    id that ``block_table_dtype`` cannot hold differs (the copy wrapped it)."""
    draft = getattr(meta, "_draft", None)
    pending = None if draft is None else draft.unchecked_table
    if pending is None or meta.block_table is None:
        return
    draft.unchecked_table = None  # compared once: the caller may reuse its tensor
    source, count = pending
    given = _host(source)[:count].astype(np.int64)
    held = _host(meta.block_table)[:count].astype(np.int64)
    bad = np.argwhere(given != held)
    if bad.size:
        i, c = (int(x) for x in bad[0])
        _fail("block ids", f"block_table[{i}, {c}] = {int(held[i, c])}, but begin_decode "
                           f"was given {int(given[i, c])}: an id block_table_dtype "
                           f"{meta.block_table_dtype} cannot hold wrapped around into "
                           f"another block (device inputs are not value-checked)")


# ---------------------------------------------------------------------------- entry
def check_invariants(meta: Any, gpu_view: Optional[Any] = None, *,
                     request_rows: Any = None, block_table: Any = None) -> None:
    """Check every invariant of ``meta`` and of its last forward's destination view.

    ``gpu_view`` defaults to ``meta.last_forward.gpu_view``; the view checks are skipped
    when there is no last forward or no view. ``request_rows`` / ``block_table``: the
    scheduler's row split and the context's whole table (``split_checks``). Raises
    ``InvariantError`` (an ``AssertionError``, raised explicitly) naming the first
    broken invariant and the offending row, token or slot. May sync (it reads device
    buffers back). Buffers on torch's ``meta`` device hold no values: a ``ValueError``
    (``MTPMETA_DEBUG=1`` skips such objects).
    """
    if gpu_view is not None:
        ViewTarget(gpu_view)  # a ValueError naming the field for a non-view argument
    if _holds_no_values(meta):
        raise ValueError("check_invariants: the buffers are on torch's meta device, "
                         "which holds no values to check")
    request_rows = check_request_rows(meta, request_rows)
    if block_table is not None and request_rows is None:
        raise ValueError("block_table: the context's table needs request_rows=(paused, "
                         "total), the split its rows follow")
    if not _check_forward_mode(meta):
        return
    _check_annotations(meta)
    _check_draft_offsets(meta)
    _check_device_table_copy(meta)
    record = meta.last_forward
    if record is None:
        return
    view = gpu_view if gpu_view is not None else record.gpu_view
    if view is None:
        return
    if record.kind in TOKEN_KINDS:
        _check_token_rows(meta, record, view)
        check_split_rows(meta, record, view, request_rows, block_table)
    if record.kind in REQUEST_KINDS:
        _check_request_slots(record, view)


def _holds_no_values(meta: Any) -> bool:
    """Whether ``meta``'s buffers are on torch's ``meta`` device (a host-cost bench):
    shapes without values, so no invariant can be read."""
    offsets = meta.offsets  # None before allocate
    return offsets is not None and offsets.device.type == "meta"


# ------------------------------------------------------------------- debug wrapping
_IN_CALL = threading.local()  # ids of objects inside a checked call, per thread


def _checked(method: types.FunctionType) -> Any:
    @functools.wraps(method)
    def checked(self: Any, *args: Any, **kwargs: Any) -> Any:
        busy = _IN_CALL.__dict__.setdefault("ids", set())
        if id(self) in busy:  # a public method called from another: check once, outside
            return method(self, *args, **kwargs)
        busy.add(id(self))
        try:
            result = method(self, *args, **kwargs)
        finally:
            busy.discard(id(self))
        if not _holds_no_values(self):  # on meta (a host-cost bench) nothing to read
            check_invariants(self)
        return result

    checked.__invariant_checked__ = True
    return checked


def install_debug_checks(cls: type) -> None:
    """Wrap every public method of ``cls`` (properties and ``check_invariants`` aside)
    so that ``check_invariants(self)`` runs after each call that returns normally (a
    call that raises keeps its own exception). Nested public calls are checked once, by
    the outermost. Idempotent; a subclass can be wrapped without touching its base."""
    for name in dir(cls):
        if name.startswith("_") or name == "check_invariants":
            continue
        member = inspect.getattr_static(cls, name)
        if isinstance(member, types.FunctionType) and \
                not getattr(member, "__invariant_checked__", False):
            setattr(cls, name, _checked(member))
