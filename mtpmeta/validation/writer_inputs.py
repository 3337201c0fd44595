"""The input checks of the two view writers, ``write_token_maps`` and
``write_mha_metadata`` (contract §7, §8): as ``mtpmeta.validation.checks`` does for the fused calls,
each raises ``ValueError``/``IndexError`` naming the argument and the bound before
anything is written, and returns the backend's inputs (host numpy arrays, or the caller's
device tensors on the mirror path's device-op route, shapes checked, values unread).
"""

from __future__ import annotations

from typing import Any

from mtpmeta.kernels import native
from mtpmeta.validation.bounds import (_check_view_width, _padded_tokens, _raise_inherited_range,
                           _raise_token_status, _raise_written_block,
                           _shortest_request_field, check_padded, check_rows_fit)
from mtpmeta.gpu_view import ViewTarget
from mtpmeta.kernels.entry import kernel_optional
from mtpmeta.validation.geometry import Geometry, MhaInputs, TokenInputs
from mtpmeta.validation.inputs import (INT32_LIMIT, as_host_ints, check_device_tensors,
                                       is_device_tensor)

__all__ = ["check_token_inputs", "check_mha_inputs"]

_first_outside = native.checks.first_outside
_first_bad_token_block = native.checks.first_bad_token_block
_INHERITED_OUT_OF_RANGE = native.checks.INHERITED_OUT_OF_RANGE


def check_token_inputs(geo: Geometry, target: ViewTarget, rows: Any, positions: Any,
                       block_table: Any, padded_token_count: Any,
                       inherited_blocks: Any) -> TokenInputs:
    """``write_token_maps``'s inputs; on the host, every token's row and position are
    scanned (``native.checks.check_token_inputs``) before anything is written."""
    if geo.mirror and any(is_device_tensor(x, geo.runtime) for x in
                          (rows, positions, block_table, inherited_blocks)):
        named = (("rows", rows, 1), ("positions", positions, 1),
                 ("block_table", block_table, 2), ("inherited_blocks", inherited_blocks, 1))
        check_device_tensors(geo.device, named[:3] if inherited_blocks is None else named)
        if rows.shape[0] != positions.shape[0]:
            raise ValueError(f"rows: {rows.shape[0]} entries, positions: "
                             f"{positions.shape[0]}; they must have the same length")
        count = positions.shape[0]
        padded = _padded_tokens(target, padded_token_count, count)
        return rows, positions, block_table, inherited_blocks, count, padded, True
    rows_np = as_host_ints(rows, "rows")
    positions_np = as_host_ints(positions, "positions")
    table = as_host_ints(block_table, "block_table", ndim=2)
    inherited = None if inherited_blocks is None else as_host_ints(
        inherited_blocks, "inherited_blocks")
    count = positions_np.shape[0]
    if rows_np.shape[0] != count:
        raise ValueError(f"rows: {rows_np.shape[0]} entries, positions: {count}; they "
                         "must have the same length")
    padded = _padded_tokens(target, padded_token_count, count)
    columns = min(geo.max_kv_block_count, table.shape[1])
    code, t = native.checks.check_token_inputs(
        rows_np, positions_np, table.shape[0],
        0 if inherited is None else inherited.shape[0], inherited is not None, columns,
        geo.block_size_tokens)
    if code:
        _raise_token_status(geo, code, t, rows_np, positions_np, table, inherited,
                            columns)
    code, t = _first_bad_token_block(
        rows_np, positions_np, table, *kernel_optional(inherited), geo.block_size_tokens,
        geo.max_kv_block_count, target.token_block_range[1])
    if code == _INHERITED_OUT_OF_RANGE:
        _raise_inherited_range(geo, inherited, int(rows_np[t]))
    if code:
        row, column = int(rows_np[t]), int(positions_np[t]) // geo.block_size_tokens
        _raise_written_block("block_table", int(table[row, column]), row, column,
                             f"token {t} (position {int(positions_np[t])})", target)
    return rows_np, positions_np, table, inherited, count, padded, False


def check_mha_inputs(geo: Geometry, target: ViewTarget, query_lengths: Any,
                     kv_lengths: Any, block_table: Any,
                     padded_request_count: Any) -> MhaInputs:
    """``write_mha_metadata``'s inputs; ``kv_lengths`` may be ``query_lengths`` itself."""
    if geo.mirror and any(is_device_tensor(x, geo.runtime) for x in
                          (query_lengths, kv_lengths, block_table)):
        check_device_tensors(geo.device, (("query_lengths", query_lengths, 1),
                                          ("kv_lengths", kv_lengths, 1),
                                          ("block_table", block_table, 2)))
        q, kv, table, on_device = query_lengths, kv_lengths, block_table, True
    else:
        q = as_host_ints(query_lengths, "query_lengths")
        kv = q if kv_lengths is query_lengths else as_host_ints(kv_lengths, "kv_lengths")
        table = as_host_ints(block_table, "block_table", ndim=2)
        on_device = False
    count = q.shape[0]
    if kv.shape[0] != count:
        raise ValueError(f"kv_lengths: {kv.shape[0]} entries, query_lengths: {count}; "
                         "they must have the same length")
    if table.shape[0] > count:
        raise ValueError(f"block_table: {table.shape[0]} rows > {count} requests "
                         "(query_lengths)")
    _check_view_width(target, table.shape[1], "block_table width")
    if not on_device:
        check_rows_fit(table, table.shape[0], target.table_block_range, "block_table",
                       "gpu_view.mha_block_table dtype", target.fields.mha_block_table.dtype)
        for name, lengths in (("query_lengths", q), ("kv_lengths", kv)):
            bad = _first_outside(lengths, 0, INT32_LIMIT)
            if bad >= 0:
                kind = "negative length" if lengths[bad] < 0 else "length beyond int32"
                raise ValueError(f"{name}: {kind} {int(lengths[bad])} at index {bad}")
    if count > target.max_requests:
        raise ValueError(f"query_lengths: {count} requests > max_requests "
                         f"{target.max_requests} of gpu_view"
                         f"{_shortest_request_field(target)}")
    padded = check_padded(padded_request_count, "padded_request_count", count,
                          "number of requests {count}", high=target.max_requests,
                          high_name="gpu_view max_requests")
    return q, kv, table, count, padded, on_device
