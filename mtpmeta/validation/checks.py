"""The checks of ``MTPMetadata``'s forwards: the destination view a writer resolves,
the draft loop (``begin_decode``, each depth) and the commit pass
(``stage_prefill_lengths``, ``setup_commit_pass``). Their shared half (the kernels'
status codes and decoders, the block-id range checks, the destination-view bounds) is
``mtpmeta.validation.bounds``; construction and ``allocate`` are ``config``, the row
calls ``rows``, the chunk carry ``carry``, the two view writers ``writer_inputs``.

A ``check_*`` takes the object's ``Geometry`` (and the resolved destination view where
the method writes one) with the caller's raw inputs. It raises ``ValueError``,
``IndexError`` or ``InvalidDtypeError`` naming the argument and the bound before anything
is written, and returns the inputs the backend takes: C-contiguous int32/int64 numpy
arrays and plain ints, or the caller's device tensors on the mirror path's device-op
route (shapes and dtypes checked; values are not read, that would sync). Tuples, not
named records: a record costs about 0.5 µs per call, a tenth of a ``write_token_maps``.

Kernels that write scan first and refuse without writing; the ``raise_*`` functions
(here and in ``bounds``) turn a refusal (a ``TokenStatus`` code or the refused index)
into the error the caller sees. Raw-input conversion is ``mtpmeta.validation.inputs``.
Explicit raises, never ``assert``: they hold under ``python -O``.
"""

from __future__ import annotations

from typing import Any, Optional, Tuple

import numpy as np
import torch

from mtpmeta.gpu_view import ViewTarget
from mtpmeta.kernels import native
from mtpmeta.kernels.counted import first_row_past_packed
from mtpmeta.validation.block_counts import (as_block_counts, check_commit_counts,
                                             raise_past_count, refuse_device_table)
from mtpmeta.validation.bounds import (_check_block_column, _check_view_capacity,
                                       _check_view_width, _INT32_DTYPE as _INT32,
                                       _INT32_MAX, _INT32_MIN, _raise_commit_status,
                                       _raise_inherited_range, _raise_written_block,
                                       _scan_rows_fit, _shortest_token_field,
                                       check_padded, check_rows_fit)
from mtpmeta.validation.geometry import CommitInputs, DecodeInputs, Geometry
from mtpmeta.validation.inputs import (INT32_LIMIT, as_count, as_host_counts, as_host_ints,
                                       as_host_request_ints, as_optional_per_request,
                                       check_device_tensors, is_device_tensor)

__all__ = ["check_view_device", "check_decode_counts", "check_begin_decode",
           "check_draft_blocks", "raise_draft_block", "check_decode_view",
           "raise_position_error", "check_prefill_lengths", "check_commit_inputs",
           "check_device_rows", "raise_commit_block", "refuse_unallocated_inherited"]

_ndarray = np.ndarray
_HOST_OR_NONE = (np.ndarray, type(None))  # no read-back to consider: the host route
_first_bad_draft_block = native.checks.first_bad_draft_block
_INHERITED_OUT_OF_RANGE = native.checks.INHERITED_OUT_OF_RANGE
_first_unallocated_inherited = native.checks.first_unallocated_inherited


# ------------------------------------------------------------ destination view
def check_view_device(geo: Geometry, target: ViewTarget) -> None:  # every writer
    """A destination view, resolved once, lies on the buffers' device, and its block
    fields hold ``dummy_block_idx`` (pad rows write it; a wrapped D is a real block)."""
    if target.device != geo.device:
        raise ValueError(f"gpu_view: fields on {target.device}, but buffers were "
                         f"allocated on {geo.device}")
    for name, (low, high) in (("token_to_block_idx", target.token_block_range),
                              ("mha_block_table", target.table_block_range)):
        if not low <= geo.dummy_block_idx <= high:
            raise ValueError(f"dummy_block_idx: {geo.dummy_block_idx} does not fit "
                             f"gpu_view.{name} dtype "
                             f"{getattr(target.fields, name).dtype} (max {high})")


# ------------------------------------------------------------------ draft loop
def check_decode_counts(geo: Geometry, active_request_count: Any,
                        padded_count: Any) -> Tuple[int, int]:
    """``(n, p)`` with ``0 <= n <= p <= max_requests``."""
    if type(active_request_count) is int and type(padded_count) is int and \
            0 <= active_request_count <= padded_count <= geo.max_requests:
        return active_request_count, padded_count  # the hot path: plain ints in range
    count = as_count(active_request_count, "active_request_count",
                     high=geo.max_requests, high_name="max_requests")
    padded = check_padded(padded_count, "padded_count", count,
                          "active_request_count {count}", high=geo.max_requests,
                          high_name="max_requests")
    return count, padded


def check_begin_decode(geo: Geometry, active_request_count: Any, padded_count: Any,
                       start_positions: Any, block_table_src: Any,
                       block_counts: Any = None) -> DecodeInputs:
    """``begin_decode``'s inputs. Host start positions are range-checked by the copy
    kernel (``raise_position_error`` decodes its refusal). The counts are checked as
    in ``check_decode_counts``; ``block_counts`` (opt-in, host ints ``[>= n]`` in
    ``[0, W]``, ``mtpmeta.validation.block_counts``) comes back as the sixth item (None without)."""
    count, padded = active_request_count, padded_count
    if not (type(count) is int and type(padded) is int and
            0 <= count <= padded <= geo.max_requests):  # else check_decode_counts' hot path
        count, padded = check_decode_counts(geo, active_request_count, padded_count)
    host_table = None  # a host table's values beside device start positions
    if geo.mirror and (is_device_tensor(start_positions, geo.runtime)
                       or is_device_tensor(block_table_src, geo.runtime)):
        if block_counts is not None:
            refuse_device_table("block_table_src")
        if is_device_tensor(block_table_src, geo.runtime):
            check_device_tensors(geo.device, (("start_positions", start_positions, 1),
                                              ("block_table_src", block_table_src, 2)))
        else:  # the engine's pinned host table: its rows are checked here, on the host
            check_device_tensors(geo.device, (("start_positions", start_positions, 1),))
            if not isinstance(block_table_src, torch.Tensor):
                raise ValueError(f"block_table_src: with device start positions, a "
                                 f"tensor (on the host or on {geo.device}), got a "
                                 f"{type(block_table_src).__name__}")
            low, high = geo.table_range
            if block_table_src.dtype is not torch.int32 or block_table_src.dim() != 2 \
                    or low > _INT32_MIN or high < _INT32_MAX:  # else every id fits: no read
                host_table = as_host_ints(block_table_src, "block_table_src", ndim=2)
        starts, table, on_device = start_positions, block_table_src, True
    else:
        starts = as_host_ints(start_positions, "start_positions")
        table = as_host_ints(block_table_src, "block_table_src", ndim=2)
        on_device = False
    if starts.shape[0] < count:
        raise ValueError(f"start_positions: {starts.shape[0]} entries < "
                         f"active_request_count {count}")
    rows, width = table.shape
    if rows < count or width != geo.max_kv_block_count:
        raise ValueError(f"block_table_src: shape {tuple(table.shape)}, expected "
                         f"[>= {count}, max_kv_block_count {geo.max_kv_block_count}]")
    used = None if block_counts is None else as_block_counts(
        geo, block_counts, count, geo.max_kv_block_count)
    checked = host_table if on_device else table  # None: a device table, unread
    low, high = geo.table_range  # check_rows_fit's free case inlined: every begin
    if checked is not None and not (checked.dtype is _INT32 and low <= _INT32_MIN and
                                    high >= _INT32_MAX):
        check_rows_fit(checked, count, geo.table_range, "block_table_src",
                       "block_table_dtype", geo.block_table_dtype, used)
    return count, padded, starts, table, on_device, used


def check_draft_blocks(geo: Geometry, target: ViewTarget, offsets: np.ndarray,
                       table: np.ndarray, count: int,
                       counts: Optional[np.ndarray] = None) -> None:
    """One draft depth's table rows, on the host copy of the draft state (offsets int32
    [R], table [R, W] of block_table_dtype, or a counted or derived begin's packed
    ``[n, C]`` rows; ``counts`` as in ``raise_draft_block``): when
    ``block_table_dtype`` holds more than the view's ``mha_block_table``, every entry of
    the rows ``[:count]`` (copied there whole) fits it. The block each real row writes
    is checked by the depth's kernel itself (``native.staging.decode_step_maps``;
    ``raise_draft_block`` names a refusal), and here first only with such a wide table,
    so that its refusal is the one named. A row whose column lies past packed rows is
    past its count (a -1 column for derived counts): refused here in row order too."""
    low, high = geo.table_range
    row_low, row_high = target.table_block_range
    if low < row_low or high > row_high:
        row = _first_bad_draft_block(offsets, table, count, geo.block_size_tokens,
                                     target.token_block_range[1])
        if table.shape[1] < geo.max_kv_block_count:  # packed: rows past C count too
            row = first_row_past_packed(offsets, count, geo.block_size_tokens,
                                        table.shape[1], row)
        if row >= 0:
            raise_draft_block(geo, target, offsets, table, row, counts)
        _scan_rows_fit(table, count, target.table_block_range, _DRAFT_TABLE,
                       "gpu_view.mha_block_table dtype", target.fields.mha_block_table.dtype)


def raise_draft_block(geo: Geometry, target: ViewTarget, offsets: np.ndarray,
                      table: np.ndarray, row: int,
                      counts: Optional[np.ndarray] = None) -> None:
    """Name the draft row whose written block the depth's kernel refused (``-2 - row``):
    at or past its opt-in block count (``counts``, None without), negative
    (unallocated) or past ``token_to_block_idx``. ``table`` may be packed ``[n, C]``
    rows: past ``C`` a counted begin's row is past its count (raised first) and a
    derived begin's holds -1, the caller's value there."""
    raise_past_count(geo, target, offsets, table, counts, row)
    column = int(offsets[row]) // geo.block_size_tokens
    block = int(table[row, column]) if column < table.shape[1] else -1
    _raise_written_block(_DRAFT_TABLE, block, row, column,
                         f"draft row {row} (offset {int(offsets[row])})", target)


_DRAFT_TABLE = "block_table (the draft loop's, from begin_decode)"


def check_decode_view(geo: Geometry, target: ViewTarget, padded: int) -> None:
    """A draft depth's view holds ``padded`` tokens and requests at width ``W``.
    ``setup_decode_step`` calls it only when its inline comparison fails."""
    _check_view_capacity(target, tokens=padded, requests=padded)
    _check_view_width(target, geo.max_kv_block_count, "max_kv_block_count")


def raise_position_error(geo: Geometry, name: str, positions: np.ndarray,
                         count: int) -> None:
    """Name the bad position in ``positions[:count]`` that a kernel refused."""
    low, high = native.checks.min_max(positions, count)
    if low < 0:
        raise ValueError(f"{name}: negative position {low}")
    _check_block_column(geo, name, high)
    raise ValueError(f"{name}: a position lies outside the block table")


# ----------------------------------------------------------------- commit pass
def check_prefill_lengths(geo: Geometry, append_counts: Any,
                          pad_tokens: Any) -> Tuple[Any, int, bool]:
    """``(counts, pad_tokens, on_device)`` for ``stage_prefill_lengths``."""
    pad = as_count(pad_tokens, "pad_tokens", high=INT32_LIMIT - 1,
                   high_name="int32 length limit")
    if geo.mirror and is_device_tensor(append_counts, geo.runtime):
        check_device_tensors(geo.device, (("append_counts", append_counts, 1),))
        if append_counts.shape[0] > geo.max_requests:
            raise ValueError(f"append_counts: shape {tuple(append_counts.shape)}, "
                             f"expected [P <= max_requests {geo.max_requests}]")
        return append_counts, pad, True
    return as_host_counts(geo.max_requests, append_counts, "append_counts"), pad, False


def check_commit_inputs(geo: Geometry, target: ViewTarget, append_counts: Any,
                        block_table: Any, start_positions: Any, inherited_blocks: Any,
                        padded_token_count: Any, padded_request_count: Any,
                        block_counts: Any = None) -> CommitInputs:
    """``setup_commit_pass``'s inputs, values included (a device tensor is read back
    through the runtime: the documented sync). ``block_counts`` (opt-in, host ints
    ``[>= P]`` in ``[0, table width]``) needs a host ``block_table``; a token at or past
    its request's count is refused."""
    if block_counts is not None and geo.mirror and is_device_tensor(block_table,
                                                                    geo.runtime):
        refuse_device_table("block_table")
    if geo.mirror and not (type(append_counts) is _ndarray and type(block_table) is _ndarray
                           and type(start_positions) in _HOST_OR_NONE
                           and type(inherited_blocks) in _HOST_OR_NONE):
        # (a meta tensor is left to as_host_ints, which names it)
        append_counts, block_table, start_positions, inherited_blocks = (
            geo.runtime.to_host(x) if is_device_tensor(x, geo.runtime)
            and x.device.type != "meta" else x
            for x in (append_counts, block_table, start_positions, inherited_blocks))
    # The counts' values are scanned by native.checks.check_commit_inputs below.
    counts = as_host_ints(append_counts, "append_counts")
    num_prefill = counts.shape[0]
    if num_prefill > geo.max_requests:  # as_host_request_ints names the bound
        as_host_request_ints(geo.max_requests, counts, "append_counts")
    table = as_host_ints(block_table, "block_table", ndim=2)
    table_rows, width = table.shape
    if table_rows < num_prefill:
        raise ValueError(f"block_table: {table_rows} rows < {num_prefill} requests "
                         "(append_counts)")
    if width != target.width:
        _check_view_width(target, width, "block_table width")
    starts = None if start_positions is None else as_host_ints(start_positions,
                                                               "start_positions")
    inherited = None if inherited_blocks is None else as_host_ints(inherited_blocks,
                                                                   "inherited_blocks")
    # Too few entries: as_optional_per_request raises, naming the argument.
    if starts is not None and starts.shape[0] < num_prefill:
        as_optional_per_request(starts, "start_positions", num_prefill)
    if inherited is not None and inherited.shape[0] < num_prefill:
        as_optional_per_request(inherited, "inherited_blocks", num_prefill)
    columns = geo.max_kv_block_count
    if width < columns:
        columns = width
    code, culprit, total, _ = native.checks.check_commit_inputs(
        counts, counts if starts is None else starts, starts is not None, columns,
        geo.block_size_tokens)
    if code:
        _raise_commit_status(geo, code, culprit, counts, starts, columns)
    used = None
    if block_counts is not None:
        used = check_commit_counts(geo, counts, starts, block_counts, table.shape[1])
    low, high = target.table_block_range  # the same, inlined: every commit
    if not (table.dtype is _INT32 and low <= _INT32_MIN and high >= _INT32_MAX):
        check_rows_fit(table, num_prefill, target.table_block_range, "block_table",
                       "gpu_view.mha_block_table dtype", target.fields.mha_block_table.dtype,
                       used)
    # The written blocks and inherited counts: scanned by the commit kernel itself,
    # before its first write (raise_commit_block names a refusal).
    max_tokens = target.max_tokens
    if total > max_tokens:
        raise ValueError(f"append_counts: {total} tokens > max_tokens "
                         f"{max_tokens} of gpu_view{_shortest_token_field(target)}")
    # Plain ints in range take the inline test; anything else check_padded's.
    if padded_token_count is None:
        padded_tokens = total
    elif type(padded_token_count) is int and total <= padded_token_count <= max_tokens:
        padded_tokens = padded_token_count
    else:
        padded_tokens = check_padded(
            padded_token_count, "padded_token_count", total, "total append_counts {count}",
            high=max_tokens, high_name="gpu_view max_tokens")
    pad = padded_tokens - total
    staged = num_prefill + 1 if pad > 0 and num_prefill < geo.max_requests \
        else num_prefill
    if padded_request_count is None:
        min_padded = num_prefill
    elif type(padded_request_count) is int and padded_request_count >= num_prefill:
        min_padded = padded_request_count
    else:
        min_padded = check_padded(padded_request_count, "padded_request_count",
                                  num_prefill, "number of requests {count} (append_counts)")
    padded_requests = min_padded if min_padded > staged else staged
    if padded_requests > target.max_requests:
        _check_view_capacity(target, requests=padded_requests)
    return (counts, starts, table, inherited, total, padded_tokens, pad, min_padded,
            padded_requests, used)


_ROW_DTYPES = (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8)


def check_device_rows(geo: Geometry, device_table: Any, table: np.ndarray,
                      num_prefill: int) -> Optional[torch.Tensor]:
    """``setup_commit_pass``'s ``device_block_table``: an integer tensor ``[>= P, W]``
    (``W``: the host ``table``'s width) on the persistent buffers' device; anything
    else is a ``ValueError`` naming it. Returns it on the mirror path, None on the
    direct path (whose buffers are on the host: the host rows are written)."""
    if not (isinstance(device_table, torch.Tensor) and device_table.dim() == 2
            and device_table.dtype in _ROW_DTYPES):
        raise ValueError(f"device_block_table: expected a 2-D integer tensor, got "
                         f"{getattr(device_table, 'shape', type(device_table).__name__)} "
                         f"of {getattr(device_table, 'dtype', None)}")
    if device_table.device != geo.device:
        raise ValueError(f"device_block_table: on {device_table.device}, not the "
                         f"persistent buffers' device {geo.device}")
    rows, width = device_table.shape
    if rows < num_prefill or width != table.shape[1]:
        raise ValueError(f"device_block_table: shape {tuple(device_table.shape)}, expected "
                         f"[>= {num_prefill}, {table.shape[1]}] (append_counts, "
                         f"block_table width)")
    return device_table if geo.mirror else None


def raise_commit_block(geo: Geometry, target: ViewTarget, code: int, r: int,
                       column: int, counts: np.ndarray, starts: Optional[np.ndarray],
                       table: np.ndarray, inherited: Optional[np.ndarray]) -> None:
    """Name the refusal of ``native.staging.commit_pass`` (``(-code, r, column, 0)``):
    request ``r``'s inherited count outside ``[0, W]``, or the block at ``[r, column]``
    it writes negative or past ``token_to_block_idx``."""
    if code == _INHERITED_OUT_OF_RANGE:
        _raise_inherited_range(geo, inherited, r)
    start = 0 if starts is None else int(starts[r])
    _raise_written_block("block_table", int(table[r, column]), r, column,
                         f"request {r} (positions {start}..{start + int(counts[r]) - 1})",
                         target)


def refuse_unallocated_inherited(table: np.ndarray, inherited: np.ndarray,
                                 counts: np.ndarray, used: Optional[np.ndarray]) -> None:
    """Refuse an inherited count that covers an unallocated (negative) column of its
    request's row (``native.checks.first_unallocated_inherited``): a shared prefix
    block is allocated, so the count is wrong, and it would send the request's own KV
    to the dummy block. A ``ValueError`` before anything is written."""
    r, column = _first_unallocated_inherited(table, inherited, counts.shape[0],
                                             inherited if used is None else used,
                                             used is not None)
    if r >= 0:
        raise ValueError(f"inherited_blocks: request {r} inherits {int(inherited[r])} "
                         f"blocks, but block_table[{r}, {column}] is "
                         f"{int(table[r, column])} (unallocated): an inherited block is "
                         "a shared prefix block the request's row holds")
